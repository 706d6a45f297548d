// update_probe.h — what the profile's host measurements (cpu_profile.cc alone, gpu_profile.cc
// with copies running) and HostLoad (host_load.cc) share: their host memory, and the tensor the
// host-update ones time: n fp32 parameters, their gradients and two moments in four consecutive
// arrays, 28 bytes moved per parameter, rounding to nearest.
#pragma once

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <memory>

#include "common/thread_pool.h"
#include "emsa/update.h"

namespace emsa::profile_internal {

using HostFloats = std::unique_ptr<float, decltype(&std::free)>;

// `count` floats of host memory on 2 MiB boundaries, advised onto huge pages (as the host arena
// asks for them), first touched by `pool`'s threads `grain` at a time (so the pages sit near the
// threads that will stream through them) with small values; null when the allocation fails.
inline HostFloats TouchedHostFloats(ThreadPool& pool, int64_t count, int64_t grain) {
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t bytes =
      (static_cast<size_t>(count) * sizeof(float) + kHugePage - 1) / kHugePage * kHugePage;
  HostFloats out(static_cast<float*>(std::aligned_alloc(kHugePage, bytes)), &std::free);
  if (out == nullptr) return out;
  (void)madvise(out.get(), bytes, MADV_HUGEPAGE);
  float* const data = out.get();
  pool.ParallelFor(count, grain, [data](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) data[i] = 1e-3f * static_cast<float>(i % 1000);
  });
  return out;
}

// The bytes FourArrayUpdate's step moves per parameter: param, gradient and both moments read,
// param and moments written.
constexpr double kFourArrayUpdateBytes = 28.0;

inline TensorUpdate FourArrayUpdate(float* data, int64_t n, const HyperParams* hyper) {
  TensorUpdate t;
  t.param = data;
  t.grad = data + n;
  t.exp_avg = data + 2 * n;
  t.exp_avg_sq = data + 3 * n;
  t.numel = n;
  t.hyper = hyper;
  return t;
}

inline StepOptions NearestRounding() {
  StepOptions step;
  step.rounding = Rounding::kNearest;
  return step;
}

}  // namespace emsa::profile_internal
