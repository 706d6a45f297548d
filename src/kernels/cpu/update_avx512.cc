// update_avx512.cc — the kernels for AVX-512 (F, BW, VL, DQ) CPUs: 16 lanes, masked tail.
//
// Contraction into FMA is off (see update_scalar.cc): the lanes round exactly as the scalar
// kernel does. Masked loads give zeros in unused lanes; the arithmetic on them is harmless and
// masked stores never write them, so a tensor may end (and start) anywhere.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_*()
// (GCC bug 105593, fixed in 12.3); the warning is located in the header, so silence it there.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/update_driver.h"

namespace emsa {
namespace cpu {
namespace {

struct Avx512Ops {
  using V = __m512;
  using U = __m512i;
  using M = __mmask16;
  struct Stats {
    __m512d lo, hi;
    int64_t nonfinite;
  };
  static constexpr int kWidth = 16;
  static constexpr bool kMaskedTail = true;

  struct Full {};  // every lane: plain loads and stores (masked stores cost more on some CPUs)
  static Full All() { return {}; }
  static M FirstN(int64_t n) { return static_cast<M>((1u << n) - 1u); }  // 0 < n < 16
  static V Set(float x) { return _mm512_set1_ps(x); }
  static __m512i Bits(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }

  static V LoadF32(const float* p, Full) { return _mm512_loadu_ps(p); }
  static V LoadF32(const float* p, M m) { return _mm512_maskz_loadu_ps(m, p); }
  static __m256i Load16(const uint16_t* p, Full) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static __m256i Load16(const uint16_t* p, M m) { return _mm256_maskz_loadu_epi16(m, p); }
  template <class Mask>
  static V LoadBf16(const uint16_t* p, Mask m) {
    const __m512i h = _mm512_cvtepu16_epi32(Load16(p, m));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
  template <class Mask>
  static V LoadF16(const uint16_t* p, Mask m) {
    return _mm512_cvtph_ps(Load16(p, m));
  }
  static void StoreF32(float* p, V x, Full) { _mm512_storeu_ps(p, x); }
  static void StoreF32(float* p, V x, M m) { _mm512_mask_storeu_ps(p, m, x); }
  static void Store16(uint16_t* p, __m256i h, Full) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static void Store16(uint16_t* p, __m256i h, M m) { _mm256_mask_storeu_epi16(p, m, h); }

  static __m512i KeepNan(V x, __m512i rounded) {
    const __m512i quiet =
        _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16), Bits(0x40u));
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), quiet);
  }
  template <class Mask>
  static void StoreBf16(uint16_t* p, V x, Mask m) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), Bits(1u));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, Bits(0x7FFFu)), lsb);
    Store16(p, _mm512_cvtepi32_epi16(KeepNan(x, _mm512_srli_epi32(r, 16))), m);
  }
  template <class Mask>
  static void StoreBf16Sr(uint16_t* p, V x, U random, Mask m) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i r = _mm512_add_epi32(bits, _mm512_and_si512(random, Bits(0xFFFFu)));
    Store16(p, _mm512_cvtepi32_epi16(KeepNan(x, _mm512_srli_epi32(r, 16))), m);
  }
  template <class Mask>
  static void StoreF16(uint16_t* p, V x, Mask m) {
    Store16(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), m);
  }
  // numerics.h's HalfStochastic, lane by lane.
  template <class Mask>
  static void StoreF16Sr(uint16_t* p, V x, U random, Mask m) {
    const __m256i t16 = _mm512_cvtps_ph(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m512i t = _mm512_cvtepu16_epi32(t16);
    const __m512i mag = _mm512_and_si512(t, Bits(0x7FFFu));
    const __m512 truncated = _mm512_cvtph_ps(_mm256_and_si256(t16, _mm256_set1_epi16(0x7FFF)));
    const __m512 abs_x =
        _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), Bits(0x7FFFFFFFu)));
    const __m512 diff = abs_x - truncated;
    const __m512i exp = _mm512_max_epi32(_mm512_srli_epi32(mag, 10), Bits(1u));
    const __m512 ulp =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(exp, Bits(102u)), 23));
    const __m512 fraction = _mm512_cvtepi32_ps(_mm512_srli_epi32(random, 8)) * Set(0x1p-24f);
    const M up = _mm512_cmp_ps_mask(fraction * ulp, diff, _CMP_LT_OQ) &
                 _mm512_cmplt_epi32_mask(mag, Bits(0x7C00u));
    Store16(p, _mm512_cvtepi32_epi16(_mm512_mask_add_epi32(t, up, t, Bits(1u))), m);
  }

  static U Hash(uint32_t index, uint32_t key) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i x = _mm512_add_epi32(Bits(index), lanes);
    x = _mm512_xor_si512(x, Bits(key));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, Bits(0x85EBCA6Bu));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
    x = _mm512_mullo_epi32(x, Bits(0xC2B2AE35u));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  static U High16(U r) { return _mm512_srli_epi32(r, 16); }
  // maskz form: GCC 12 warns on _mm512_sqrt_ps's undefined pass-through operand.
  static V Sqrt(V x) { return _mm512_maskz_sqrt_ps(static_cast<M>(0xFFFF), x); }
  static V Sign(V x) {
    const V zero = _mm512_setzero_ps(), one = Set(1.0f);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), one) -
           _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), one);
  }

  static void Accumulate(V x, Stats* s) {
    const __m512i exp_mask = Bits(0x7F800000u);
    const __m512i exp = _mm512_and_si512(_mm512_castps_si512(x), exp_mask);
    s->nonfinite += __builtin_popcount(_mm512_cmpeq_epi32_mask(exp, exp_mask));
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    s->lo = _mm512_fmadd_pd(lo, lo, s->lo);
    s->hi = _mm512_fmadd_pd(hi, hi, s->hi);
  }
  static void Reduce(const Stats& s, GradAccum* out) {
    out->sum_sq += _mm512_reduce_add_pd(_mm512_add_pd(s.lo, s.hi));
    out->nonfinite += s.nonfinite;
  }
};

}  // namespace

const KernelTable& Avx512Kernels() {
  static const KernelTable table = MakeKernelTable<Avx512Ops, Avx512Ops>(SimdLevel::kAvx512);
  return table;
}

}  // namespace cpu
}  // namespace emsa
