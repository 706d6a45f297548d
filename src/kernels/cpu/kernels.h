// kernels.h — the CPU update kernels' table: one per ISA, chosen at run time by CpuUpdater.
//
// A kernel updates elements [begin, end) of one tensor, in place, from an UpdateArgs that holds
// the tensor's pointers and its per-step constants (already rounded to float, as torch does).
// Elements are addressed by their index within the tensor, so the result of an element does not
// depend on how the caller cut the work: any split, any thread count, any ISA gives the same
// bits. Kernels allocate nothing, check nothing (CpuUpdater validates first) and are safe to run
// concurrently on disjoint ranges.
//
// Float evaluation order is fixed by update_math.h and every ISA file disables FMA contraction,
// so the scalar, AVX2 and AVX-512 kernels agree bitwise (tests check it).
#pragma once

#include <cstdint>

#include "emsa/profile.h"
#include "emsa/types.h"
#include "emsa/update.h"
#include "kernels/param_kind.h"

namespace emsa {
namespace cpu {

using emsa::kParamKinds;
using emsa::ParamKind;
using emsa::ParamKindOf;
constexpr int kOptimizers = 3;  // OptimizerKind values
constexpr int kStateKinds = 2;  // 0: fp32 state, 1: bf16 state

// A torch-style lerp(start, end, weight): start + w*(end-start) for w < 0.5, else
// end - (end-start)*(1-w). Both forms are base + (end-start)*coef, with coef = w or -(1-w).
struct LerpConst {
  float coef = 0.0f;
  bool from_end = false;  // base is `end` (the w >= 0.5 form)
};

struct UpdateArgs {
  void* param = nullptr;
  const void* grad = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  float* master = nullptr;
  float* delta = nullptr;  // TensorUpdate::delta (the update_delta kernels)
  DType grad_dtype = DType::kFloat32;
  bool stochastic = false;  // bf16 state stores round stochastically (else to nearest even)

  float grad_scale = 1.0f;  // grad_multiplier, negated under maximize
  float decay = 1.0f;       // AdamW, Lion: 1 - lr*wd (decoupled); Adam: wd (L2, g += wd*p)
  LerpConst lerp1;          // Adam(W): exp_avg toward g by 1-beta1; Lion: c toward g by 1-beta1
  LerpConst lerp2;          // Lion: exp_avg toward g by 1-beta2
  float beta2 = 0.0f;
  float one_minus_beta2 = 0.0f;
  float bias_correction2_sqrt = 1.0f;
  float eps = 0.0f;
  float neg_step_size = 0.0f;  // Adam(W): -lr / (1 - beta1^step); Lion: -lr

  // Stochastic rounding keys for elements whose index has high 32 bits `index_high`; kernels
  // hash (key, low 32 bits of the index). Set with SetIndexHigh().
  uint64_t seed = 0;
  int64_t step = 1;
  uint32_t state_key = 0;  // one hash per element: low 16 bits exp_avg, high 16 exp_avg_sq
  uint32_t param_key = 0;  // params stored in bf16/fp16 without a master copy
};

// Resolves one tensor's constants for this step (computed in double, rounded once to float).
UpdateArgs MakeUpdateArgs(const TensorUpdate& tensor, const StepOptions& options);
// Sets the rounding keys for indices in [index_high << 32, (index_high + 1) << 32).
void SetIndexHigh(UpdateArgs* args, uint32_t index_high);

// GradStats partial result of one worker.
struct GradAccum {
  double sum_sq = 0.0;
  int64_t nonfinite = 0;
};

using UpdateRangeFn = void (*)(const UpdateArgs& args, int64_t begin, int64_t end);
using GradStatsFn = void (*)(const void* grad, DType dtype, int64_t begin, int64_t end,
                             GradAccum* accum);

struct KernelTable {
  SimdLevel level = SimdLevel::kScalar;
  UpdateRangeFn update[kOptimizers][kParamKinds][kStateKinds] = {};
  // fp32 parameters whose change is written to UpdateArgs::delta (TensorUpdate::delta); null for
  // Adam, whose L2 decay needs the parameter.
  UpdateRangeFn update_delta[kOptimizers][kStateKinds] = {};
  GradStatsFn grad_stats = nullptr;
};

const KernelTable& ScalarKernels();
const KernelTable& Avx2Kernels();
const KernelTable& Avx512Kernels();
// The table for `level` (callers make sure the CPU supports it).
const KernelTable& KernelsFor(SimdLevel level);

}  // namespace cpu
}  // namespace emsa
