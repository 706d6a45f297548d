// l2_window.h — tier L0: a persisting-L2 access-policy window over a range of the device arena.
//
// Two halves. PlanL2Window() is pure arithmetic on the device's limits (testable without a GPU):
// how much L2 to set aside and which hitRatio makes the window fit in it. L2Window (CUDA builds
// only) applies a plan to the current device: it sets cudaLimitPersistingL2CacheSize, reads
// back what the driver granted (it rounds up), and hands out the cudaLaunchAttribute that
// cudaLaunchKernelEx (or a stream attribute) takes. Its destructor demotes the persisting lines
// and restores the previous limit.
//
// Why the caps: a reserve larger than 3/16 of L2 cuts other kernels' write bandwidth, while
// optimizer state is read once per step; L0 is opt-in and stays off unless the benchmark shows
// a gain (DESIGN.md).
//
// The persisting limit is device-wide (per context): one L2Window per device at a time.
#pragma once

#include <cstdint>
#include <memory>

#include "emsa/status.h"

#if EMSA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace emsa {

struct L2Limits {
  uint64_t l2_bytes = 0;              // cudaDevAttrL2CacheSize
  uint64_t max_persisting_bytes = 0;  // cudaDevAttrMaxPersistingL2CacheSize; 0 without (or MIG)
  uint64_t max_window_bytes = 0;      // cudaDevAttrMaxAccessPolicyWindowSize
  // The step the driver rounds a persisting reserve up to (3.75 MiB on an H200); 0: unknown,
  // and the reserve is used as computed.
  uint64_t reserve_step_bytes = 0;
};

struct L2WindowOptions {
  double max_l2_fraction = 3.0 / 16;  // the reserve never exceeds this share of L2, in (0, 1]
};

struct L2WindowPlan {
  uint64_t reserve_bytes = 0;  // what to set cudaLimitPersistingL2CacheSize to
  uintptr_t base = 0;          // the window: [base, base + window_bytes)
  uint64_t window_bytes = 0;   // the range, cut to max_window_bytes
  float hit_ratio = 0.0f;      // reserve / window, at most 1: the share of lines that persist
};

// kUnsupported (with the reason) when the device has no persisting L2 (max_persisting_bytes 0,
// as under MIG) or the caps leave less than one reserve step; kInvalidArgument for an empty or
// null range, or a fraction outside (0, 1].
Result<L2WindowPlan> PlanL2Window(const L2Limits& limits, const void* base, uint64_t bytes,
                                  const L2WindowOptions& options = L2WindowOptions());

#if EMSA_HAVE_CUDA

// The device's limits; the reserve step is measured by setting the limit to one byte on the
// current device and reading back what the driver granted (then restoring it), so `device`
// must be the current device.
Result<L2Limits> QueryL2Limits(int device);

class L2Window {
 public:
  // Sets the current device's persisting limit to plan.reserve_bytes. hit_ratio is recomputed
  // from the granted size, so the persisting lines never exceed the reserve.
  static Result<std::unique_ptr<L2Window>> Enable(const L2WindowPlan& plan);
  // Query, plan and enable in one call on the current device `device`.
  static Result<std::unique_ptr<L2Window>> EnableFor(
      int device, const void* base, uint64_t bytes,
      const L2WindowOptions& options = L2WindowOptions());
  ~L2Window();
  L2Window(const L2Window&) = delete;
  L2Window& operator=(const L2Window&) = delete;

  // hitProp persisting, missProp streaming: lines outside the hit share do not evict others.
  const cudaAccessPolicyWindow& window() const { return window_; }
  cudaLaunchAttribute launch_attribute() const;
  uint64_t granted_bytes() const { return granted_bytes_; }

 private:
  L2Window() = default;
  cudaAccessPolicyWindow window_ = {};
  uint64_t granted_bytes_ = 0;
  size_t previous_limit_ = 0;
};

#endif  // EMSA_HAVE_CUDA

}  // namespace emsa
