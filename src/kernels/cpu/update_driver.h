// update_driver.h — range loops over UpdateVector and the gradient scan, and the kernel table.
//
// Instantiated once per ISA file with its Ops type and, where loads cannot be masked (AVX2), a
// scalar TailOps for the last elements. The main loop takes four vectors per round (64 elements
// on AVX-512) so several independent loads of every stream are in flight; the hardware
// prefetchers follow the sequential streams on their own (software prefetch 512 and 2048
// elements ahead made no difference beyond noise in bench/cpu_update_bench.cc on a Zen 4 VM;
// worth re-measuring on the 16-core host).
//
// Unnamed namespace: each ISA translation unit must get its own copy (see numerics.h).
#pragma once

#include <cstdint>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/update_math.h"

namespace emsa {
namespace cpu {
namespace {

template <class Ops, class TailOps, OptimizerKind kOpt, ParamKind kP, int kS, bool kSr, bool kD>
EMSA_CPU_INLINE void UpdateLoop(const UpdateArgs& a, int64_t begin, int64_t end) {
#ifdef EMSA_MUTATE_NOOP_UPDATE
  // A test-only build (CMake EMSA_MUTATE_NOOP_UPDATE): the update writes nothing, so every
  // numerics test must fail against it (scripts/test checks that they do).
  return;
#endif
  constexpr int64_t kW = Ops::kWidth;
  const auto c = Broadcast<Ops>(a);
  const auto all = Ops::All();
  int64_t i = begin;
  for (; i + 4 * kW <= end; i += 4 * kW) {
    UpdateVector<Ops, kOpt, kP, kS, kSr, kD>(a, c, i, all);
    UpdateVector<Ops, kOpt, kP, kS, kSr, kD>(a, c, i + kW, all);
    UpdateVector<Ops, kOpt, kP, kS, kSr, kD>(a, c, i + 2 * kW, all);
    UpdateVector<Ops, kOpt, kP, kS, kSr, kD>(a, c, i + 3 * kW, all);
  }
  for (; i + kW <= end; i += kW) UpdateVector<Ops, kOpt, kP, kS, kSr, kD>(a, c, i, all);
  if (i == end) return;
  if constexpr (Ops::kMaskedTail) {
    UpdateVector<Ops, kOpt, kP, kS, kSr, kD>(a, c, i, Ops::FirstN(end - i));
  } else {
    const auto tail = Broadcast<TailOps>(a);
    for (; i < end; ++i) UpdateVector<TailOps, kOpt, kP, kS, kSr, kD>(a, tail, i, TailOps::All());
  }
}

// kD: the delta kernels (UpdateVector's kDelta).
template <class Ops, class TailOps, OptimizerKind kOpt, ParamKind kP, int kS, bool kD = false>
void UpdateRange(const UpdateArgs& a, int64_t begin, int64_t end) {
  if (kS == 1 && a.stochastic) {
    UpdateLoop<Ops, TailOps, kOpt, kP, kS, true, kD>(a, begin, end);
  } else {
    UpdateLoop<Ops, TailOps, kOpt, kP, kS, false, kD>(a, begin, end);
  }
}

template <class Ops, class Mask>
EMSA_CPU_INLINE void AccumulateGrad(const void* grad, DType dtype, int64_t i, Mask m,
                                    typename Ops::Stats* stats) {
  switch (dtype) {
    case DType::kBFloat16:
      Ops::Accumulate(Ops::LoadBf16(At<uint16_t>(grad, i), m), stats);
      break;
    case DType::kFloat16:
      Ops::Accumulate(Ops::LoadF16(At<uint16_t>(grad, i), m), stats);
      break;
    default:
      Ops::Accumulate(Ops::LoadF32(At<float>(grad, i), m), stats);
      break;
  }
}

// Sum of squares (in double) and count of inf/nan over grad[begin, end), added to *accum.
template <class Ops, class TailOps>
void GradStatsRange(const void* grad, DType dtype, int64_t begin, int64_t end, GradAccum* accum) {
  constexpr int64_t kW = Ops::kWidth;
  typename Ops::Stats stats{};
  int64_t i = begin;
  for (; i + kW <= end; i += kW) AccumulateGrad<Ops>(grad, dtype, i, Ops::All(), &stats);
  if (i < end) {
    if constexpr (Ops::kMaskedTail) {
      AccumulateGrad<Ops>(grad, dtype, i, Ops::FirstN(end - i), &stats);
    } else {
      typename TailOps::Stats tail{};
      for (; i < end; ++i) AccumulateGrad<TailOps>(grad, dtype, i, TailOps::All(), &tail);
      TailOps::Reduce(tail, accum);
    }
  }
  Ops::Reduce(stats, accum);
}

template <class Ops, class TailOps, OptimizerKind kOpt>
void FillOptimizer(KernelTable* t) {
  auto& row = t->update[static_cast<int>(kOpt)];
  row[0][0] = &UpdateRange<Ops, TailOps, kOpt, ParamKind::kF32, 0>;
  row[0][1] = &UpdateRange<Ops, TailOps, kOpt, ParamKind::kF32, 1>;
  row[1][0] = &UpdateRange<Ops, TailOps, kOpt, ParamKind::kBf16, 0>;
  row[1][1] = &UpdateRange<Ops, TailOps, kOpt, ParamKind::kBf16, 1>;
  row[2][0] = &UpdateRange<Ops, TailOps, kOpt, ParamKind::kF16, 0>;
  row[2][1] = &UpdateRange<Ops, TailOps, kOpt, ParamKind::kF16, 1>;
  row[3][0] = &UpdateRange<Ops, TailOps, kOpt, ParamKind::kBf16Master, 0>;
  row[3][1] = &UpdateRange<Ops, TailOps, kOpt, ParamKind::kBf16Master, 1>;
  row[4][0] = &UpdateRange<Ops, TailOps, kOpt, ParamKind::kF16Master, 0>;
  row[4][1] = &UpdateRange<Ops, TailOps, kOpt, ParamKind::kF16Master, 1>;
  static_assert(kParamKinds == 5 && kStateKinds == 2, "fill every ParamKind x state kind");
  if constexpr (kOpt != OptimizerKind::kAdam) {
    t->update_delta[static_cast<int>(kOpt)][0] =
        &UpdateRange<Ops, TailOps, kOpt, ParamKind::kF32, 0, true>;
    t->update_delta[static_cast<int>(kOpt)][1] =
        &UpdateRange<Ops, TailOps, kOpt, ParamKind::kF32, 1, true>;
  }
}

template <class Ops, class TailOps>
KernelTable MakeKernelTable(SimdLevel level) {
  KernelTable t;
  t.level = level;
  FillOptimizer<Ops, TailOps, OptimizerKind::kAdamW>(&t);
  FillOptimizer<Ops, TailOps, OptimizerKind::kAdam>(&t);
  FillOptimizer<Ops, TailOps, OptimizerKind::kLion>(&t);
  static_assert(kOptimizers == 3, "fill every optimizer");
  t.grad_stats = &GradStatsRange<Ops, TailOps>;
  return t;
}

}  // namespace
}  // namespace cpu
}  // namespace emsa
