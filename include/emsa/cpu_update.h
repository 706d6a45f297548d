// emsa/cpu_update.h — the host tier's optimizer step on the CPU.
//
// CpuUpdater owns a persistent worker pool (threads made once, none per step) and the SIMD
// variant chosen at construction from cpuid (AVX-512, AVX2 or scalar; a lower one can be forced
// for tests). Step() deals the elements of all tensors to the workers in runs they claim as
// they finish the last (guided scheduling, SetGuidedScheduling; or one equal share each), cut
// at multiples of 64 elements within a tensor (a run may span tensors), and returns when all
// are done. It is synchronous and must not be called from two threads at
// once on the same updater. It allocates nothing.
//
// Numerics (the math is in emsa/update.h):
//  - Every element's result depends only on its inputs, its tensor's hyperparameters and step,
//    the options, and its index within its tensor: results are bitwise identical across runs,
//    thread counts and ISAs (each float operation rounds on its own; no FMA contraction).
//  - Stores to bf16/fp16 round to nearest even, or (Rounding::kStochastic) stochastically from a
//    hash of (seed, step, element index within the tensor). Tensors that share a step see the
//    same random stream; vary `seed` per call if that matters.
//  - A bf16/fp16 parameter with an fp32 master: the master is updated and the parameter gets
//    the master rounded to nearest even. Without a master, a bf16/fp16 parameter is updated in
//    fp32 and stored with stochastic rounding (round-to-nearest would drop small updates, so
//    that combination is rejected). An fp32 parameter takes no master.
//  - States are fp32 or bf16 (both moments share state_dtype). With bf16 states the parameter
//    update uses the fp32 moments before they are rounded for storage.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "emsa/profile.h"
#include "emsa/status.h"
#include "emsa/update.h"

namespace emsa {

class ThreadPool;
namespace cpu {
struct KernelTable;
}

struct CpuUpdaterOptions {
  int threads = 0;  // 0 = every core this process may run on; at most 4096
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

  // How Step and StepRange deal a batch to the pool. N >= 64 (default kGuidedMinElements):
  // guided self-scheduling; threads claim contiguous runs of the remaining elements, each
  // remaining/(2 x threads) long but at least N, until none are left, so a thread the OS or
  // another process slows down holds up the others by at most a short run. 0: each thread takes
  // one contiguous, equal share. Guided is the default because on a shared machine equal shares
  // wait for the slowest thread. The last runs of a call set its tail, paid once per call (per
  // gradient bucket in the host tier), so the minimum run stays short enough that a bucket's
  // tail is small. The results are the same bits either way (each element depends only on its
  // own index). Not to be changed while a step runs. kInvalidArgument for 1..63 or negative
  // values.
  static constexpr int64_t kGuidedMinElements = 16384;
  Status SetGuidedScheduling(int64_t min_elements);

  // Validates every tensor first (non-null pointers, numel >= 0, supported dtypes, step >= 1,
  // finite hyperparameters, lr >= 0, weight_decay >= 0, 0 <= betas < 1, eps > 0 for Adam); an
  // invalid batch changes nothing and the error names the tensor index (kInvalidArgument;
  // kUnsupported for an fp16 state). Null pointers are fine where numel is 0. With
  // options.check_finite a non-finite gradient anywhere skips the whole batch (report->skipped,
  // with the count and the first offending tensor) and changes nothing; that is not an error.
  Status Step(const TensorUpdate* tensors, size_t count, const StepOptions& options,
              StepReport* report = nullptr);

  // Step() for the elements [first, last) of the batch, counted across its tensors in order
  // (element i of tensor t is at t's offset plus i): the same results those elements get from
  // Step(), since each element's result depends only on its own index within its tensor. The
  // host tier updates a bucket with it piece by piece as the bucket's gradients land. first and
  // last must be Aligned(); options.check_finite must be false (kInvalidArgument otherwise).
  Status StepRange(const TensorUpdate* tensors, size_t count, const StepOptions& options,
                   int64_t first, int64_t last);
  // The batch position `position` moved back to a tensor boundary or to a multiple of 64
  // elements within its tensor (where Step splits work); the batch's size when past its end.
  static int64_t Aligned(const TensorUpdate* tensors, size_t count, int64_t position);

  // The checks Step() runs before touching anything, on their own (the C ABI validates a large
  // batch chunk by chunk before the first chunk updates).
  Status Validate(const TensorUpdate* tensors, size_t count, const StepOptions& options) const;

  // Sum of squares of all gradients (times grad_multiplier^2 is NOT applied) and the count of
  // non-finite elements, in one pass: the input to clipping by global norm. Only numel, grad and
  // grad_dtype are read. Either output may be null. The sum is accumulated in double; it is
  // repeatable for a given thread count and ISA, and may differ in the last bits otherwise.
  Status GradStats(const TensorUpdate* tensors, size_t count, double* sum_sq,
                   int64_t* nonfinite_count);

  ThreadPool& pool() { return *pool_; }

 private:
  struct Partial;  // one worker's gradient-scan result, on a cache line of its own
  struct Scan;
  CpuUpdater() = default;
  Scan ScanGrads(const TensorUpdate* tensors, size_t count, int64_t total);
  // Runs the update of the batch's elements [first, first + total) on the pool (validated).
  void Update(const TensorUpdate* tensors, size_t count, const StepOptions& options, int64_t first,
              int64_t total);

  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Partial[]> partials_;  // pool size entries, sized at Create
  const cpu::KernelTable* kernels_ = nullptr;
  SimdLevel simd_ = SimdLevel::kScalar;
  int64_t guided_min_ = kGuidedMinElements;
};

}  // namespace emsa
