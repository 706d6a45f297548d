// simd.cc — which vector ISA this CPU and OS can run, from cpuid and xgetbv, capped by
// EMSA_MAX_SIMD (read through common/tuning.h). Checked at run time, never from the build
// machine's flags.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/tuning.h"
#include "emsa/profile.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace emsa {

const char* SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return "scalar";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
  }
  return "unknown";
}

Result<SimdLevel> ParseSimdLevel(const std::string& name) {
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (name == SimdLevelName(level)) return level;
  }
  return Status::InvalidArgument("unknown SIMD level \"" + name +
                                 "\": expected one of scalar, avx2, avx512");
}

namespace {

#if defined(__x86_64__) || defined(__i386__)

// xgetbv is emitted by hand so that this file needs no -mxsave; callers check OSXSAVE first,
// because the instruction faults when the OS has not enabled it.
uint64_t ReadXcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

bool Bit(uint32_t reg, int bit) { return (reg >> bit) & 1u; }

SimdLevel DetectHardwareSimdLevel() {
  uint32_t eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return SimdLevel::kScalar;
  const bool osxsave = Bit(ecx, 27), avx = Bit(ecx, 28), fma = Bit(ecx, 12), f16c = Bit(ecx, 29);
  if (!osxsave || !avx) return SimdLevel::kScalar;
  // The CPU may have the units while the OS does not save their registers on a context switch
  // (some hypervisors): XCR0 says what the OS actually enabled.
  const uint64_t xcr0 = ReadXcr0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;    // SSE (bit 1) and AVX (bit 2) state
  const bool os_zmm = (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM (bits 5-7)
  if (!os_ymm) return SimdLevel::kScalar;

  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return SimdLevel::kScalar;
  const bool avx2 = Bit(ebx, 5);
  const bool avx512 =
      Bit(ebx, 16) /*F*/ && Bit(ebx, 17) /*DQ*/ && Bit(ebx, 30) /*BW*/ && Bit(ebx, 31) /*VL*/;
  if (!(avx2 && fma && f16c)) return SimdLevel::kScalar;
  // Every AVX-512 kernel also uses AVX2/FMA/F16C instructions, so AVX-512 requires them too.
  if (avx512 && os_zmm) return SimdLevel::kAvx512;
  return SimdLevel::kAvx2;
}

#else

SimdLevel DetectHardwareSimdLevel() { return SimdLevel::kScalar; }

#endif

}  // namespace

SimdLevel DetectSimdLevel() {
  const SimdLevel hardware = DetectHardwareSimdLevel();
  const std::string cap_text = tuning::MaxSimd();
  if (cap_text.empty()) return hardware;
  Result<SimdLevel> cap = ParseSimdLevel(cap_text);
  if (!cap.ok()) {
    // No Status to return here; a typo must not silently keep a level the user meant to avoid,
    // so say so once and fall back to the safest level.
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      std::fprintf(stderr,
                   "emsa: EMSA_MAX_SIMD=\"%s\" is not one of scalar, avx2, avx512; using scalar\n",
                   cap_text.c_str());
    }
    return SimdLevel::kScalar;
  }
  return static_cast<int32_t>(*cap) < static_cast<int32_t>(hardware) ? *cap : hardware;
}

}  // namespace emsa
