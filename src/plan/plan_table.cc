// plan_table.cc — PlanToTable / PlanSummaryToTable: the plan as fixed-width text for a person;
// PlanVerdict: the lines it opens with, so that the answer comes first (does it fit, how fast,
// how much host memory, how the state is split between the tiers).
#include <cstdarg>
#include <cstdio>
#include <string>

#include "emsa/plan.h"

namespace emsa {
namespace {

constexpr size_t kNameWidth = 44;

void Append(std::string* out, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void Append(std::string* out, const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  *out += buf;
}

// Keeps the tail: in "model.layers.17.self_attn.q_proj.weight" the end says the most.
std::string Fit(const std::string& name, size_t width) {
  if (name.size() <= width) return name;
  return "..." + name.substr(name.size() - (width - 3));
}

std::string Grouped(uint64_t n) {
  std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

double Ms(double seconds) { return seconds * 1e3; }

void Header(const Plan& plan, std::string* out) {
  size_t trainable = 0;
  for (const ParamPlan& p : plan.params) trainable += p.trainable ? 1 : 0;
  Append(out, "emsa plan: %s, state %s, %zu parameters (%zu trainable), %zu buckets\n",
         OptimizerName(plan.options.optimizer), DTypeName(plan.options.state_dtype),
         plan.params.size(), trainable, plan.buckets.size());
}

void ParamRows(const Plan& plan, std::string* out) {
  Append(out, "\n%6s  %-*s %15s  %-4s  %-8s  %12s  %10s  %10s  %6s  %6s\n", "idx",
         static_cast<int>(kNameWidth), "name", "numel", "tier", "state", "state bytes", "slack ms",
         "hotness", "rank", "bucket");
  for (const ParamPlan& p : plan.params) {
    const std::string name = Fit(p.name, kNameWidth);
    const std::string numel = Grouped(static_cast<uint64_t>(p.numel));
    if (!p.trainable) {
      Append(out, "%6lld  %-*s %15s  %-4s  %-8s  %12s  %10s  %10s  %6s  %6s\n",
             static_cast<long long>(p.index), static_cast<int>(kNameWidth), name.c_str(),
             numel.c_str(), "-", "frozen", "-", "-", "-", "-", "-");
      continue;
    }
    Append(out, "%6lld  %-*s %15s  %-4s  %-8s  %12s  %10.3f  %10.3g  %6lld  %6lld\n",
           static_cast<long long>(p.index), static_cast<int>(kNameWidth), name.c_str(),
           numel.c_str(), TierName(p.tier), DTypeName(p.state_dtype),
           FormatBytes(p.state_bytes).c_str(), Ms(p.slack), p.hotness,
           static_cast<long long>(p.offload_rank), static_cast<long long>(p.bucket));
  }
}

void ModuleRows(const Plan& plan, std::string* out) {
  Append(out, "\nmodule ranges (arena order)\n%4s  %14s  %12s  %s\n", "tier", "offset", "bytes",
         "module");
  for (const ModuleRange& m : plan.modules) {
    Append(out, "%4s  %14s  %12s  %s\n", TierName(m.tier), Grouped(m.offset).c_str(),
           FormatBytes(m.bytes).c_str(), m.module.empty() ? "(root)" : m.module.c_str());
  }
}

void Totals(const Plan& plan, std::string* out) {
  struct Sum {
    size_t params = 0;
    uint64_t numel = 0, state = 0;
  } sums[2];
  size_t frozen = 0;
  for (const ParamPlan& p : plan.params) {
    if (!p.trainable) {
      ++frozen;
      continue;
    }
    Sum& s = sums[p.tier == Tier::kL2 ? 1 : 0];
    ++s.params;
    s.numel += static_cast<uint64_t>(p.numel);
    s.state += p.state_bytes;
  }
  const Prediction& pr = plan.prediction;
  Append(out, "\n%-12s  %8s  %17s  %12s  %12s\n", "tier", "params", "numel", "state bytes",
         "arena bytes");
  const uint64_t arenas[2] = {pr.device_state_bytes, pr.host_state_bytes};
  // Without a GPU the first tier is host memory too: its name says so.
  const char* names[2] = {plan.host_only ? "L1 (in RAM)" : "L1 (device)", "L2 (host)"};
  for (int t = 0; t < 2; ++t) {
    Append(out, "%-12s  %8zu  %17s  %12s  %12s\n", names[t], sums[t].params,
           Grouped(sums[t].numel).c_str(), FormatBytes(sums[t].state).c_str(),
           FormatBytes(arenas[t]).c_str());
  }
  if (frozen > 0) Append(out, "%-12s  %8zu  (no optimizer state)\n", "frozen", frozen);
}

void PredictionRows(const Plan& plan, std::string* out) {
  const Prediction& p = plan.prediction;
  Append(out, "\nprediction\n");
  if (p.load_slowdown > 1.0) {
    Append(out, "  %-34s %10.3f ms  (x%.2f: the host tier's load slows its launches)\n",
           "forward + backward (P)", Ms(p.period), p.load_slowdown);
  } else {
    Append(out, "  %-34s %10.3f ms\n", "forward + backward (P)", Ms(p.period));
  }
  if (plan.host_only) {  // no GPU: one update, in host memory, and no copies
    Append(out, "  %-34s %10.3f ms\n", "update (CPU, in RAM)", Ms(p.hbm_time));
  } else {
    Append(out, "  %-34s %10.3f ms\n", "device update (HBM)", Ms(p.hbm_time));
    Append(out, "  %-34s %10.3f ms\n", "gradients down (D2H)", Ms(p.d2h_time));
    Append(out, "  %-34s %10.3f ms\n", "host update (CPU)", Ms(p.cpu_time));
    Append(out, "  %-34s %10.3f ms\n", "parameters up (H2D)", Ms(p.h2d_time));
  }
  if (p.device_update_share > 0) {
    Append(out, "  %-34s %10.1f %%  (their moments through %s of device staging)\n",
           "host tier updated by the GPU", 100.0 * p.device_update_share,
           FormatBytes(p.stream_staging_bytes).c_str());
  }
  Append(out, "  %-34s %10.3f ms\n", "stall before the next forward", Ms(p.stall_time));
  Append(out, "  %-34s %10.3f ms\n", "step", Ms(p.step_time));
  const std::string budget =
      plan.budget_bytes == 0 ? std::string("no limit") : "budget " + FormatBytes(plan.budget_bytes);
  Append(out, "  %-34s %13s  (%s)\n", plan.host_only ? "peak host memory" : "peak device memory",
         FormatBytes(p.peak_device_bytes).c_str(), budget.c_str());
  Append(out, "  %-34s %13s\n", "smallest budget that works",
         FormatBytes(plan.min_budget_bytes).c_str());
}

// The column the verdict's values start in: "host memory" and two spaces.
constexpr int kLabelWidth = 12;

std::string Line(const char* label, const std::string& text) {
  char head[32];
  std::snprintf(head, sizeof head, "%-*s ", kLabelWidth, label);
  return head + text + "\n";
}

std::string FitsLine(const Plan& plan, const DeviceProfile& profile) {
  const Prediction& p = plan.prediction;
  const uint64_t ram = profile.cpu.host_memory;
  const uint64_t host = HostMemoryNeeded(plan);
  const bool host_fits = PlanFitsHost(plan, profile);
  const std::string budget =
      plan.budget_bytes == 0 ? "no budget" : "budget " + FormatBytes(plan.budget_bytes);
  if (plan.host_only) {
    const std::string of = ram == 0 ? "" : " of the host's " + FormatBytes(ram);
    return Line("fits", std::string(host_fits ? "yes" : "no") + ": peak host memory " +
                            FormatBytes(host) + of + " (no GPU: everything in host memory, " +
                            budget + ")");
  }
  if (!host_fits) {
    return Line("fits", "no: the host tier needs " + FormatBytes(host) +
                            " of pinned host memory, more than the host's " + FormatBytes(ram) +
                            " (lower the host tier: a larger --gpu-mem, --state-dtype bf16)");
  }
  return Line("fits", "yes: peak device memory " + FormatBytes(p.peak_device_bytes) +
                          " of the card's " + FormatBytes(profile.gpu.total_memory) + " (" +
                          budget + ")");
}

std::string StepLine(const Plan& plan, int64_t tokens_per_step) {
  const double seconds = plan.prediction.step_time;
  // Three decimals below 10 ms, where one would round a small model's step to nothing.
  const int decimals = seconds < 0.01 ? 3 : 1;
  char text[128];
  if (tokens_per_step > 0 && seconds > 0.0) {
    std::snprintf(text, sizeof text, "%.*f ms predicted, %s tokens/s (%s tokens a step)", decimals,
                  seconds * 1e3, Grouped(static_cast<uint64_t>(tokens_per_step / seconds)).c_str(),
                  Grouped(static_cast<uint64_t>(tokens_per_step)).c_str());
  } else {
    std::snprintf(text, sizeof text, "%.*f ms predicted", decimals, seconds * 1e3);
  }
  return Line("step", text);
}

std::string HostLine(const Plan& plan, const DeviceProfile& profile) {
  const uint64_t ram = profile.cpu.host_memory;
  const std::string of = ram == 0 ? " (the profile does not give the host's memory)"
                                  : ", of the host's " + FormatBytes(ram);
  if (plan.host_only)
    return Line("host memory", FormatBytes(HostMemoryNeeded(plan)) + " at the peak" + of);
  if (plan.prediction.host_state_bytes == 0)
    return Line("host memory", "none pinned (no host tier)" + of);
  // Only the part that copies touch is page-locked (Prediction::host_locked_bytes).
  const uint64_t locked = plan.prediction.host_locked_bytes;
  const uint64_t pageable = plan.prediction.host_state_bytes - locked;
  return Line("host memory",
              FormatBytes(locked) + " pinned for the host tier" +
                  (pageable > 0 ? " and " + FormatBytes(pageable) + " pageable" : std::string()) +
                  of);
}

std::string TiersLine(const Plan& plan) {
  size_t on[2] = {0, 0};
  uint64_t bytes[2] = {0, 0};
  for (const ParamPlan& p : plan.params) {
    if (!p.trainable) continue;
    const int t = p.tier == Tier::kL2 ? 1 : 0;
    ++on[t];
    bytes[t] += p.state_bytes;
  }
  const size_t all = on[0] + on[1];
  if (plan.host_only) {
    return Line("tiers", "the state of all " + std::to_string(all) + " trainable parameters (" +
                             FormatBytes(bytes[0] + bytes[1]) + ") in host memory");
  }
  return Line("tiers", std::to_string(on[0]) + " of " + std::to_string(all) +
                           " parameters' state on the device (" + FormatBytes(bytes[0]) + "), " +
                           std::to_string(on[1]) + " in the host tier (" + FormatBytes(bytes[1]) +
                           ")");
}

}  // namespace

std::string PlanToTable(const Plan& plan) {
  std::string out;
  Header(plan, &out);
  ParamRows(plan, &out);
  ModuleRows(plan, &out);
  Totals(plan, &out);
  PredictionRows(plan, &out);
  return out;
}

std::string PlanSummaryToTable(const Plan& plan) {
  std::string out;
  Header(plan, &out);
  Totals(plan, &out);
  PredictionRows(plan, &out);
  return out;
}

uint64_t HostMemoryNeeded(const Plan& plan) {
  const uint64_t host = plan.prediction.host_state_bytes;
  return plan.host_only ? host + plan.prediction.peak_device_bytes : host;
}

bool PlanFitsHost(const Plan& plan, const DeviceProfile& profile) {
  return profile.cpu.host_memory == 0 || HostMemoryNeeded(plan) <= profile.cpu.host_memory;
}

std::string PlanVerdict(const Plan& plan, const DeviceProfile& profile, int64_t tokens_per_step) {
  return FitsLine(plan, profile) + StepLine(plan, tokens_per_step) + HostLine(plan, profile) +
         TiersLine(plan);
}

}  // namespace emsa
