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

using rounding::Bf16Nearest;
using rounding::Bf16Stochastic;
using rounding::Bf16ToFloat;
using rounding::BitsFloat;
using rounding::FloatBits;
using rounding::FloatToHalf;
using rounding::HalfRounding;
using rounding::HalfStochastic;
using rounding::HalfToFloat;
using rounding::HashIndex;
using rounding::IsNanBits;
using rounding::kParamStream;
using rounding::kStateStream;
using rounding::Mix64;
using rounding::StreamKey;

}  // namespace
}  // namespace cpu
}  // namespace emsa
