// cpu_updater.cc — CpuUpdater: validate, optionally scan gradients, split the elements evenly
// over the pool, run the ISA's kernels.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <string>

#include "common/thread_pool.h"
#include "emsa/cpu_update.h"
#include "kernels/cpu/kernels.h"

namespace emsa {
namespace {

// Work is cut at multiples of this many elements within a tensor: a whole number of 64-byte
// vectors for every dtype, so no two workers share a cache line of any stream (of a tensor that
// starts 64-byte aligned), and each worker's kernel runs its unrolled loop.
constexpr int64_t kSplitAlign = 64;
constexpr int kMaxThreads = 4096;

bool IsDType(DType d) {
  return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16;
}

std::string Name(size_t index) { return "tensors[" + std::to_string(index) + "]"; }

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

Status Invalid(size_t index, const std::string& what) {
  return Status::InvalidArgument(Name(index) + "." + what);
}

Status ValidateOptions(const StepOptions& o) {
  EMSA_RETURN_IF_ERROR(ValidateOptimizer(o.optimizer, "options.optimizer"));
  if (o.rounding != Rounding::kNearest && o.rounding != Rounding::kStochastic) {
    return Status::InvalidArgument("options.rounding is " +
                                   std::to_string(static_cast<int>(o.rounding)) +
                                   "; use Rounding::kNearest or kStochastic");
  }
  if (!std::isfinite(o.grad_multiplier)) {
    return Status::InvalidArgument("options.grad_multiplier is " + Num(o.grad_multiplier) +
                                   "; it must be finite (clip_coef / loss_scale)");
  }
  return Status::Ok();
}

Status ValidateTensor(size_t i, const TensorUpdate& t, const StepOptions& o) {
  if (t.numel < 0) return Invalid(i, "numel is " + std::to_string(t.numel) + "; it must be >= 0");
  if (t.hyper == nullptr) return Invalid(i, "hyper is null; point it at the tensor's HyperParams");
  if (t.step < 1) {
    return Invalid(i, "step is " + std::to_string(t.step) +
                          "; steps count from 1 (bias correction divides by 1 - beta^step)");
  }
  if (!IsDType(t.param_dtype) || !IsDType(t.grad_dtype) || !IsDType(t.state_dtype)) {
    return Invalid(i, "param_dtype, grad_dtype or state_dtype is not a DType value");
  }
  if (t.state_dtype == DType::kFloat16) {
    return Status::Unsupported(Name(i) +
                               ".state_dtype float16 is not supported; use float32 or bfloat16");
  }
  // The tensor's name is added only on error: validation runs every step and allocates nothing.
  if (Status st = ValidateHyperParams(*t.hyper, o.optimizer, "hyper->"); !st.ok()) {
    return Invalid(i, st.message());
  }
  const bool low_param = t.param_dtype != DType::kFloat32;
  if (!low_param && t.master != nullptr) {
    return Invalid(i, "master is set but param is float32, which is its own master; pass null");
  }
  if (low_param && t.master == nullptr && o.rounding != Rounding::kStochastic) {
    return Invalid(i, std::string("param is ") + DTypeName(t.param_dtype) +
                          " without an fp32 master, which needs Rounding::kStochastic "
                          "(round-to-nearest would drop small updates); pass a master copy or "
                          "stochastic rounding");
  }
  if (t.delta != nullptr) {
    if (o.optimizer == OptimizerKind::kAdam) {
      return Invalid(i,
                     "delta is set, but Adam's L2 decay reads the parameter into the gradient; "
                     "use AdamW or Lion, or pass null");
    }
    if (t.param_dtype != DType::kFloat32) {
      return Invalid(i, std::string("delta is set for a ") + DTypeName(t.param_dtype) +
                            " parameter; it is for fp32 parameters only: pass null");
    }
    if (t.grad == t.delta && t.grad_dtype != DType::kFloat32) {
      return Invalid(i, std::string("delta is grad, but grad is ") + DTypeName(t.grad_dtype) +
                            "; only an fp32 gradient can hold the delta in place");
    }
  }
  if (t.param == t.grad && t.param != nullptr && t.param_dtype != t.grad_dtype) {
    return Invalid(i, std::string("param is grad, but param is ") + DTypeName(t.param_dtype) +
                          " and grad " + DTypeName(t.grad_dtype) +
                          "; the parameter can be written over its gradient only in its own dtype");
  }
  if (t.numel == 0) return Status::Ok();
  if (t.param == nullptr && t.delta == nullptr) return Invalid(i, "param is null");
  if (t.grad == nullptr) return Invalid(i, "grad is null");
  if (t.exp_avg == nullptr) return Invalid(i, "exp_avg is null");
  if (t.exp_avg_sq == nullptr && o.optimizer != OptimizerKind::kLion) {
    return Invalid(
        i, std::string("exp_avg_sq is null; ") + OptimizerName(o.optimizer) + " keeps two moments");
  }
  return Status::Ok();
}

// Validates what GradStats reads and returns the total element count.
Status ValidateGrads(const TensorUpdate* tensors, size_t count, int64_t* total) {
  *total = 0;
  if (tensors == nullptr && count > 0) {
    return Status::InvalidArgument("tensors is null but count is " + std::to_string(count));
  }
  for (size_t i = 0; i < count; ++i) {
    const TensorUpdate& t = tensors[i];
    if (t.numel < 0) return Invalid(i, "numel is " + std::to_string(t.numel) + "; it must be >= 0");
    if (!IsDType(t.grad_dtype)) return Invalid(i, "grad_dtype is not a DType value");
    if (t.numel > 0 && t.grad == nullptr) return Invalid(i, "grad is null");
    if (t.numel > std::numeric_limits<int64_t>::max() - *total) {
      return Invalid(i, "numel makes the batch's element count overflow int64");
    }
    *total += t.numel;
  }
  return Status::Ok();
}

// Everything Step checks before it touches memory; sets *total to the batch's element count.
Status ValidateBatch(const TensorUpdate* tensors, size_t count, const StepOptions& options,
                     int64_t* total) {
  EMSA_RETURN_IF_ERROR(ValidateOptions(options));
  EMSA_RETURN_IF_ERROR(ValidateGrads(tensors, count, total));
  for (size_t i = 0; i < count; ++i) EMSA_RETURN_IF_ERROR(ValidateTensor(i, tensors[i], options));
  return Status::Ok();
}

// A position in the batch: element `offset` of tensor `tensor`.
struct Cursor {
  size_t tensor;
  int64_t offset;
};

// floor(total * index / count) without overflow.
int64_t Share(int64_t total, int index, int count) {
  return total / count * index + total % count * index / count;
}

// The position of element `target` of the concatenated batch, moved back to a multiple of
// kSplitAlign within its tensor; past the end it is {count, 0}. Workers compute their own
// bounds with it, so adjacent workers agree on the boundary between them.
Cursor Locate(const TensorUpdate* tensors, size_t count, int64_t target) {
  int64_t start = 0;
  for (size_t t = 0; t < count; ++t) {
    if (target < start + tensors[t].numel) {
      return {t, (target - start) / kSplitAlign * kSplitAlign};
    }
    start += tensors[t].numel;
  }
  return {count, 0};
}

// Calls fn(tensor_index, begin, end) for the non-empty pieces of worker `index`'s share of the
// batch's elements [first, first + total).
template <typename Fn>
void ForEachPiece(const TensorUpdate* tensors, size_t count, int64_t first, int64_t total,
                  int index, int workers, Fn&& fn) {
  const Cursor from = Locate(tensors, count, first + Share(total, index, workers));
  const Cursor to = Locate(tensors, count, first + Share(total, index + 1, workers));
  for (size_t t = from.tensor; t < count && t <= to.tensor; ++t) {
    const int64_t begin = t == from.tensor ? from.offset : 0;
    const int64_t end = t == to.tensor ? to.offset : tensors[t].numel;
    if (begin < end) fn(t, begin, end);
  }
}

void UpdatePiece(const cpu::KernelTable& kernels, const TensorUpdate& t, const StepOptions& options,
                 int64_t begin, int64_t end) {
  const int state = t.state_dtype == DType::kBFloat16 ? 1 : 0;
  const int opt = static_cast<int>(options.optimizer);
  const cpu::UpdateRangeFn fn =
      t.delta != nullptr ? kernels.update_delta[opt][state]
                         : kernels.update[opt][static_cast<int>(cpu::ParamKindOf(t))][state];
  cpu::UpdateArgs args = cpu::MakeUpdateArgs(t, options);
  // Rounding keys depend on the index's high 32 bits; kernels hash the low 32.
  constexpr int64_t kSegment = int64_t{1} << 32;
  while (begin < end) {
    const int64_t high = begin >> 32;
    const int64_t stop = std::min(end, (high + 1) * kSegment);
    if (high != 0) cpu::SetIndexHigh(&args, static_cast<uint32_t>(high));
    fn(args, begin, stop);
    begin = stop;
  }
}

}  // namespace

struct alignas(64) CpuUpdater::Partial {
  double sum_sq = 0.0;
  int64_t nonfinite = 0;
  int64_t first_bad = -1;
};

struct CpuUpdater::Scan {
  double sum_sq = 0.0;
  int64_t nonfinite = 0;
  int64_t first_bad = -1;
};

Result<std::unique_ptr<CpuUpdater>> CpuUpdater::Create(const CpuUpdaterOptions& options) {
  if (options.threads < 0 || options.threads > kMaxThreads) {
    return Status::InvalidArgument("threads is " + std::to_string(options.threads) +
                                   "; use 0 (every allowed CPU) or 1.." +
                                   std::to_string(kMaxThreads));
  }
  if (options.max_simd != SimdLevel::kScalar && options.max_simd != SimdLevel::kAvx2 &&
      options.max_simd != SimdLevel::kAvx512) {
    return Status::InvalidArgument("max_simd is not a SimdLevel value");
  }
  std::unique_ptr<CpuUpdater> updater(new CpuUpdater());
  updater->simd_ = std::min(DetectSimdLevel(), options.max_simd);
  updater->kernels_ = &cpu::KernelsFor(updater->simd_);
  try {
    updater->pool_ = std::make_unique<ThreadPool>(options.threads);
    updater->partials_ = std::make_unique<Partial[]>(static_cast<size_t>(updater->pool_->size()));
  } catch (const std::exception& e) {
    return Status::OutOfMemory("could not start the CPU update pool (" + std::string(e.what()) +
                               "); ask for fewer threads");
  }
  return updater;
}

CpuUpdater::~CpuUpdater() = default;

int CpuUpdater::threads() const { return pool_->size(); }

CpuUpdater::Scan CpuUpdater::ScanGrads(const TensorUpdate* tensors, size_t count, int64_t total) {
  const cpu::GradStatsFn stats = kernels_->grad_stats;
  pool_->Run([&](int index, int workers) {
    Partial& out = partials_[static_cast<size_t>(index)];
    out = Partial{};
    if (total == 0) return;
    ForEachPiece(tensors, count, 0, total, index, workers,
                 [&](size_t t, int64_t begin, int64_t end) {
                   cpu::GradAccum accum;
                   stats(tensors[t].grad, tensors[t].grad_dtype, begin, end, &accum);
                   out.sum_sq += accum.sum_sq;
                   out.nonfinite += accum.nonfinite;
                   if (accum.nonfinite > 0 && out.first_bad < 0)
                     out.first_bad = static_cast<int64_t>(t);
                 });
  });
  // Fixed order, so the sum is repeatable for a given thread count.
  Scan scan;
  for (int w = 0; w < pool_->size(); ++w) {
    const Partial& p = partials_[static_cast<size_t>(w)];
    scan.sum_sq += p.sum_sq;
    scan.nonfinite += p.nonfinite;
    if (p.first_bad >= 0 && (scan.first_bad < 0 || p.first_bad < scan.first_bad)) {
      scan.first_bad = p.first_bad;
    }
  }
  return scan;
}

Status CpuUpdater::GradStats(const TensorUpdate* tensors, size_t count, double* sum_sq,
                             int64_t* nonfinite_count) {
  int64_t total = 0;
  EMSA_RETURN_IF_ERROR(ValidateGrads(tensors, count, &total));
  const Scan scan = ScanGrads(tensors, count, total);
  if (sum_sq != nullptr) *sum_sq = scan.sum_sq;
  if (nonfinite_count != nullptr) *nonfinite_count = scan.nonfinite;
  return Status::Ok();
}

Status CpuUpdater::Validate(const TensorUpdate* tensors, size_t count,
                            const StepOptions& options) const {
  int64_t total = 0;
  return ValidateBatch(tensors, count, options, &total);
}

Status CpuUpdater::Step(const TensorUpdate* tensors, size_t count, const StepOptions& options,
                        StepReport* report) {
  if (report != nullptr) *report = StepReport{};
  int64_t total = 0;
  EMSA_RETURN_IF_ERROR(ValidateBatch(tensors, count, options, &total));

  if (options.check_finite) {
    const Scan scan = ScanGrads(tensors, count, total);
    if (scan.nonfinite > 0) {
      if (report != nullptr) {
        report->skipped = true;
        report->nonfinite_count = scan.nonfinite;
        report->first_nonfinite_tensor = scan.first_bad;
      }
      return Status::Ok();
    }
  }
  Update(tensors, count, options, 0, total);
  return Status::Ok();
}

Status CpuUpdater::StepRange(const TensorUpdate* tensors, size_t count, const StepOptions& options,
                             int64_t first, int64_t last) {
  int64_t total = 0;
  EMSA_RETURN_IF_ERROR(ValidateBatch(tensors, count, options, &total));
  if (options.check_finite) {
    return Status::InvalidArgument(
        "StepRange cannot check gradients for non-finite values (that skips a whole batch); "
        "scan with GradStats first, or call Step");
  }
  if (first < 0 || last < first || last > total) {
    return Status::InvalidArgument("range [" + std::to_string(first) + ", " + std::to_string(last) +
                                   ") is not within the batch's " + std::to_string(total) +
                                   " elements");
  }
  if (Aligned(tensors, count, first) != first || Aligned(tensors, count, last) != last) {
    return Status::InvalidArgument("range [" + std::to_string(first) + ", " + std::to_string(last) +
                                   ") must start and end at a tensor boundary or a multiple of " +
                                   std::to_string(kSplitAlign) + " elements within a tensor");
  }
  Update(tensors, count, options, first, last - first);
  return Status::Ok();
}

Status CpuUpdater::SetGuidedScheduling(int64_t min_elements) {
  if (min_elements != 0 && min_elements < kSplitAlign) {
    return Status::InvalidArgument(
        "guided scheduling's min_elements is " + std::to_string(min_elements) +
        "; use 0 (equal shares) or at least " + std::to_string(kSplitAlign));
  }
  guided_min_ = min_elements;
  return Status::Ok();
}

void CpuUpdater::Update(const TensorUpdate* tensors, size_t count, const StepOptions& options,
                        int64_t first, int64_t total) {
  if (total == 0) return;
  const cpu::KernelTable& kernels = *kernels_;
  // Updates [begin, end) of tensor t.
  const auto piece = [&](size_t t, int64_t begin, int64_t end) {
    UpdatePiece(kernels, tensors[t], options, begin, end);
  };
  if (guided_min_ == 0) {
    pool_->Run([&](int index, int workers) {
      ForEachPiece(tensors, count, first, total, index, workers, piece);
    });
    return;
  }
  // Guided: claims are [at, Aligned(at + take)), which moves past `at` since take >= 64 and `at`
  // is always an aligned position.
  const int64_t end = first + total;
  std::atomic<int64_t> next{first};
  pool_->Run([&](int, int workers) {
    int64_t at = next.load(std::memory_order_relaxed);
    for (;;) {
      if (at >= end) return;
      const int64_t take = std::max(guided_min_, (end - at) / (2 * static_cast<int64_t>(workers)));
      const int64_t stop = take >= end - at ? end : Aligned(tensors, count, at + take);
      if (!next.compare_exchange_weak(at, stop, std::memory_order_relaxed)) continue;
      ForEachPiece(tensors, count, at, stop - at, 0, 1, piece);
      at = next.load(std::memory_order_relaxed);
    }
  });
}

int64_t CpuUpdater::Aligned(const TensorUpdate* tensors, size_t count, int64_t position) {
  const Cursor c = Locate(tensors, count, position);
  int64_t start = 0;
  for (size_t t = 0; t < c.tensor; ++t) start += tensors[t].numel;
  return start + c.offset;
}

}  // namespace emsa
