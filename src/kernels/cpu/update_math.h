// update_math.h — the per-element optimizer arithmetic, written once for every ISA.
//
// UpdateVector is generic over an `Ops` type that supplies the lane types and memory access:
//   V: float lanes (float, __m256, __m512) with + - * / as GCC/Clang vector operators
//   U: uint32 lanes; a mask type from All() (every lane) and, where kMaskedTail, FirstN(n)
//   kWidth, kMaskedTail, Set(float)
//   LoadF32/LoadBf16/LoadF16(ptr, mask), StoreF32/StoreBf16/StoreF16(ptr, V, mask) (nearest
//   even), StoreBf16Sr/StoreF16Sr(ptr, V, U random, mask) (stochastic; numerics.h says which bits)
//   Hash(first_index, key): lane k = HashIndex(first_index + k, key); High16(U)
//   Sqrt(V) (IEEE, correctly rounded), Sign(V) (-1, 0 or +1; NaN gives 0)
// Because every ISA runs this same sequence of IEEE operations (no FMA: each .cc disables
// contraction), all of them produce the same bits. The operations and their order are
// torch.optim's single-tensor AdamW/Adam (Lion as in include/emsa/update.h), see each line;
// torch's own CPU lerp fuses into an FMA, so exp_avg can differ from torch's by an ulp.
//
// With bf16 state the parameter update uses the fp32 moments before they are rounded for
// storage: one rounding fewer than torch with bf16 state, closer to fp32 AdamW.
//
// Unnamed namespace: each ISA translation unit must get its own copy (see numerics.h).
#pragma once

#include <cstdint>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/numerics.h"

#define EMSA_CPU_INLINE inline __attribute__((always_inline))

namespace emsa {
namespace cpu {
namespace {

// UpdateArgs' float constants, broadcast once per range.
template <class V>
struct VecConsts {
  V grad_scale, decay, lerp1, lerp2, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
};

template <class Ops>
EMSA_CPU_INLINE VecConsts<typename Ops::V> Broadcast(const UpdateArgs& a) {
  return {Ops::Set(a.grad_scale),
          Ops::Set(a.decay),
          Ops::Set(a.lerp1.coef),
          Ops::Set(a.lerp2.coef),
          Ops::Set(a.beta2),
          Ops::Set(a.one_minus_beta2),
          Ops::Set(a.bias_correction2_sqrt),
          Ops::Set(a.eps),
          Ops::Set(a.neg_step_size)};
}

// torch.lerp(start, end, w) in its two exact forms (see LerpConst).
template <class V>
EMSA_CPU_INLINE V Lerp(V start, V end, V coef, bool from_end) {
  const V d = end - start;
  const V base = from_end ? end : start;
  return base + d * coef;
}

template <class T>
EMSA_CPU_INLINE T* At(void* p, int64_t i) {
  return static_cast<T*>(p) + i;
}
template <class T>
EMSA_CPU_INLINE const T* At(const void* p, int64_t i) {
  return static_cast<const T*>(p) + i;
}

template <class Ops, class Mask>
EMSA_CPU_INLINE typename Ops::V LoadGrad(const UpdateArgs& a, int64_t i, Mask m) {
  switch (a.grad_dtype) {
    case DType::kBFloat16:
      return Ops::LoadBf16(At<uint16_t>(a.grad, i), m);
    case DType::kFloat16:
      return Ops::LoadF16(At<uint16_t>(a.grad, i), m);
    default:
      return Ops::LoadF32(At<float>(a.grad, i), m);
  }
}

template <class Ops, ParamKind kP, class Mask>
EMSA_CPU_INLINE typename Ops::V LoadParam(const UpdateArgs& a, int64_t i, Mask m) {
  if constexpr (kP == ParamKind::kF32) return Ops::LoadF32(At<float>(a.param, i), m);
  if constexpr (kP == ParamKind::kBf16) return Ops::LoadBf16(At<uint16_t>(a.param, i), m);
  if constexpr (kP == ParamKind::kF16) return Ops::LoadF16(At<uint16_t>(a.param, i), m);
  if constexpr (kP == ParamKind::kBf16Master || kP == ParamKind::kF16Master) {
    return Ops::LoadF32(a.master + i, m);
  }
}

// Parameters without a master copy are only low precision under stochastic rounding (the
// updater rejects the rest), so they always use the parameter stream.
template <class Ops, ParamKind kP, class Mask>
EMSA_CPU_INLINE void StoreParam(const UpdateArgs& a, typename Ops::V p, int64_t i, Mask m) {
  if constexpr (kP == ParamKind::kF32) Ops::StoreF32(At<float>(a.param, i), p, m);
  if constexpr (kP == ParamKind::kBf16 || kP == ParamKind::kF16) {
    const typename Ops::U r = Ops::Hash(static_cast<uint32_t>(i), a.param_key);
    if constexpr (kP == ParamKind::kBf16) Ops::StoreBf16Sr(At<uint16_t>(a.param, i), p, r, m);
    if constexpr (kP == ParamKind::kF16) Ops::StoreF16Sr(At<uint16_t>(a.param, i), p, r, m);
  }
  if constexpr (kP == ParamKind::kBf16Master || kP == ParamKind::kF16Master) {
    Ops::StoreF32(a.master + i, p, m);
    if constexpr (kP == ParamKind::kBf16Master) Ops::StoreBf16(At<uint16_t>(a.param, i), p, m);
    if constexpr (kP == ParamKind::kF16Master) Ops::StoreF16(At<uint16_t>(a.param, i), p, m);
  }
}

template <class Ops, int kS, class Mask>
EMSA_CPU_INLINE typename Ops::V LoadState(void* s, int64_t i, Mask m) {
  if constexpr (kS == 0) return Ops::LoadF32(At<float>(s, i), m);
  if constexpr (kS == 1) return Ops::LoadBf16(At<uint16_t>(s, i), m);
}

// `random` is only read for bf16 state under stochastic rounding (its low 16 bits).
template <class Ops, int kS, bool kSr, class Mask>
EMSA_CPU_INLINE void StoreState(void* s, typename Ops::V x, typename Ops::U random, int64_t i,
                                Mask m) {
  if constexpr (kS == 0) Ops::StoreF32(At<float>(s, i), x, m);
  if constexpr (kS == 1 && kSr) Ops::StoreBf16Sr(At<uint16_t>(s, i), x, random, m);
  if constexpr (kS == 1 && !kSr) Ops::StoreBf16(At<uint16_t>(s, i), x, m);
}

// Updates elements [i, i + kWidth) of one tensor (only the lanes in mask). kSr: bf16 state
// rounds stochastically (a template flag: a run-time test here costs a fifth of the speed).
// kDelta (AdamW and Lion, fp32 parameters): the parameter is not touched; the term added to
// p * decay goes to a.delta instead (the same operations, so p * decay + delta is the same bits).
template <class Ops, OptimizerKind kOpt, ParamKind kP, int kS, bool kSr, bool kDelta, class Mask>
EMSA_CPU_INLINE void UpdateVector(const UpdateArgs& a, const VecConsts<typename Ops::V>& c,
                                  int64_t i, Mask mask) {
  using V = typename Ops::V;
  using U = typename Ops::U;
  static_assert(!kDelta || (kP == ParamKind::kF32 && kOpt != OptimizerKind::kAdam),
                "delta kernels are for fp32 parameters under AdamW or Lion");
  // grad_multiplier first; maximize's negation is folded into grad_scale (exact).
  V g = LoadGrad<Ops>(a, i, mask) * c.grad_scale;
  V p{};
  if constexpr (!kDelta) p = LoadParam<Ops, kP>(a, i, mask);
  V m = LoadState<Ops, kS>(a.exp_avg, i, mask);
  U random{};
  if constexpr (kS == 1 && kSr) random = Ops::Hash(static_cast<uint32_t>(i), a.state_key);
  V step;  // what is added to p * decay
  if constexpr (kOpt == OptimizerKind::kLion) {
    const V update = Lerp(m, g, c.lerp1, a.lerp1.from_end);  // c = lerp(m, g, 1-b1)
    if constexpr (!kDelta) p = p * c.decay;                  // p *= 1 - lr*wd
    step = c.neg_step_size * Ops::Sign(update);              // p.add_(sign(c), alpha=-lr)
    m = Lerp(m, g, c.lerp2, a.lerp2.from_end);               // m.lerp_(g, 1-b2)
    StoreState<Ops, kS, kSr>(a.exp_avg, m, random, i, mask);
  } else {
    if constexpr (kOpt == OptimizerKind::kAdam) g = g + c.decay * p;  // grad.add(p, alpha=wd)
    V v = LoadState<Ops, kS>(a.exp_avg_sq, i, mask);
    if constexpr (kOpt == OptimizerKind::kAdamW && !kDelta) p = p * c.decay;  // p.mul_(1-lr*wd)
    m = Lerp(m, g, c.lerp1, a.lerp1.from_end);                                // m.lerp_(g, 1-b1)
    v = v * c.beta2 + (c.one_minus_beta2 * g) * g;      // v.mul_(b2).addcmul_(g, g, value=1-b2)
    const V denom = Ops::Sqrt(v) / c.bc2_sqrt + c.eps;  // (v.sqrt() / bc2_sqrt).add_(eps)
    step = (c.neg_step_size * m) / denom;               // p.addcdiv_(m, denom, value=-step_size)
    StoreState<Ops, kS, kSr>(a.exp_avg, m, random, i, mask);
    StoreState<Ops, kS, kSr>(a.exp_avg_sq, v, Ops::High16(random), i, mask);
  }
  if constexpr (kDelta) {
    Ops::StoreF32(a.delta + i, step, mask);
  } else {
    StoreParam<Ops, kP>(a, p + step, i, mask);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace emsa
