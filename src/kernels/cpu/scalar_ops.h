// scalar_ops.h — the one-lane Ops for update_math.h: the scalar kernel, and AVX2's tail.
//
// Unnamed namespace: each ISA translation unit must get its own copy (see numerics.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/numerics.h"

namespace emsa {
namespace cpu {
namespace {

struct ScalarOps {
  using V = float;
  using U = uint32_t;
  struct M {};
  struct Stats {
    double sum_sq = 0.0;
    int64_t nonfinite = 0;
  };
  static constexpr int kWidth = 1;
  static constexpr bool kMaskedTail = false;

  static M All() { return {}; }
  static V Set(float x) { return x; }

  static V LoadF32(const float* p, M) { return *p; }
  static V LoadBf16(const uint16_t* p, M) { return Bf16ToFloat(*p); }
  static V LoadF16(const uint16_t* p, M) { return HalfToFloat(*p); }
  static void StoreF32(float* p, V x, M) { *p = x; }
  static void StoreBf16(uint16_t* p, V x, M) { *p = Bf16Nearest(x); }
  static void StoreBf16Sr(uint16_t* p, V x, U r, M) { *p = Bf16Stochastic(x, r); }
  static void StoreF16(uint16_t* p, V x, M) { *p = FloatToHalf(x, HalfRounding::kNearestEven); }
  static void StoreF16Sr(uint16_t* p, V x, U r, M) { *p = HalfStochastic(x, r); }

  static U Hash(uint32_t index, uint32_t key) { return HashIndex(index, key); }
  static U High16(U r) { return r >> 16; }
  static V Sqrt(V x) { return std::sqrt(x); }
  // (x > 0) - (x < 0) as the SIMD files compute it: +0 for zero and NaN.
  static V Sign(V x) { return (x > 0.0f ? 1.0f : 0.0f) - (x < 0.0f ? 1.0f : 0.0f); }

  static void Accumulate(V x, Stats* s) {
    if (!(std::fabs(x) <= 3.4028234663852886e38f)) ++s->nonfinite;
    s->sum_sq += static_cast<double>(x) * static_cast<double>(x);
  }
  static void Reduce(const Stats& s, GradAccum* out) {
    out->sum_sq += s.sum_sq;
    out->nonfinite += s.nonfinite;
  }
};

}  // namespace
}  // namespace cpu
}  // namespace emsa
