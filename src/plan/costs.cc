// costs.cc — bytes per view and per update; bandwidths with defaults.
#include "plan/costs.h"

#include <algorithm>

#include "emsa/host_tier_costs.h"

namespace emsa::plan_internal {
namespace {

double Or(double measured, double fallback) { return measured > 0.0 ? measured : fallback; }

uint64_t U(int64_t numel) { return static_cast<uint64_t>(numel); }

}  // namespace

Bandwidths ResolveBandwidths(const DeviceProfile& profile) {
  Bandwidths bw;
  bw.hbm = Or(profile.gpu.hbm_bandwidth, kDefaultHbmBandwidth);
  bw.d2h = Or(profile.gpu.d2h_bandwidth, kDefaultLinkBandwidth);
  bw.h2d = Or(profile.gpu.h2d_bandwidth, kDefaultLinkBandwidth);
  bw.duplex = Or(profile.gpu.duplex_bandwidth, std::min(bw.d2h, bw.h2d));
  bw.host_update_duplex = profile.gpu.host_update_duplex_bandwidth;
  bw.duplex_under_update = Or(profile.gpu.duplex_under_update_bandwidth, bw.duplex);
  bw.host_update = Or(profile.cpu.host_update_bandwidth,
                      Or(profile.cpu.host_mem_bandwidth, kDefaultHostUpdateBandwidth));
  return bw;
}

int TierViews(Tier tier, int64_t numel, DType param_dtype, const PlanOptions& options,
              ViewSpec out[kMaxViews]) {
  const uint64_t n = U(numel);
  const uint64_t state = n * DTypeSize(options.state_dtype);
  const uint64_t param = n * DTypeSize(param_dtype);
  const bool fp32 = param_dtype == DType::kFloat32;
  const bool two_moments = StateCount(options.optimizer) == 2;
  int count = 0;
  if (tier == Tier::kL2) out[count++] = {ViewKind::kGrad, param};
  out[count++] = {ViewKind::kExpAvg, state};
  if (two_moments) out[count++] = {ViewKind::kExpAvgSq, state};
  if (tier == Tier::kL2 || !fp32) out[count++] = {ViewKind::kMaster, n * 4};
  return count;
}

uint64_t PaddedStateBytes(Tier tier, int64_t numel, DType param_dtype, const PlanOptions& options,
                          uint64_t align) {
  ViewSpec views[kMaxViews];
  const int count = TierViews(tier, numel, param_dtype, options, views);
  uint64_t total = 0;
  for (int v = 0; v < count; ++v) total += AlignUp(views[v].bytes, align);
  return total;
}

uint64_t DeviceUpdateTraffic(int64_t numel, DType param_dtype, const PlanOptions& options) {
  const uint64_t n = U(numel);
  const uint64_t param = n * DTypeSize(param_dtype);
  const uint64_t moments = n * DTypeSize(options.state_dtype) * StateCount(options.optimizer);
  const uint64_t master = param_dtype == DType::kFloat32 ? 0 : n * 4;
  return 2 * param + param + 2 * moments + 2 * master;
}

uint64_t HostUpdateTraffic(int64_t numel, DType param_dtype, const PlanOptions& options) {
  const uint64_t n = U(numel);
  const uint64_t param = n * DTypeSize(param_dtype);
  const uint64_t moments = n * DTypeSize(options.state_dtype) * StateCount(options.optimizer);
  // The front end's gradients are in the parameter's dtype; a low-precision one has a master.
  if (kHostTierDeviceDelta && HostTierAppliesDelta(options.optimizer, param_dtype, param_dtype,
                                                   param_dtype != DType::kFloat32)) {
    return 2 * n * 4 + 2 * moments;  // grad r, delta w (device_delta)
  }
  // A 16-bit parameter is rounded over its gradient (r, then w) beside its master; an fp32 one
  // is its master.
  const uint64_t rounded = param_dtype == DType::kFloat32 ? 0 : param;
  return param + 2 * n * 4 + 2 * moments + rounded;
}

uint64_t DeviceUpdateLinkBytes(int64_t numel, const PlanOptions& options) {
  return U(numel) * DTypeSize(options.state_dtype) * StateCount(options.optimizer);
}

bool DeviceUpdatesAllowed(const PlanOptions& options, bool gpu_present) {
  const double share = options.device_update_share;
  return gpu_present && (share > 0.0 || (share < 0.0 && options.release_grads));
}

uint64_t StreamStagingBytes(const PlanOptions& options, int64_t largest) {
  return static_cast<uint64_t>(HostTierStreamStagingBytes(options.optimizer, options.state_dtype,
                                                          kHostTierStreamPieceElements,
                                                          kHostTierStreamSlots, largest));
}

uint64_t HostMemoryTraffic(int64_t numel, DType param_dtype, const PlanOptions& options) {
  const uint64_t dma = 2 * U(numel) * DTypeSize(param_dtype);  // gradient in, parameter out
  return HostUpdateTraffic(numel, param_dtype, options) + dma;
}

}  // namespace emsa::plan_internal
