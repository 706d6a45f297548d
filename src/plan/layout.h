// layout.h — where each view sits in the device and host arenas. Internal to the planner.
//
// Both arenas follow gradient-ready order: modules ordered by their first gradient, each module's
// tensors of that tier contiguous and in gradient-ready order, so a bucket's state is one
// contiguous stretch that the update streams through (in the host arena, one in each of its two
// parts: what copies touch, and what only the CPU touches).
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

// Places every view of every device-tier param, fills plan->modules with the device arena's
// ranges and its size in plan->prediction; sets every trainable param's state_bytes.
void LayoutArenas(const LayoutOrder& order, Plan* plan);
// Places every view of every host-tier param and appends their module ranges; sets
// host_state_bytes and host_locked_bytes. Call once the GPU-updated params are marked
// (PlanHostPaths): their moments are copied, so they go into the locked prefix.
//
// The host arena holds first, in gradient-ready module order, every view a copy to or from the
// device touches (they must be page-locked: the host tier copies only from pinned memory), then,
// from a page boundary on, the views only CPU threads touch (moments and masters of CPU-updated
// params), which may stay pageable: page-locking costs time per byte at set-up, and locked
// memory cannot be reclaimed.
void LayoutHostArena(const LayoutOrder& order, Plan* plan);

}  // namespace emsa::plan_internal
