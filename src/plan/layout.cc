// layout.cc — gradient-ready order, module ranges, view offsets, arena sizes.
#include "plan/layout.h"

#include <algorithm>
#include <limits>
#include <map>

#include "plan/costs.h"

namespace emsa::plan_internal {
namespace {

// A module with at least one alignment unit of state starts on a unit boundary (the VMM
// granularity: its pages are its own). Smaller modules are packed at tensor alignment: a 2 MiB
// boundary per norm or bias module would waste up to 2 MiB each, gigabytes on a deep model.
uint64_t ModuleStart(uint64_t offset, uint64_t module_bytes, const PlanOptions& options) {
  const uint64_t align = module_bytes >= options.device_module_alignment
                             ? options.device_module_alignment
                             : options.device_tensor_alignment;
  return AlignUp(offset, align);
}

// The arena is mapped in whole alignment units, so its size is rounded up to one.
uint64_t DeviceArenaSize(uint64_t end, const PlanOptions& options) {
  return AlignUp(end, options.device_module_alignment);
}

uint64_t TierAlign(Tier tier, const PlanOptions& options) {
  return tier == Tier::kL2 ? options.host_tensor_alignment : options.device_tensor_alignment;
}

// Places one param's views at `offset` (aligned already); returns the bytes taken.
uint64_t PlaceViews(ParamPlan* p, uint64_t offset, const PlanOptions& options) {
  ViewSpec views[kMaxViews];
  const int count = TierViews(p->tier, p->numel, p->param_dtype, options, views);
  const uint64_t align = TierAlign(p->tier, options);
  uint64_t at = offset;
  for (int v = 0; v < count; ++v) {
    const int64_t off = static_cast<int64_t>(at);
    switch (views[v].kind) {
      case ViewKind::kGrad:
        p->grad_offset = off;
        break;
      case ViewKind::kExpAvg:
        p->exp_avg_offset = off;
        break;
      case ViewKind::kExpAvgSq:
        p->exp_avg_sq_offset = off;
        break;
      case ViewKind::kMaster:
        p->master_offset = off;
        break;
      case ViewKind::kParamOut:
        p->param_out_offset = off;
        break;
    }
    at += AlignUp(views[v].bytes, align);
  }
  p->state_bytes = at - offset;
  return p->state_bytes;
}

}  // namespace

LayoutOrder MakeLayoutOrder(const ProbeRecord& record) {
  LayoutOrder order;
  for (size_t i = 0; i < record.params.size(); ++i) {
    if (record.params[i].trainable) order.grad_order.push_back(static_cast<int64_t>(i));
  }
  auto key = [&](int64_t i) {
    const int64_t r = record.params[static_cast<size_t>(i)].grad_ready_order;
    return r >= 0 ? r : std::numeric_limits<int64_t>::max();
  };
  std::stable_sort(order.grad_order.begin(), order.grad_order.end(),
                   [&](int64_t a, int64_t b) { return key(a) < key(b); });
  std::map<std::string, size_t> module_index;
  for (int64_t i : order.grad_order) {
    const std::string& name = record.params[static_cast<size_t>(i)].module;
    auto [it, added] = module_index.emplace(name, order.modules.size());
    if (added) order.modules.push_back({name, {}});
    order.modules[it->second].members.push_back(i);
  }
  return order;
}

DeviceSizer::DeviceSizer(const LayoutOrder& order, const std::vector<ParamPlan>& params,
                         const PlanOptions& options)
    : order_(order), options_(options), device_bytes_(params.size(), 0) {
  for (const ParamPlan& p : params) {
    if (!p.trainable) continue;
    device_bytes_[static_cast<size_t>(p.index)] = PaddedStateBytes(
        Tier::kL1, p.numel, p.param_dtype, options, options.device_tensor_alignment);
  }
}

uint64_t DeviceSizer::ArenaBytes(const std::vector<char>& on_host) const {
  uint64_t offset = 0;
  for (const LayoutOrder::Module& m : order_.modules) {
    uint64_t bytes = 0;
    bool any = false;
    for (int64_t i : m.members) {
      if (on_host[static_cast<size_t>(i)]) continue;
      bytes += device_bytes_[static_cast<size_t>(i)];
      any = true;
    }
    if (any) offset = ModuleStart(offset, bytes, options_) + bytes;
  }
  return DeviceArenaSize(offset, options_);
}

void LayoutArenas(const LayoutOrder& order, Plan* plan) {
  const PlanOptions& options = plan->options;
  plan->modules.clear();
  uint64_t ends[2] = {0, 0};  // device, host
  for (Tier tier : {Tier::kL1, Tier::kL2}) {
    uint64_t& offset = ends[tier == Tier::kL2 ? 1 : 0];
    for (const LayoutOrder::Module& m : order.modules) {
      uint64_t bytes = 0;
      bool any = false;
      for (int64_t i : m.members) {
        const ParamPlan& p = plan->params[static_cast<size_t>(i)];
        if (p.tier != tier) continue;
        bytes += PaddedStateBytes(tier, p.numel, p.param_dtype, options, TierAlign(tier, options));
        any = true;
      }
      if (!any) continue;
      offset = tier == Tier::kL2 ? AlignUp(offset, options.host_tensor_alignment)
                                 : ModuleStart(offset, bytes, options);
      plan->modules.push_back({m.name, tier, offset, bytes});
      for (int64_t i : m.members) {
        ParamPlan& p = plan->params[static_cast<size_t>(i)];
        if (p.tier == tier) offset += PlaceViews(&p, offset, options);
      }
    }
  }
  plan->prediction.device_state_bytes = DeviceArenaSize(ends[0], options);
  plan->prediction.host_state_bytes = ends[1];
}

}  // namespace emsa::plan_internal
