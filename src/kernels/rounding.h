// rounding.h — the bf16/fp16 conversions and the stochastic-rounding hash, defined once for the
// CPU kernels (kernels/cpu/numerics.h) and the CUDA kernels (kernels/cuda/update_math.cuh).
//
// Both paths must store the same bits for the same element, so both include these very
// functions: plain integer and float operations, each exact or rounded on its own, valid as
// host code and as device code (EMSA_HD). The fp16 conversions here are the reference: IEEE
// binary16 as F16C's vcvtph2ps / vcvtps2ph convert, NaN quieting included. The CPU kernels use
// them (the SIMD files reproduce them with F16C); the CUDA kernels convert with the hardware's
// IEEE instructions, which give the same bits except NaN payloads, and share the stochastic
// step through HalfStochasticWith.
//
// Everything is in an unnamed namespace on purpose: each CPU ISA's translation unit gets its
// own copy, compiled with its own flags, so the linker can never hand the scalar path a copy
// built for AVX-512.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace emsa {
namespace rounding {
namespace {

// Float operations that round on their own: on the device explicit round-to-nearest
// intrinsics, which the compiler never contracts into an FMA (the CPU kernels build without
// contraction).
#if defined(__CUDA_ARCH__)
EMSA_HD uint32_t FloatBits(float f) { return __float_as_uint(f); }
EMSA_HD float BitsFloat(uint32_t u) { return __uint_as_float(u); }
EMSA_HD float SubRn(float a, float b) { return __fsub_rn(a, b); }
EMSA_HD float MulRn(float a, float b) { return __fmul_rn(a, b); }
#else
EMSA_HD float SubRn(float a, float b) { return a - b; }
EMSA_HD float MulRn(float a, float b) { return a * b; }
EMSA_HD uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
EMSA_HD float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
#endif

EMSA_HD bool IsNanBits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

// ---- bf16: the top half of a float -------------------------------------------------------------
// 16-bit values travel in the low half of a uint32_t: the device kernels pack two per word.

// Reads the low 16 bits of `h`.
EMSA_HD float Bf16ToFloat(uint32_t h) { return BitsFloat(h << 16); }

EMSA_HD uint32_t Bf16Nearest(float f) {
  const uint32_t u = FloatBits(f);
  if (IsNanBits(u)) return (u >> 16) | 0x40u;  // stay NaN, quiet
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// Adds 16 random bits below the kept ones and truncates: rounds up with probability equal to the
// dropped fraction, so the expected result is f. Uses the low 16 bits of `random`.
EMSA_HD uint32_t Bf16Stochastic(float f, uint32_t random) {
  const uint32_t u = FloatBits(f);
  if (IsNanBits(u)) return (u >> 16) | 0x40u;
  return (u + (random & 0xFFFFu)) >> 16;
}

// ---- fp16: IEEE binary16, converted as F16C's vcvtph2ps / vcvtps2ph do --------------------------

EMSA_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return BitsFloat(sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0));
  if (exp != 0) return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  // Zero or subnormal: mant * 2^-24, exact in float.
  const float magnitude = static_cast<float>(mant) * BitsFloat(0x33800000u);  // 2^-24
  return BitsFloat(sign | FloatBits(magnitude));
}

enum class HalfRounding { kNearestEven, kTowardZero };

EMSA_HD uint16_t FloatToHalf(float f, HalfRounding mode) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | ((a >> 13) & 0x3FFu);  // NaN: quiet, payload top
  if (a == 0x7F800000u) return sign | 0x7C00u;
  const uint32_t e = a >> 23;  // biased by 127; half's bias is 15
  if (e >= 143) return sign | (mode == HalfRounding::kNearestEven ? 0x7C00u : 0x7BFFu);
  // Keep 11 significant bits for normal results, fewer for subnormal ones. The base already
  // counts the implicit bit of q (0x400) as one exponent step, so a rounding carry out of q
  // moves the exponent up correctly, into infinity at the top.
  const uint32_t m = e ? ((a & 0x7FFFFFu) | 0x800000u) : (a & 0x7FFFFFu);
  const uint32_t shift = e >= 113 ? 13u : 13u + (113u - e);
  const uint32_t base = e >= 113 ? (e - 113u) << 10 : 0u;
  if (shift > 24) return sign;  // below 2^-25: rounds to zero either way
  uint32_t q = m >> shift;
  if (mode == HalfRounding::kNearestEven) {
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
  }
  return static_cast<uint16_t>(sign | (base + q));
}

// Stochastic rounding to fp16, given the truncation toward zero `t` of f and the conversion
// half_to_float(bits) -> float (each path converts by its own IEEE-exact means): steps one fp16
// ulp away from zero with probability (|f| - |t|) / ulp, drawn from the top 24 bits of
// `random`. Every quantity is exact in float (the difference is within one ulp of a value it
// shares a binade with; ulp and the random fraction are powers of two times small integers), so
// every path gets the same bits. Past 65504 the next step is infinity, as round-to-nearest
// would give beyond 65520.
template <class HalfToFloatFn>
EMSA_HD uint32_t HalfStochasticFrom(float f, uint32_t t, uint32_t random,
                                    HalfToFloatFn half_to_float) {
  if ((t & 0x7FFFu) >= 0x7C00u) return t;  // inf or NaN
  const float diff = SubRn(BitsFloat(FloatBits(f) & 0x7FFFFFFFu), half_to_float(t & 0x7FFFu));
  uint32_t exp = (t >> 10) & 0x1Fu;
  if (exp == 0) exp = 1;
  const float ulp = BitsFloat((exp + 102u) << 23);  // 2^(exp - 25)
  const float fraction = MulRn(static_cast<float>(random >> 8), BitsFloat(0x33800000u));  // [0, 1)
  return MulRn(fraction, ulp) < diff ? t + 1u : t;
}

struct ReferenceHalfToFloat {
  EMSA_HD float operator()(uint32_t h) const { return HalfToFloat(static_cast<uint16_t>(h)); }
};

// The reference: truncation and conversion by the functions above.
EMSA_HD uint16_t HalfStochastic(float f, uint32_t random) {
  return static_cast<uint16_t>(HalfStochasticFrom(f, FloatToHalf(f, HalfRounding::kTowardZero),
                                                  random, ReferenceHalfToFloat{}));
}

// ---- the stochastic-rounding stream -------------------------------------------------------------

// A counter-based hash: the same (key, index) gives the same bits on every ISA, thread and
// device. murmur3's 32-bit finalizer, a bijection with full avalanche, over index ^ key: two
// multiplies, which is what stochastic rounding can afford per element (the keys carry the seed
// and step).
EMSA_HD uint32_t HashIndex(uint32_t index, uint32_t key) {
  uint32_t x = index ^ key;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

EMSA_HD uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The streams a step draws from: one for the states, one for the parameter.
constexpr uint32_t kStateStream = 1;
constexpr uint32_t kParamStream = 2;

// The key of one stream for indices whose high 32 bits are index_high.
EMSA_HD uint32_t StreamKey(uint64_t seed, int64_t step, uint32_t stream, uint32_t index_high) {
  uint64_t z = Mix64(seed + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(step) + 1));
  z = Mix64(z ^ (static_cast<uint64_t>(stream) << 32 | index_high));
  return static_cast<uint32_t>(z >> 32) ^ static_cast<uint32_t>(z);
}

}  // namespace
}  // namespace rounding
}  // namespace emsa
