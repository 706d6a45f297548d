// update_math.cuh — the per-element optimizer arithmetic of the device kernels.
//
// The bf16 conversions, the stochastic-rounding hash and its keys are the CPU kernels' own
// (kernels/rounding.h, included by both). The rest transcribes the CPU kernels' per-element
// arithmetic (update_args.cc, update_math.h), which is host-only code (GCC vector types). On the
// device every float operation is an explicit round-to-nearest intrinsic (__fmul_rn, __fadd_rn,
// ...): nvcc would otherwise contract a*b+c into one FMA, and the CPU kernels round each operation
// on its own. The per-step constants follow MakeUpdateArgs: double arithmetic (again without
// contraction), one rounding to float.
//
// Everything here is also host code (plain IEEE operations; the emsa build targets baseline
// x86-64, which has no FMA to contract into), so the unit test runs this very transcription on
// the CPU against CpuUpdater, bit for bit; on the GPU the same test compares the kernels. Known
// differences: NaN payloads (the hardware fp16 conversions), and, with probability about 2^-28
// per constant, a CUDA pow() that rounds differently from glibc's.
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "emsa/cuda_update.h"
#include "emsa/types.h"
#include "kernels/cuda/device_table.h"
#include "kernels/rounding.h"  // defines EMSA_HD

namespace emsa {
namespace cuda {

// ---- operations that round on their own --------------------------------------------------------

#if defined(__CUDA_ARCH__)
EMSA_HD float Add(float a, float b) { return __fadd_rn(a, b); }
EMSA_HD float Sub(float a, float b) { return __fsub_rn(a, b); }
EMSA_HD float Mul(float a, float b) { return __fmul_rn(a, b); }
EMSA_HD float Div(float a, float b) { return __fdiv_rn(a, b); }
EMSA_HD float Sqrt(float a) { return __fsqrt_rn(a); }
EMSA_HD double DSub(double a, double b) { return __dsub_rn(a, b); }
EMSA_HD double DMul(double a, double b) { return __dmul_rn(a, b); }
EMSA_HD double DDiv(double a, double b) { return __ddiv_rn(a, b); }
EMSA_HD double DSqrt(double a) { return __dsqrt_rn(a); }
EMSA_HD double DPow(double a, double b) { return pow(a, b); }
EMSA_HD float ToFloat(double a) { return __double2float_rn(a); }
EMSA_HD float Abs(float a) { return fabsf(a); }
#else
EMSA_HD float Add(float a, float b) { return a + b; }
EMSA_HD float Sub(float a, float b) { return a - b; }
EMSA_HD float Mul(float a, float b) { return a * b; }
EMSA_HD float Div(float a, float b) { return a / b; }
EMSA_HD float Sqrt(float a) { return std::sqrt(a); }
EMSA_HD double DSub(double a, double b) { return a - b; }
EMSA_HD double DMul(double a, double b) { return a * b; }
EMSA_HD double DDiv(double a, double b) { return a / b; }
EMSA_HD double DSqrt(double a) { return std::sqrt(a); }
EMSA_HD double DPow(double a, double b) { return std::pow(a, b); }
EMSA_HD float ToFloat(double a) { return static_cast<float>(a); }
EMSA_HD float Abs(float a) { return std::fabs(a); }
#endif

// ---- bf16, fp16 and the stochastic-rounding stream (kernels/rounding.h) ------------------------

using namespace rounding;  // one definition for the CPU and CUDA paths

// fp16 by the CUDA conversions, which are IEEE: exact from half, round-to-nearest-even and
// toward-zero to half, as rounding.h's reference functions (they differ only in NaN payloads).
EMSA_HD float HalfToFloat(uint32_t h) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}
EMSA_HD uint32_t HalfNearest(float f) { return __half_as_ushort(__float2half_rn(f)); }

struct HardwareHalfToFloat {
  EMSA_HD float operator()(uint32_t h) const { return HalfToFloat(h); }
};

// rounding.h's stochastic step over the CUDA truncation toward zero.
EMSA_HD uint32_t HalfStochastic(float f, uint32_t random) {
  return rounding::HalfStochasticFrom(f, __half_as_ushort(__float2half_rz(f)), random,
                                      HardwareHalfToFloat{});
}

// The rounding keys of the elements whose index within the tensor has high 32 bits `high`.
struct Keys {
  uint32_t state;
  uint32_t param;
};
EMSA_HD Keys MakeKeys(uint64_t seed, int64_t step, uint32_t high) {
  return {StreamKey(seed, step, kStateStream, high), StreamKey(seed, step, kParamStream, high)};
}

// ---- one group's constants for this step (update_args.cc's MakeUpdateArgs) ---------------------

struct Lerp {
  float coef;
  bool from_end;
};

struct StepConsts {
  float grad_scale;  // grad_multiplier, negated under maximize
  float decay;       // AdamW, Lion: 1 - lr*wd; Adam: wd
  Lerp lerp1;
  Lerp lerp2;  // Lion only
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;
  float eps;
  float neg_step_size;  // Adam(W): -lr / (1 - beta1^step); Lion: -lr
  int64_t step;
};

EMSA_HD Lerp MakeLerp(double beta) {
  const float w = ToFloat(DSub(1.0, beta));
  Lerp l;
  l.from_end = !(Abs(w) < 0.5f);
  l.coef = l.from_end ? -Sub(1.0f, w) : w;
  return l;
}

// `step_number` stands in for g.step: a tensor's own (slot) step; the arithmetic is the same.
template <OptimizerKind kOpt>
EMSA_HD StepConsts MakeStepConsts(const DeviceGroupScalars& g, int64_t step_number,
                                  float grad_multiplier) {
  const double lr = g.lr, wd = g.weight_decay, beta1 = g.beta1, beta2 = g.beta2;
  StepConsts c;
  c.step = step_number < 1 ? 1 : step_number;
  const double step = static_cast<double>(c.step);
  c.grad_scale = g.maximize ? -grad_multiplier : grad_multiplier;
  c.lerp1 = MakeLerp(g.beta1);
  c.lerp2 = c.lerp1;
  c.beta2 = 0.0f;
  c.one_minus_beta2 = 0.0f;
  c.bc2_sqrt = 1.0f;
  c.eps = 0.0f;
  const float decoupled = ToFloat(DSub(1.0, DMul(lr, wd)));
  if constexpr (kOpt == OptimizerKind::kLion) {
    c.decay = decoupled;
    c.lerp2 = MakeLerp(g.beta2);
    c.neg_step_size = ToFloat(-lr);
  } else {
    c.decay = kOpt == OptimizerKind::kAdam ? ToFloat(wd) : decoupled;
    c.beta2 = ToFloat(beta2);
    c.one_minus_beta2 = ToFloat(DSub(1.0, beta2));
    c.bc2_sqrt = ToFloat(DSqrt(DSub(1.0, DPow(beta2, step))));
    c.eps = ToFloat(g.eps);
    c.neg_step_size = ToFloat(-DDiv(lr, DSub(1.0, DPow(beta1, step))));
  }
  return c;
}

template <OptimizerKind kOpt>
EMSA_HD StepConsts MakeStepConsts(const DeviceGroupScalars& g, float grad_multiplier) {
  return MakeStepConsts<kOpt>(g, g.step, grad_multiplier);
}

// ---- one element (update_math.h's UpdateVector) ------------------------------------------------

EMSA_HD float LerpTo(float start, float end, const Lerp& l) {
  const float d = Sub(end, start);
  return Add(l.from_end ? end : start, Mul(d, l.coef));
}

// +1, 0 or -1; +0 for zero and NaN.
EMSA_HD float Sign(float x) { return Sub(x > 0.0f ? 1.0f : 0.0f, x < 0.0f ? 1.0f : 0.0f); }

// p, m, v in and out (v unused by Lion); g is the loaded gradient, before grad_scale.
template <OptimizerKind kOpt>
EMSA_HD void UpdateElement(const StepConsts& c, float& p, float g, float& m, float& v) {
  g = Mul(g, c.grad_scale);
  if constexpr (kOpt == OptimizerKind::kLion) {
    const float update = LerpTo(m, g, c.lerp1);
    p = Mul(p, c.decay);
    p = Add(p, Mul(c.neg_step_size, Sign(update)));
    m = LerpTo(m, g, c.lerp2);
  } else {
    if constexpr (kOpt == OptimizerKind::kAdam) g = Add(g, Mul(c.decay, p));
    if constexpr (kOpt == OptimizerKind::kAdamW) p = Mul(p, c.decay);
    m = LerpTo(m, g, c.lerp1);
    v = Add(Mul(v, c.beta2), Mul(Mul(c.one_minus_beta2, g), g));
    const float denom = Add(Div(Sqrt(v), c.bc2_sqrt), c.eps);
    p = Add(p, Div(Mul(c.neg_step_size, m), denom));
  }
}

// ---- rounding on store -------------------------------------------------------------------------

// The stored bits of a state value: fp32 as is, bf16 nearest or stochastic. `random` is the
// element's state hash: its low 16 bits round exp_avg, its high 16 exp_avg_sq (as the CPU).
template <bool kStateBf16>
EMSA_HD uint32_t StateBits(float x, bool stochastic, uint32_t random) {
  if constexpr (kStateBf16) {
    return stochastic ? Bf16Stochastic(x, random) : Bf16Nearest(x);
  } else {
    return FloatBits(x);
  }
}

// The stored bits of the parameter: fp32 as is; 16-bit without a master, stochastically; the
// 16-bit copy of a master, to nearest. `index` is the element's index within its tensor (low 32
// bits; the high ones are in the key).
template <ParamKind kP>
EMSA_HD uint32_t ParamBits(float p, uint32_t index, const Keys& keys) {
  if constexpr (kP == ParamKind::kF32) {
    return FloatBits(p);
  } else if constexpr (kP == ParamKind::kBf16) {
    return Bf16Stochastic(p, HashIndex(index, keys.param));
  } else if constexpr (kP == ParamKind::kF16) {
    return HalfStochastic(p, HashIndex(index, keys.param));
  } else if constexpr (kP == ParamKind::kBf16Master) {
    return Bf16Nearest(p);
  } else {
    static_assert(kP == ParamKind::kF16Master, "every ParamKind");
    return HalfNearest(p);
  }
}

// ---- one element, from loaded values to the bits to store --------------------------------------

struct Stored {
  uint32_t exp_avg;     // state bits (fp32, or bf16 in the low half)
  uint32_t exp_avg_sq;  // unused by Lion
  uint32_t param;       // parameter bits (fp32, or 16-bit in the low half)
  float master;         // the updated fp32 value: the master copy, when there is one
};

// The kernels' whole per-element step: the update, then the rounding of every stored value.
// `index` is the element's index within its tensor (low 32 bits; keys carry the high ones).
template <OptimizerKind kOpt, ParamKind kP, bool kStateBf16>
EMSA_HD Stored StepElement(const StepConsts& c, const Keys& keys, bool stochastic, uint32_t index,
                           float p, float g, float m, float v) {
  UpdateElement<kOpt>(c, p, g, m, v);
  const uint32_t random = kStateBf16 && stochastic ? HashIndex(index, keys.state) : 0u;
  Stored s;
  s.exp_avg = StateBits<kStateBf16>(m, stochastic, random);
  s.exp_avg_sq = StateBits<kStateBf16>(v, stochastic, random >> 16);
  s.param = ParamBits<kP>(p, index, keys);
  s.master = p;
  return s;
}

}  // namespace cuda
}  // namespace emsa
