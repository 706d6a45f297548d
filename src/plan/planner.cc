// planner.cc — MakePlan: check the inputs, rank the parameters, choose tiers under the budget,
// then lay out, bucket and predict.
//
// Memory model (what must fit in the budget): the larger of the probe's measured peak and the
// bytes of every parameter plus the gradients of the trainable ones, plus the device arena. The
// probe's peak already holds parameters, gradients and activations; a CPU probe reports 0, so the
// parameter and gradient bytes stand in for it. emsa's own workspace adds nothing yet.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "emsa/plan.h"
#include "emsa/update.h"
#include "plan/costs.h"
#include "plan/hotness.h"
#include "plan/layout.h"
#include "plan/schedule.h"

namespace emsa {
namespace {

using plan_internal::DeviceSizer;
using plan_internal::LayoutOrder;

// Alignments past this would let the padding of a million parameters outgrow uint64.
constexpr uint64_t kMaxAlignment = uint64_t{1} << 30;

bool IsPowerOfTwo(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

std::string Bytes(uint64_t bytes) {
  return FormatBytes(bytes) + " (" + std::to_string(bytes) + " bytes)";
}

Status ValidateOptions(const PlanOptions& o) {
  EMSA_RETURN_IF_ERROR(ValidateOptimizer(o.optimizer, "options.optimizer"));
  if (o.state_dtype != DType::kFloat32 && o.state_dtype != DType::kBFloat16) {
    return Status::InvalidArgument(
        std::string("options.state_dtype ") +
        (o.state_dtype == DType::kFloat16 ? "float16"
                                          : std::to_string(static_cast<int>(o.state_dtype))) +
        " is not supported for optimizer state; use float32 or bfloat16");
  }
  if (!(o.device_update_share == -1.0 ||
        (o.device_update_share >= 0.0 && o.device_update_share <= 1.0))) {
    return Status::InvalidArgument("options.device_update_share is " +
                                   std::to_string(o.device_update_share) +
                                   "; use -1 (balanced by the planner) or a share in [0, 1]");
  }
  if (o.bucket_bytes == 0 || o.bucket_bytes > ProbeRecord::kMaxBytes) {
    return Status::InvalidArgument("options.bucket_bytes is " + std::to_string(o.bucket_bytes) +
                                   "; use a positive size up to " +
                                   FormatBytes(ProbeRecord::kMaxBytes) + ", such as 32MiB");
  }
  const struct {
    const char* name;
    uint64_t value;
  } aligns[] = {{"device_module_alignment", o.device_module_alignment},
                {"device_tensor_alignment", o.device_tensor_alignment},
                {"host_tensor_alignment", o.host_tensor_alignment}};
  for (const auto& a : aligns) {
    if (!IsPowerOfTwo(a.value) || a.value > kMaxAlignment) {
      return Status::InvalidArgument(
          std::string("options.") + a.name + " is " + std::to_string(a.value) +
          "; it must be a power of two up to " + std::to_string(kMaxAlignment));
    }
  }
  if (o.device_module_alignment < o.device_tensor_alignment) {
    return Status::InvalidArgument(
        "options.device_module_alignment (" + std::to_string(o.device_module_alignment) +
        ") is smaller than options.device_tensor_alignment (" +
        std::to_string(o.device_tensor_alignment) + "); make it at least as large");
  }
  if (o.force_all_host && !o.allow_host_tier) {
    return Status::InvalidArgument(
        "options.force_all_host and options.allow_host_tier = false contradict each other; "
        "set at most one of them");
  }
  return Status::Ok();
}

// The budget actually applied; 0 = no device limit. min_budget only words the error.
Result<uint64_t> ResolveBudget(const PlanOptions& options, const DeviceProfile& profile,
                               uint64_t min_budget) {
  if (options.budget_bytes != 0) return options.budget_bytes;
  if (!profile.gpu.present) return uint64_t{0};
  const uint64_t memory =
      profile.gpu.free_memory != 0 ? profile.gpu.free_memory : profile.gpu.total_memory;
  if (memory == 0) return uint64_t{0};  // a GPU that reported no memory: nothing to hold to
  if (memory <= options.safety_margin_bytes) {
    return Status::Infeasible(
        "the GPU has " + Bytes(memory) + " free, no more than the safety margin " +
        Bytes(options.safety_margin_bytes) + "; the smallest budget that works is " +
        Bytes(min_budget) + ": free device memory, lower the margin or name a budget");
  }
  return memory - options.safety_margin_bytes;
}

uint64_t BaseDeviceBytes(const ProbeRecord& record, const PlanOptions& options) {
  uint64_t weights = 0, grads = 0;
  for (const ParamRecord& p : record.params) {
    weights += p.bytes;
    if (p.trainable) grads += p.bytes;
  }
  if (!options.release_grads) return std::max(record.peak_device_bytes, weights + grads);
  // Gradients freed as they are used: what a sample held of them by its time is gone, but
  // for about two buckets in flight (one being copied or updated, one being produced).
  const uint64_t in_flight = std::min(grads, 2 * options.bucket_bytes);
  // released_by(t): the bytes of the gradients final by time t, from the ready times sorted once
  // and their running sums, so each sample costs a binary search.
  std::vector<std::pair<double, uint64_t>> ready;
  for (const ParamRecord& p : record.params) {
    if (p.trainable && p.grad_ready_order >= 0) ready.emplace_back(p.grad_ready_time, p.bytes);
  }
  std::sort(ready.begin(), ready.end());
  std::vector<double> times(ready.size());
  std::vector<uint64_t> sums(ready.size() + 1, 0);
  for (size_t i = 0; i < ready.size(); ++i) {
    times[i] = ready[i].first;
    sums[i + 1] = sums[i] + ready[i].second;
  }
  auto released_by = [&](double t) {
    return sums[static_cast<size_t>(std::upper_bound(times.begin(), times.end(), t) -
                                    times.begin())];
  };
  // The record's peak has no time: place it at its largest sample (a transient inside a
  // module, such as the loss's gradient, peaks next to it); without samples, assume it held
  // every gradient.
  uint64_t held = 0;
  double peak_time = -1.0;
  uint64_t largest = 0;
  for (const MemorySample& m : record.memory) {
    const uint64_t r = released_by(m.time);
    held = std::max(held, m.device_bytes > r ? m.device_bytes - r : 0);
    if (m.device_bytes > largest) {
      largest = m.device_bytes;
      peak_time = m.time;
    }
  }
  const uint64_t at_peak = peak_time >= 0.0 ? released_by(peak_time) : grads;
  held =
      std::max(held, record.peak_device_bytes > at_peak ? record.peak_device_bytes - at_peak : 0);
  return std::max(held, weights) + in_flight;
}

// Marks the first k params of `order` as host-tier.
void MarkHost(const std::vector<int64_t>& order, size_t k, std::vector<char>* on_host) {
  std::fill(on_host->begin(), on_host->end(), 0);
  for (size_t j = 0; j < k; ++j) (*on_host)[static_cast<size_t>(order[j])] = 1;
}

// One entry per parameter of the record, not yet ranked or placed.
Plan StartPlan(const ProbeRecord& record, const PlanOptions& options) {
  Plan plan;
  plan.options = options;
  plan.params.resize(record.params.size());
  for (size_t i = 0; i < record.params.size(); ++i) {
    const ParamRecord& rec = record.params[i];
    ParamPlan& p = plan.params[i];
    p.index = static_cast<int64_t>(i);
    p.name = rec.name;
    p.module = rec.module;
    p.numel = rec.numel;
    p.param_dtype = rec.dtype;
    p.trainable = rec.trainable;
    p.state_dtype = options.state_dtype;
  }
  return plan;
}

// With any state on the host, room for the staging of GPU-updated parameters unless none may be
// (a little more than needed when the planner then chooses none).
uint64_t HostStagingBytes(const Plan& plan, bool gpu_present) {
  int64_t largest = 0;  // the largest parameter the GPU could update
  for (const ParamPlan& p : plan.params) {
    if (p.trainable && plan_internal::DeviceUpdatable(p.param_dtype)) {
      largest = std::max(largest, p.numel);
    }
  }
  return plan_internal::DeviceUpdatesAllowed(plan.options, gpu_present) && largest > 0
             ? plan_internal::StreamStagingBytes(plan.options, largest)
             : 0;
}

Status BudgetTooSmall(const PlanOptions& options, uint64_t budget, uint64_t base,
                      uint64_t min_budget) {
  const std::string advice = options.allow_host_tier
                                 ? "or shrink the activations (smaller batch or sequence, "
                                   "activation checkpointing)"
                                 : "allow the host tier, or use bfloat16 state";
  return Status::Infeasible("the device budget " + Bytes(budget) +
                            " is too small: weights, gradients and activations take " +
                            Bytes(base) + " and the smallest optimizer state arena " +
                            Bytes(min_budget - base) + "; the smallest budget that works is " +
                            Bytes(min_budget) + ": raise the budget to at least that, " + advice);
}

// How many params of the offload order go to the host: all when forced, none when everything
// fits, else the fewest whose device need fits the budget. Moving one more param to the host
// never grows the device arena (sizes only shrink, and a module that drops under the module
// alignment only loosens its start), so past k = 0 (where the staging joins) the need is
// non-increasing in k, and bisection finds the smallest k that fits; device_need(k_max) fits.
template <typename Need>
size_t HostCount(const PlanOptions& options, uint64_t budget, uint64_t base, size_t n, size_t k_max,
                 const Need& device_need) {
  if (options.force_all_host) return n;
  if (budget == 0 || base + device_need(0) <= budget) return 0;
  size_t lo = 1, hi = k_max;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (base + device_need(mid) <= budget) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

void AssignTiers(const std::vector<char>& on_host, Plan* plan) {
  for (ParamPlan& p : plan->params) {
    if (!p.trainable) continue;
    p.tier = on_host[static_cast<size_t>(p.index)] ? Tier::kL2 : Tier::kL1;
    p.master_weights = p.tier == Tier::kL2 || p.param_dtype != DType::kFloat32;
  }
}

}  // namespace

Result<Plan> MakePlan(const ProbeRecord& record, const DeviceProfile& profile,
                      const PlanOptions& options, uint64_t* min_budget_out) {
  EMSA_RETURN_IF_ERROR(ValidateOptions(options));
  if (Status s = ValidateProbeRecord(record); !s.ok()) return s.Annotate("probe record");

  Plan plan = StartPlan(record, options);
  plan.host_only = !profile.gpu.present;
  const plan_internal::Bandwidths bw = plan_internal::ResolveBandwidths(profile);
  plan_internal::ComputeHeat(record, bw, options, &plan.params);
  const std::vector<int64_t> offload = plan_internal::OffloadOrder(options, bw, &plan.params);

  const LayoutOrder order = plan_internal::MakeLayoutOrder(record);
  const DeviceSizer sizer(order, plan.params, options);
  std::vector<char> on_host(record.params.size(), 0);
  const uint64_t staging = HostStagingBytes(plan, profile.gpu.present);
  auto device_need = [&](size_t k) {
    MarkHost(offload, k, &on_host);
    return sizer.ArenaBytes(on_host) + (k > 0 ? staging : 0);
  };
  const uint64_t base = BaseDeviceBytes(record, options);
  const size_t n = offload.size();
  const size_t k_max = options.allow_host_tier ? n : 0;
  const uint64_t min_budget = base + device_need(k_max);
  if (min_budget_out != nullptr) *min_budget_out = min_budget;
  plan.min_budget_bytes = min_budget;

  EMSA_ASSIGN_OR_RETURN(plan.budget_bytes, ResolveBudget(options, profile, min_budget));
  if (plan.budget_bytes != 0 && min_budget > plan.budget_bytes) {
    return BudgetTooSmall(options, plan.budget_bytes, base, min_budget);
  }
  const size_t k = HostCount(options, plan.budget_bytes, base, n, k_max, device_need);
  MarkHost(offload, k, &on_host);
  AssignTiers(on_host, &plan);

  plan_internal::LayoutArenas(order, &plan);
  if (plan.prediction.device_state_bytes != sizer.ArenaBytes(on_host)) {
    return Status::Internal("device arena layout disagrees with its size estimate");
  }
  plan_internal::MakeBuckets(record, order, &plan);
  plan_internal::PlanHostPaths(record, bw, profile.gpu.present, base, &plan);
  plan_internal::LayoutHostArena(order, &plan);
  return plan;
}

}  // namespace emsa
