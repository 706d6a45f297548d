// layout.h — where each view sits in the device and host arenas. Internal to the planner.
//
// Both arenas follow gradient-ready order: modules ordered by their first gradient, each module's
// tensors of that tier contiguous and in gradient-ready order, so a bucket's state is one
// contiguous stretch that the update streams through.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emsa/plan.h"
#include "emsa/probe_record.h"

namespace emsa::plan_internal {

struct LayoutOrder {
  struct Module {
    std::string name;
    std::vector<int64_t> members;  // trainable param indices, gradient-ready order
  };
  // Trainable param indices by grad_ready_order; params without a gradient last, by index.
  std::vector<int64_t> grad_order;
  std::vector<Module> modules;  // ordered by their first member's position in grad_order
};
LayoutOrder MakeLayoutOrder(const ProbeRecord& record);

// Device arena size for a tier assignment, without placing anything: O(params) per call, so the
// planner can search over assignments. Matches LayoutArenas() exactly.
class DeviceSizer {
 public:
  DeviceSizer(const LayoutOrder& order, const std::vector<ParamPlan>& params,
              const PlanOptions& options);
  // on_host[i] != 0: param i's state is on the host tier.
  uint64_t ArenaBytes(const std::vector<char>& on_host) const;

 private:
  const LayoutOrder& order_;
  const PlanOptions& options_;
  std::vector<uint64_t> device_bytes_;  // per param, padded
};

// Places every view of every trainable param (by its tier), fills plan->modules and the arena
// sizes in plan->prediction.
void LayoutArenas(const LayoutOrder& order, Plan* plan);

}  // namespace emsa::plan_internal
