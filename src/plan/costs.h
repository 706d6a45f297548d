// costs.h — what one parameter's optimizer state weighs (bytes per view, per arena) and what its
// update moves (bytes through HBM, PCIe and host memory), and the bandwidths that turn bytes into
// seconds. Internal to the planner.
#pragma once

#include <cstdint>

#include "emsa/plan.h"
#include "emsa/profile.h"
#include "emsa/types.h"

namespace emsa::plan_internal {

// Used where the profile has a zero (not measured, no GPU). Deliberately modest so that a plan
// made without measurements errs towards predicting stalls rather than hiding them.
constexpr double kDefaultHbmBandwidth = 2e12;         // B/s, read+write: an older HBM2e card
constexpr double kDefaultLinkBandwidth = 25e9;        // B/s per direction: PCIe 4.0 x16 in practice
constexpr double kDefaultHostUpdateBandwidth = 50e9;  // B/s, read+write: a few DDR channels

struct Bandwidths {
  double hbm = kDefaultHbmBandwidth;
  double d2h = kDefaultLinkBandwidth;
  double h2d = kDefaultLinkBandwidth;
  double duplex = kDefaultLinkBandwidth;  // each way, both directions at once
  double host_update_duplex = 0.0;        // host_update with copies both ways (0: unknown)
  double duplex_under_update = kDefaultLinkBandwidth;  // duplex with the CPU update running
  double host_update = kDefaultHostUpdateBandwidth;
};
// Measured values where present; host_update falls back to host_mem_bandwidth, then the default;
// duplex to the slower single direction; duplex_under_update to duplex (no slowdown known).
Bandwidths ResolveBandwidths(const DeviceProfile& profile);

enum class ViewKind { kGrad, kExpAvg, kExpAvgSq, kMaster };
struct ViewSpec {
  ViewKind kind;
  uint64_t bytes;
};
constexpr int kMaxViews = 4;

// The views a parameter of `numel` elements owns in `tier`'s arena, in layout order. Returns the
// count. Device: exp_avg, exp_avg_sq (not Lion), master (param not fp32). Host: grad staging
// (a 16-bit param's update writes the rounded param over it, which the upload reads), exp_avg,
// exp_avg_sq, master (always: for an fp32 param it is the weights' host copy).
int TierViews(Tier tier, int64_t numel, DType param_dtype, const PlanOptions& options,
              ViewSpec out[kMaxViews]);
// Sum of the views' sizes, each rounded up to `align`: what the parameter takes in the arena.
uint64_t PaddedStateBytes(Tier tier, int64_t numel, DType param_dtype, const PlanOptions& options,
                          uint64_t align);

// Bytes read plus written by one update of a device-tier parameter: param r+w, grad r, each
// moment r+w, master r+w when present.
uint64_t DeviceUpdateTraffic(int64_t numel, DType param_dtype, const PlanOptions& options);
// Bytes the CPU reads plus writes for one host-tier update: grad r, each moment r+w, and master
// r+w with the rounded param w (over the gradient) when the param is not fp32. Where
// HostTierAppliesDelta (fp32 under AdamW or Lion), the param is updated on the device from a
// delta the CPU writes over its gradient (HostTierOptions::device_delta, on by default:
// kHostTierDeviceDelta): grad r, delta w, moments r+w (24 B in fp32); under Adam its L2 decay
// reads the parameter, which the CPU then updates: 28 B.
uint64_t HostUpdateTraffic(int64_t numel, DType param_dtype, const PlanOptions& options);
// What one host-tier update costs the host's memory, at the profile's host_update_bandwidth:
// the CPU's own traffic (HostUpdateTraffic) plus the DMA's, which crosses the same DRAM: the
// gradient written in and the parameter (or its delta) read out: fp32 AdamW 24 + 8 B per
// parameter. The DMA's bytes count because a host tier that updates all its state is bound by
// the host's DRAM, which the copies share with the CPU.
uint64_t HostMemoryTraffic(int64_t numel, DType param_dtype, const PlanOptions& options);

// Whether the GPU can update a host-tier parameter instead of the CPU (HostTierTensor::
// device_update): fp32 parameters (no master to carry along).
inline bool DeviceUpdatable(DType param_dtype) { return param_dtype == DType::kFloat32; }
// A GPU-updated host-tier parameter's moments: the bytes that cross PCIe each way per step, and
// half of what the host's memory carries for it (the DMA reads them, then writes them back).
uint64_t DeviceUpdateLinkBytes(int64_t numel, const PlanOptions& options);
// Whether the plan may give host-tier parameters to the GPU: a GPU, and a share asked for, or the
// balanced share (-1) with gradients released in backward (a step() after backward makes the
// compute stream wait until every gradient has been read: for the GPU path, until its kernels
// ran, which needs its moments up first).
bool DeviceUpdatesAllowed(const PlanOptions& options, bool gpu_present);
// The device staging the host tier sets aside for GPU-updated parameters with its default
// options (HostTierStreamStagingBytes), the largest of them `largest` elements.
uint64_t StreamStagingBytes(const PlanOptions& options, int64_t largest);

inline uint64_t AlignUp(uint64_t x, uint64_t align) { return (x + align - 1) & ~(align - 1); }

}  // namespace emsa::plan_internal
