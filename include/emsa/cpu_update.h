// emsa/cpu_update.h — the host tier's optimizer step on the CPU.
//
// CpuUpdater owns a persistent worker pool (threads made once, none per step) and the SIMD
// variant chosen at construction from cpuid (AVX-512, AVX2 or scalar; a lower one can be forced
// for tests). Step() splits the elements of all tensors so every worker gets an equal share
// (tensor boundaries do not matter), runs, and returns when all are done. It is synchronous and
// must not be called from two threads at once on the same updater. It allocates nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "emsa/profile.h"
#include "emsa/status.h"
#include "emsa/update.h"

namespace emsa {

class ThreadPool;

struct CpuUpdaterOptions {
  int threads = 0;  // 0 = every core this process may run on
  // Highest ISA to use; the detected level is used if lower. Tests force each level.
  SimdLevel max_simd = SimdLevel::kAvx512;
};

class CpuUpdater {
 public:
  static Result<std::unique_ptr<CpuUpdater>> Create(const CpuUpdaterOptions& options = {});
  ~CpuUpdater();
  CpuUpdater(const CpuUpdater&) = delete;
  CpuUpdater& operator=(const CpuUpdater&) = delete;

  SimdLevel simd() const { return simd_; }
  int threads() const;

  // Validates every tensor first (non-null pointers, numel >= 0, supported dtypes, step >= 1,
  // finite hyperparameters, lr >= 0, 0 <= betas < 1, eps > 0 for Adam); an invalid batch changes
  // nothing and the error names the tensor index. With options.check_finite a non-finite
  // gradient anywhere skips the whole batch (report->skipped) and changes nothing.
  Status Step(const TensorUpdate* tensors, size_t count, const StepOptions& options,
              StepReport* report = nullptr);

  // The checks Step() runs before touching anything, on their own (the C ABI validates a large
  // batch chunk by chunk before the first chunk updates).
  Status Validate(const TensorUpdate* tensors, size_t count, const StepOptions& options) const;

  // Sum of squares of all gradients (times grad_multiplier^2 is NOT applied) and the count of
  // non-finite elements, in one pass: the input to clipping by global norm.
  Status GradStats(const TensorUpdate* tensors, size_t count, double* sum_sq,
                   int64_t* nonfinite_count);

  ThreadPool& pool() { return *pool_; }

 private:
  CpuUpdater() = default;
  std::unique_ptr<ThreadPool> pool_;
  SimdLevel simd_ = SimdLevel::kScalar;
};

}  // namespace emsa
