// emsa/types.h — the small vocabulary shared by every layer: dtypes, tiers, optimizers.
// Names follow PyTorch's (float32, bfloat16, float16; lr, betas, eps, weight_decay).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "emsa/status.h"

namespace emsa {

// Element types emsa stores or reads. Values equal the C ABI's EMSA_DTYPE_* constants.
enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

size_t DTypeSize(DType dtype);       // bytes per element
const char* DTypeName(DType dtype);  // "float32", "bfloat16", "float16"
// Accepts "float32"/"fp32"/"torch.float32", "bfloat16"/"bf16"/"torch.bfloat16",
// "float16"/"fp16"/"half"/"torch.float16". Anything else (float64, complex64, int8, ...) is
// kUnsupported with a message that lists what is supported.
Result<DType> ParseDType(std::string_view name);

// Where a parameter's optimizer state lives (DESIGN.md, "Plan").
enum class Tier : int32_t {
  kL0 = 0,  // device arena under an L2 persisting window (CUDA issue; off unless measured)
  kL1 = 1,  // device arena
  kL2 = 2,  // pinned host arena, updated by the CPU pool
};
const char* TierName(Tier tier);  // "L0", "L1", "L2"
Result<Tier> ParseTier(std::string_view name);

// Values equal the C ABI's EMSA_OPTIMIZER_* constants.
enum class OptimizerKind : int32_t { kAdamW = 0, kAdam = 1, kLion = 2 };
const char* OptimizerName(OptimizerKind kind);  // "adamw", "adam", "lion"
Result<OptimizerKind> ParseOptimizer(std::string_view name);
// How many moment buffers the optimizer keeps per parameter (Adam/AdamW 2, Lion 1).
int StateCount(OptimizerKind kind);

// Byte sizes written with units: "24GiB", "512 MiB", "1.5GiB", "1000000", "2KB" (SI: 1000).
// Negative, empty, non-finite or absurd (> 1 PiB) sizes are kInvalidArgument.
Result<uint64_t> ParseBytes(std::string_view text);
// 25769803776 -> "24.00 GiB"; small values in B/KiB/MiB.
std::string FormatBytes(uint64_t bytes);

}  // namespace emsa
