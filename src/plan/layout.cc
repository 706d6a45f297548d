// layout.cc — gradient-ready order, module ranges, view offsets, arena sizes.
#include "plan/layout.h"

#include <algorithm>
#include <limits>
#include <map>

#include "emsa/host_arena.h"
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

// Where a view goes: fills the offset field of its kind.
void SetOffset(ParamPlan* p, ViewKind kind, int64_t off) {
  switch (kind) {
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
  }
}

// Places one device-tier param's views at `offset` (aligned already); returns the bytes taken.
uint64_t PlaceViews(ParamPlan* p, uint64_t offset, const PlanOptions& options) {
  ViewSpec views[kMaxViews];
  const int count = TierViews(p->tier, p->numel, p->param_dtype, options, views);
  const uint64_t align = TierAlign(p->tier, options);
  uint64_t at = offset;
  for (int v = 0; v < count; ++v) {
    SetOffset(p, views[v].kind, static_cast<int64_t>(at));
    at += AlignUp(views[v].bytes, align);
  }
  p->state_bytes = at - offset;
  return p->state_bytes;
}

// Whether a copy between the device and the host arena reads or writes a host-tier view: the
// gradient staging (gradients down; up, the delta under device_delta or the rounded 16-bit
// parameter written over it), an fp32 parameter's master (its host copy: uploaded under Adam,
// refreshed from the device) and the moments of a GPU-updated parameter (streamed up and back).
// Everything else is touched by CPU threads alone.
bool CopiedView(ViewKind kind, const ParamPlan& p) {
  switch (kind) {
    case ViewKind::kGrad:
      return true;
    case ViewKind::kMaster:
      return p.param_dtype == DType::kFloat32;
    case ViewKind::kExpAvg:
    case ViewKind::kExpAvgSq:
      return p.device_update;
  }
  return true;
}

// Places the host-tier views that copies touch (copied) or those they do not, module by module
// in gradient-ready order from `offset`; each module's share is recorded in its range. Returns
// the end.
uint64_t PlaceHostRegion(const LayoutOrder& order, bool copied, uint64_t offset, Plan* plan,
                         std::vector<ModuleRange>* ranges) {
  const PlanOptions& options = plan->options;
  const uint64_t align = options.host_tensor_alignment;
  size_t r = 0;
  for (const LayoutOrder::Module& m : order.modules) {
    bool any = false;
    const uint64_t start = AlignUp(offset, align);
    offset = start;
    for (int64_t i : m.members) {
      ParamPlan& p = plan->params[static_cast<size_t>(i)];
      if (p.tier != Tier::kL2) continue;
      any = true;
      ViewSpec views[kMaxViews];
      const int count = TierViews(p.tier, p.numel, p.param_dtype, options, views);
      for (int v = 0; v < count; ++v) {
        if (CopiedView(views[v].kind, p) != copied) continue;
        SetOffset(&p, views[v].kind, static_cast<int64_t>(offset));
        offset += AlignUp(views[v].bytes, align);
      }
    }
    if (!any) continue;
    ModuleRange& range = (*ranges)[r++];
    (copied ? range.locked_offset : range.offset) = start;
    (copied ? range.locked_bytes : range.bytes) = offset - start;
  }
  return offset;
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
  uint64_t offset = 0;
  for (const LayoutOrder::Module& m : order.modules) {
    uint64_t bytes = 0;
    bool any = false;
    for (int64_t i : m.members) {
      ParamPlan& p = plan->params[static_cast<size_t>(i)];
      const uint64_t padded =
          PaddedStateBytes(p.tier, p.numel, p.param_dtype, options, TierAlign(p.tier, options));
      if (p.tier != Tier::kL1) {
        p.state_bytes = padded;  // placed by LayoutHostArena
        continue;
      }
      bytes += padded;
      any = true;
    }
    if (!any) continue;
    offset = ModuleStart(offset, bytes, options);
    plan->modules.push_back({m.name, Tier::kL1, offset, bytes});
    for (int64_t i : m.members) {
      ParamPlan& p = plan->params[static_cast<size_t>(i)];
      if (p.tier == Tier::kL1) offset += PlaceViews(&p, offset, options);
    }
  }
  plan->prediction.device_state_bytes = DeviceArenaSize(offset, options);
}

void LayoutHostArena(const LayoutOrder& order, Plan* plan) {
  std::vector<ModuleRange> ranges;
  for (const LayoutOrder::Module& m : order.modules) {
    for (int64_t i : m.members) {
      if (plan->params[static_cast<size_t>(i)].tier != Tier::kL2) continue;
      ranges.push_back({m.name, Tier::kL2, 0, 0});
      break;
    }
  }
  const uint64_t copied_end = PlaceHostRegion(order, /*copied=*/true, 0, plan, &ranges);
  // The pageable part starts on a whole page of the arena's (kHostArenaPageBytes), so that locking
  // the prefix locks nothing of it.
  const uint64_t pageable_start = AlignUp(copied_end, kHostArenaPageBytes);
  const uint64_t end = PlaceHostRegion(order, /*copied=*/false, pageable_start, plan, &ranges);
  const bool pageable = end > pageable_start;
  plan->prediction.host_locked_bytes = pageable ? pageable_start : copied_end;
  plan->prediction.host_state_bytes = pageable ? end : copied_end;
  plan->modules.insert(plan->modules.end(), ranges.begin(), ranges.end());
}

}  // namespace emsa::plan_internal
