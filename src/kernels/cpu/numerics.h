// numerics.h — the CPU kernels' names for the scalar bf16/fp16 conversions and the
// stochastic-rounding hash, defined once for the CPU and CUDA paths in kernels/rounding.h.
//
// These are the reference definitions: the SIMD files produce the same bits (bf16 with integer
// tricks, fp16 with F16C, whose IEEE conversions these functions reproduce, NaN quieting
// included). rounding.h keeps everything in an unnamed namespace, so each ISA's translation unit
// gets its own copy, compiled with its own flags.
#pragma once

#include <cstdint>

#include "kernels/rounding.h"

namespace emsa {
namespace cpu {
namespace {

using namespace rounding;  // one definition for the CPU and CUDA paths

}  // namespace
}  // namespace cpu
}  // namespace emsa
