// plan_verdict.cc — PlanVerdict: the lines a plan opens with, so that the answer comes first:
// does it fit, how fast, how much host memory, and how the state is split between the tiers.
#include <cstdio>
#include <string>

#include "emsa/plan.h"

namespace emsa {
namespace {

// The column the verdict's values start in: "host memory" and two spaces.
constexpr int kLabelWidth = 12;

std::string Line(const char* label, const std::string& text) {
  char head[32];
  std::snprintf(head, sizeof head, "%-*s ", kLabelWidth, label);
  return head + text + "\n";
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
  return Line("host memory",
              FormatBytes(plan.prediction.host_state_bytes) + " pinned for the host tier" + of);
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
