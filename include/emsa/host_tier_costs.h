// emsa/host_tier_costs.h — what the host tier does that its cost model must know: the pool's
// size, which tensors take the device-delta path, the device staging of the GPU-updated path,
// and the defaults of HostTierOptions those depend on.
//
// Plain C++ without CUDA: the planner (src/plan/) and the profile include it to price the tier
// as it runs, and the engine's HostTier (emsa/host_tier.h) takes its defaults and rules from
// here, so one change to either side reaches both.
#pragma once

#include <algorithm>
#include <cstdint>

#include "emsa/types.h"

namespace emsa {

// HostTierOptions' defaults that change what a step costs (their meaning is documented there).
inline constexpr bool kHostTierDeviceDelta = true;
inline constexpr int64_t kHostTierStreamPieceElements = int64_t{8} << 20;
inline constexpr int kHostTierStreamSlots = 3;

// The host tier's CPU update pool for `cores` usable cores: one fewer (the thread launching the
// GPU's work must not wait for a core, and the memory-bound pool gains nothing from the last
// one), at least 1. The profile measures the host update bandwidth on as many threads.
inline int HostTierThreads(int cores) { return std::max(cores - 1, 1); }

// Whether HostTierOptions::device_delta applies to a tensor: an fp32 parameter without a master,
// with an fp32 gradient (which holds the delta), under AdamW or Lion (Adam's L2 decay reads the
// parameter on the host).
inline bool HostTierAppliesDelta(OptimizerKind optimizer, DType param_dtype, DType grad_dtype,
                                 bool has_master) {
  return optimizer != OptimizerKind::kAdam && param_dtype == DType::kFloat32 &&
         grad_dtype == DType::kFloat32 && !has_master;
}

// Device bytes of the staging for GPU-updated tensors: `slots` slots, each holding every moment
// of min(piece_elements, largest) elements (no slot is larger than the largest such tensor,
// `largest` elements), moments of `state_dtype`.
inline int64_t HostTierStreamStagingBytes(OptimizerKind optimizer, DType state_dtype,
                                          int64_t piece_elements, int slots, int64_t largest) {
  return int64_t{slots} * std::min(piece_elements, largest) *
         static_cast<int64_t>(DTypeSize(state_dtype)) * StateCount(optimizer);
}

}  // namespace emsa
