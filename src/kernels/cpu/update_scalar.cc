// update_scalar.cc — the portable kernels: one element at a time, for CPUs without AVX2.
//
// Contraction into FMA is off in every kernel file (GCC contracts even intrinsics' mul+add by
// default): each float operation rounds on its own, so this file and the SIMD ones agree
// bitwise. It must come before any include so inline functions from headers get it too.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/scalar_ops.h"
#include "kernels/cpu/update_driver.h"

namespace emsa {
namespace cpu {

const KernelTable& ScalarKernels() {
  static const KernelTable table = MakeKernelTable<ScalarOps, ScalarOps>(SimdLevel::kScalar);
  return table;
}

}  // namespace cpu
}  // namespace emsa
