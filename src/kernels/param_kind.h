// param_kind.h — how a parameter is stored, the key both the CPU and the CUDA kernels dispatch
// on: its dtype, and whether an fp32 master copy is updated instead (the parameter then gets the
// master rounded to nearest). Plain C++, included by host code and by the .cu files.
#pragma once

#include <cstdint>

#include "emsa/types.h"
#include "emsa/update.h"

namespace emsa {

enum class ParamKind : int32_t { kF32 = 0, kBf16 = 1, kF16 = 2, kBf16Master = 3, kF16Master = 4 };
constexpr int kParamKinds = 5;

inline ParamKind ParamKindOf(const TensorUpdate& t) {
  const bool master = t.master != nullptr;
  switch (t.param_dtype) {
    case DType::kBFloat16:
      return master ? ParamKind::kBf16Master : ParamKind::kBf16;
    case DType::kFloat16:
      return master ? ParamKind::kF16Master : ParamKind::kF16;
    default:
      return ParamKind::kF32;
  }
}

}  // namespace emsa
