// update_avx2.cc — the kernels for AVX2 + FMA + F16C CPUs: 8 lanes, scalar tail.
//
// Contraction into FMA is off (see update_scalar.cc): the lanes round exactly as the scalar
// kernel does. The F16C conversions are IEEE, as numerics.h's scalar ones.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <immintrin.h>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/scalar_ops.h"
#include "kernels/cpu/update_driver.h"

namespace emsa {
namespace cpu {
namespace {

struct Avx2Ops {
  using V = __m256;
  using U = __m256i;
  struct M {};
  struct Stats {
    __m256d lo, hi;
    int64_t nonfinite;
  };
  static constexpr int kWidth = 8;
  static constexpr bool kMaskedTail = false;

  static M All() { return {}; }
  static V Set(float x) { return _mm256_set1_ps(x); }
  static __m256i Bits(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }

  static V LoadF32(const float* p, M) { return _mm256_loadu_ps(p); }
  static V LoadBf16(const uint16_t* p, M) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
  static V LoadF16(const uint16_t* p, M) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreF32(float* p, V x, M) { _mm256_storeu_ps(p, x); }

  // Lanes hold values <= 0xFFFF, so unsigned saturation packs them unchanged.
  static void Store16(uint16_t* p, __m256i lanes) {
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static __m256i KeepNan(V x, __m256i rounded) {
    const __m256i quiet =
        _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16), Bits(0x40u));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, quiet, is_nan);
  }
  static void StoreBf16(uint16_t* p, V x, M) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), Bits(1u));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, Bits(0x7FFFu)), lsb);
    Store16(p, KeepNan(x, _mm256_srli_epi32(r, 16)));
  }
  static void StoreBf16Sr(uint16_t* p, V x, U random, M) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i r = _mm256_add_epi32(bits, _mm256_and_si256(random, Bits(0xFFFFu)));
    Store16(p, KeepNan(x, _mm256_srli_epi32(r, 16)));
  }
  static void StoreF16(uint16_t* p, V x, M) {
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  // numerics.h's HalfStochastic, lane by lane.
  static void StoreF16Sr(uint16_t* p, V x, U random, M) {
    const __m128i t16 = _mm256_cvtps_ph(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256i t = _mm256_cvtepu16_epi32(t16);
    const __m256i mag = _mm256_and_si256(t, Bits(0x7FFFu));
    const __m256 truncated = _mm256_cvtph_ps(_mm_and_si128(t16, _mm_set1_epi16(0x7FFF)));
    const __m256 abs_x =
        _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(x), Bits(0x7FFFFFFFu)));
    const __m256 diff = abs_x - truncated;
    const __m256i exp = _mm256_max_epi32(_mm256_srli_epi32(mag, 10), Bits(1u));
    const __m256 ulp =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(exp, Bits(102u)), 23));
    const __m256 fraction = _mm256_cvtepi32_ps(_mm256_srli_epi32(random, 8)) * Set(0x1p-24f);
    const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(fraction * ulp, diff, _CMP_LT_OQ));
    const __m256i finite = _mm256_cmpgt_epi32(Bits(0x7C00u), mag);
    const __m256i rounded = _mm256_sub_epi32(t, _mm256_and_si256(up, finite));  // +1 where up
    Store16(p, rounded);
  }

  static U Hash(uint32_t index, uint32_t key) {
    __m256i x = _mm256_add_epi32(Bits(index), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    x = _mm256_xor_si256(x, Bits(key));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, Bits(0x85EBCA6Bu));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
    x = _mm256_mullo_epi32(x, Bits(0xC2B2AE35u));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  static U High16(U r) { return _mm256_srli_epi32(r, 16); }
  static V Sqrt(V x) { return _mm256_sqrt_ps(x); }
  static V Sign(V x) {
    const V zero = _mm256_setzero_ps(), one = Set(1.0f);
    return _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), one) -
           _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), one);
  }

  static void Accumulate(V x, Stats* s) {
    const __m256i exp_mask = Bits(0x7F800000u);
    const __m256i exp = _mm256_and_si256(_mm256_castps_si256(x), exp_mask);
    const int bad = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(exp, exp_mask)));
    s->nonfinite += __builtin_popcount(static_cast<unsigned>(bad));
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    s->lo = _mm256_fmadd_pd(lo, lo, s->lo);
    s->hi = _mm256_fmadd_pd(hi, hi, s->hi);
  }
  static void Reduce(const Stats& s, GradAccum* out) {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(s.lo, s.hi));
    out->sum_sq += (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    out->nonfinite += s.nonfinite;
  }
};

}  // namespace

const KernelTable& Avx2Kernels() {
  static const KernelTable table = MakeKernelTable<Avx2Ops, ScalarOps>(SimdLevel::kAvx2);
  return table;
}

}  // namespace cpu
}  // namespace emsa
