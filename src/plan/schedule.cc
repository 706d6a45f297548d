// schedule.cc — buckets and the timeline that predicts the step.
#include "plan/schedule.h"

#include <algorithm>
#include <vector>

#include "plan/hotness.h"

namespace emsa::plan_internal {

void MakeBuckets(const ProbeRecord& record, const LayoutOrder& order, Plan* plan) {
  plan->buckets.clear();
  const uint64_t limit = plan->options.bucket_bytes;
  for (int64_t i : order.grad_order) {
    ParamPlan& p = plan->params[static_cast<size_t>(i)];
    const ParamRecord& rec = record.params[static_cast<size_t>(i)];
    Bucket* last = plan->buckets.empty() ? nullptr : &plan->buckets.back();
    if (last == nullptr || last->tier != p.tier || last->param_bytes + rec.bytes > limit) {
      plan->buckets.push_back({p.tier, {}, 0.0, 0});
      last = &plan->buckets.back();
    }
    last->params.push_back(i);
    last->param_bytes += rec.bytes;
    last->ready_time = std::max(last->ready_time, GradReady(record, rec));
    p.bucket = static_cast<int64_t>(plan->buckets.size()) - 1;
  }
}

void Predict(const ProbeRecord& record, const Bandwidths& bw, uint64_t base_device_bytes,
             Plan* plan) {
  const PlanOptions& options = plan->options;
  Prediction& out = plan->prediction;
  out.period = Period(record);

  // Per-bucket engine work in seconds, and totals.
  struct Work {
    double hbm = 0, d2h = 0, cpu = 0, h2d = 0;
  };
  std::vector<Work> work(plan->buckets.size());
  double hbm = 0, d2h = 0, cpu = 0, h2d = 0;
  for (size_t b = 0; b < plan->buckets.size(); ++b) {
    for (int64_t i : plan->buckets[b].params) {
      const ParamRecord& rec = record.params[static_cast<size_t>(i)];
      const double bytes = static_cast<double>(rec.bytes);
      if (plan->buckets[b].tier == Tier::kL2) {
        const double host = static_cast<double>(HostMemoryTraffic(rec.numel, rec.dtype, options));
        work[b].d2h += bytes / bw.d2h;
        work[b].cpu += host / bw.host_update;
        work[b].h2d += bytes / bw.h2d;
      } else {
        const double dev = static_cast<double>(DeviceUpdateTraffic(rec.numel, rec.dtype, options));
        work[b].hbm += dev / bw.hbm;
      }
    }
    hbm += work[b].hbm;
    d2h += work[b].d2h;
    cpu += work[b].cpu;
    h2d += work[b].h2d;
  }
  out.hbm_time = hbm;
  out.d2h_time = d2h;
  out.cpu_time = cpu;
  out.h2d_time = h2d;

  // The engines as the host tier runs them (emsa/host_tier.h). Device buckets update in bucket
  // order on the compute stream. Host buckets: gradients down in submission order (as each
  // bucket is ready when gradients are released in backward; otherwise all at the end of
  // backward, in forward order); the CPU takes, whenever free, the landed bucket the next
  // forward needs first (the highest index), else waits for the next landing; uploads follow
  // in CPU order.
  const size_t nb = plan->buckets.size();
  std::vector<double> finish(nb, 0.0), landed(nb, 0.0);
  std::vector<size_t> host;  // host buckets in submission order
  for (size_t b = 0; b < nb; ++b) {
    if (plan->buckets[b].tier == Tier::kL2) host.push_back(b);
  }
  if (!options.release_grads) std::reverse(host.begin(), host.end());
  double hbm_free = 0, d2h_free = 0, cpu_free = 0, h2d_free = 0;
  for (size_t b = 0; b < nb; ++b) {
    if (plan->buckets[b].tier == Tier::kL2) continue;
    hbm_free = std::max(plan->buckets[b].ready_time, hbm_free) + work[b].hbm;
    finish[b] = hbm_free;
  }
  for (size_t b : host) {
    const double ready = options.release_grads ? plan->buckets[b].ready_time : out.period;
    d2h_free = std::max(ready, d2h_free) + work[b].d2h;
    landed[b] = d2h_free;
  }
  std::vector<char> done(nb, 0);
  for (size_t left = host.size(); left > 0; --left) {
    size_t pick = nb;
    double first_landing = 0.0;
    for (size_t b : host) {
      if (done[b]) continue;
      if (landed[b] <= cpu_free && (pick == nb || b > pick)) pick = b;
      if (pick == nb && (first_landing == 0.0 || landed[b] < first_landing)) {
        first_landing = landed[b];
      }
    }
    if (pick == nb) {  // nothing landed: the CPU idles until the next landing
      cpu_free = first_landing;
      for (size_t b : host) {
        if (!done[b] && landed[b] <= cpu_free && (pick == nb || b > pick)) pick = b;
      }
    }
    done[pick] = 1;
    cpu_free += work[pick].cpu;
    h2d_free = std::max(cpu_free, h2d_free) + work[pick].h2d;
    finish[pick] = h2d_free;
  }
  double stall = 0.0;
  for (size_t b = 0; b < nb; ++b) {
    for (int64_t i : plan->buckets[b].params) {
      const double need = out.period + ForwardNeed(record, record.params[static_cast<size_t>(i)]);
      stall = std::max(stall, finish[b] - need);
    }
  }
  out.stall_time = stall;
  out.step_time = out.period + stall;
  out.peak_device_bytes = base_device_bytes + out.device_state_bytes;
}

}  // namespace emsa::plan_internal
