// l2_window.cc — sizing and applying a persisting-L2 access-policy window (tier L0).
#include "memory/l2_window.h"

#include <algorithm>
#include <string>

#include "common/cuda_util.h"

namespace emsa {
namespace {

float HitRatio(uint64_t reserve, uint64_t window) {
  return reserve >= window ? 1.0f : static_cast<float>(static_cast<double>(reserve) / window);
}

}  // namespace

Result<L2WindowPlan> PlanL2Window(const L2Limits& limits, const void* base, uint64_t bytes,
                                  const L2WindowOptions& options) {
  if (base == nullptr || bytes == 0) {
    return Status::InvalidArgument("L2 window: the range is empty or its base is null");
  }
  if (!(options.max_l2_fraction > 0.0 && options.max_l2_fraction <= 1.0)) {
    return Status::InvalidArgument("L2 window: max_l2_fraction must be in (0, 1], got " +
                                   std::to_string(options.max_l2_fraction));
  }
  if (limits.max_persisting_bytes == 0) {
    return Status::Unsupported(
        "L2 window not available: the device reports no persisting L2 (older GPU, or a MIG "
        "instance); tier L0 stays off");
  }
  const uint64_t cap = std::min<uint64_t>(
      limits.max_persisting_bytes,
      static_cast<uint64_t>(static_cast<double>(limits.l2_bytes) * options.max_l2_fraction));
  uint64_t window = bytes;
  if (limits.max_window_bytes != 0) window = std::min(window, limits.max_window_bytes);

  // No more than the window needs; never more than the cap once the driver has rounded it.
  uint64_t reserve = std::min(window, cap);
  const uint64_t step = limits.reserve_step_bytes;
  if (step != 0) {
    reserve = (reserve + step - 1) / step * step;
    if (reserve > cap) reserve = cap / step * step;
  }
  if (reserve == 0) {
    return Status::Unsupported("L2 window not available: the cap of " + std::to_string(cap) +
                               " bytes (" + std::to_string(options.max_l2_fraction) +
                               " of L2, at most the persisting maximum) is below one reserve "
                               "step of " +
                               std::to_string(step) + " bytes");
  }
  L2WindowPlan plan;
  plan.reserve_bytes = reserve;
  plan.base = reinterpret_cast<uintptr_t>(base);
  plan.window_bytes = window;
  plan.hit_ratio = HitRatio(reserve, window);
  return plan;
}

#if EMSA_HAVE_CUDA

Result<L2Limits> QueryL2Limits(int device) {
  int l2 = 0, persisting = 0, window = 0;
  EMSA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  EMSA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&persisting, cudaDevAttrMaxPersistingL2CacheSize, device));
  EMSA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&window, cudaDevAttrMaxAccessPolicyWindowSize, device));
  L2Limits limits;
  limits.l2_bytes = static_cast<uint64_t>(std::max(l2, 0));
  limits.max_persisting_bytes = static_cast<uint64_t>(std::max(persisting, 0));
  limits.max_window_bytes = static_cast<uint64_t>(std::max(window, 0));
  if (limits.max_persisting_bytes == 0) return limits;

  // The step is not an attribute: ask for one byte and see what the driver grants.
  size_t previous = 0, granted = 0;
  EMSA_CUDA_RETURN_IF_ERROR(cudaDeviceGetLimit(&previous, cudaLimitPersistingL2CacheSize));
  EMSA_CUDA_RETURN_IF_ERROR(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 1));
  const cudaError_t read = cudaDeviceGetLimit(&granted, cudaLimitPersistingL2CacheSize);
  EMSA_CUDA_RETURN_IF_ERROR(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, previous));
  EMSA_RETURN_IF_ERROR(CudaStatus(read, "cudaDeviceGetLimit(cudaLimitPersistingL2CacheSize)"));
  limits.reserve_step_bytes = granted > 1 ? granted : 0;
  return limits;
}

Result<std::unique_ptr<L2Window>> L2Window::Enable(const L2WindowPlan& plan) {
  if (plan.base == 0 || plan.window_bytes == 0 || plan.reserve_bytes == 0) {
    return Status::InvalidArgument("L2 window: the plan is empty; make it with PlanL2Window");
  }
  std::unique_ptr<L2Window> l2(new L2Window());
  EMSA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetLimit(&l2->previous_limit_, cudaLimitPersistingL2CacheSize));
  EMSA_CUDA_RETURN_IF_ERROR(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, plan.reserve_bytes));
  size_t granted = 0;
  const cudaError_t read = cudaDeviceGetLimit(&granted, cudaLimitPersistingL2CacheSize);
  if (read != cudaSuccess || granted == 0) {
    (void)cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, l2->previous_limit_);
    if (read != cudaSuccess) return CudaStatus(read, "cudaDeviceGetLimit after setting it");
    return Status::Unsupported("L2 window not available: the driver granted no persisting L2");
  }
  l2->granted_bytes_ = granted;
  l2->window_.base_ptr = reinterpret_cast<void*>(plan.base);
  l2->window_.num_bytes = plan.window_bytes;
  // What was granted, not what was asked, bounds the persisting share.
  l2->window_.hitRatio = std::min(plan.hit_ratio, HitRatio(granted, plan.window_bytes));
  l2->window_.hitProp = cudaAccessPropertyPersisting;
  l2->window_.missProp = cudaAccessPropertyStreaming;
  return l2;
}

Result<std::unique_ptr<L2Window>> L2Window::EnableFor(int device, const void* base, uint64_t bytes,
                                                      const L2WindowOptions& options) {
  EMSA_ASSIGN_OR_RETURN(const L2Limits limits, QueryL2Limits(device));
  EMSA_ASSIGN_OR_RETURN(const L2WindowPlan plan, PlanL2Window(limits, base, bytes, options));
  return Enable(plan);
}

L2Window::~L2Window() {
  // Lines already marked persisting would otherwise keep their claim after the limit drops.
  (void)cudaCtxResetPersistingL2Cache();
  (void)cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, previous_limit_);
  (void)cudaGetLastError();
}

cudaLaunchAttribute L2Window::launch_attribute() const {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeAccessPolicyWindow;
  attribute.val.accessPolicyWindow = window_;
  return attribute;
}

#endif  // EMSA_HAVE_CUDA

}  // namespace emsa
