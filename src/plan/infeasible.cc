// infeasible.cc — the message for a budget the planner cannot meet: the smallest budget that
// works, and for a model known by its config, what would shrink its need. Made here once, for the
// C++ command, the Python command (through the C ABI) and any other front end.
#include <string>
#include <vector>

#include "emsa/plan.h"

namespace emsa {
namespace {

// The budget MakePlan held the plan to: the one given, else the GPU's free memory (its total
// where free is unknown) less the safety margin, 0 where that leaves nothing.
uint64_t AppliedBudget(const PlanOptions& options, const DeviceProfile& profile) {
  if (options.budget_bytes != 0) return options.budget_bytes;
  const uint64_t memory =
      profile.gpu.free_memory != 0 ? profile.gpu.free_memory : profile.gpu.total_memory;
  return memory > options.safety_margin_bytes ? memory - options.safety_margin_bytes : 0;
}

// The need with the host tier and without, against the budget.
std::string ModelNeed(const ProbeRecord& record, const DeviceProfile& profile,
                      const PlanOptions& options, uint64_t min_budget) {
  PlanOptions other = options;
  other.allow_host_tier = !options.allow_host_tier;
  other.force_all_host = false;
  uint64_t other_min = 0;
  (void)MakePlan(record, profile, other, &other_min);
  std::string message =
      record.model + " needs at least " + FormatBytes(min_budget) + " of device memory ";
  if (options.allow_host_tier) {
    message += "with the host tier (optimizer state and fp32 master weights on the host); " +
               FormatBytes(other_min) + " with everything on the device";
  } else {
    message += "with everything on the device (--no-host-tier); with the host tier, " +
               FormatBytes(other_min);
  }
  return message + "; the budget is " + FormatBytes(AppliedBudget(options, profile)) + ".";
}

// What would shrink the need, in the command's flags, the choices already made left out.
std::string ModelShrinks(const PlanOptions& options, const ModelChoices& model) {
  std::vector<std::string> shrink;
  if (!options.allow_host_tier) shrink.push_back("allow the host tier");
  if (!options.release_grads) shrink.push_back("--step-in-backward");
  if (!model.activation_checkpointing) shrink.push_back("--checkpointing");
  if (model.param_dtype == DType::kFloat32) shrink.push_back("--param-dtype bf16");
  if (!options.allow_host_tier && options.state_dtype == DType::kFloat32) {
    shrink.push_back("--state-dtype bf16");
  }
  shrink.push_back("a smaller --batch or --seq");
  std::string hint;
  for (size_t i = 0; i < shrink.size(); ++i) {
    hint += (i == 0 ? "" : i + 1 == shrink.size() ? " or " : ", ") + shrink[i];
  }
  return hint;
}

}  // namespace

std::string InfeasibleBudgetMessage(const ProbeRecord& record, const DeviceProfile& profile,
                                    const PlanOptions& options, const Status& infeasible,
                                    uint64_t min_budget, const ModelChoices* model) {
  const std::string smallest = "smallest feasible budget: " + FormatBytes(min_budget);
  const std::string bytes = std::to_string(min_budget);
  if (model == nullptr) return infeasible.message() + "\n" + smallest + " (--budget " + bytes + ")";
  return ModelNeed(record, profile, options, min_budget) +
         "\n  to need less: " + ModelShrinks(options, *model) + "\n  " + infeasible.message() +
         "\n" + smallest + " (--gpu-mem " + bytes + ")";
}

}  // namespace emsa
