// device_table.h — the device-memory layout of a DeviceUpdateTable and the launchers' interface.
//
// Shared by the host side (device_update.cc, plain C++) and the kernels (*.cu). A table is two
// arrays in device memory: one DeviceTensor per tensor and one DeviceChunk per kChunkElems
// elements of a tensor. Chunks are sorted by kernel variant, so each variant's launch walks one
// contiguous range of them.
#pragma once

#include <cstdint>

#include "emsa/cuda_update.h"
#include "emsa/status.h"
#include "emsa/types.h"
#include "kernels/param_kind.h"

namespace emsa {
namespace cuda {

// Elements per chunk: the unit of work a block takes. A power of two, so that a chunk never
// straddles a multiple of 2^32 (the rounding keys change there; one key pair per chunk) and
// every chunk of a 16-byte aligned tensor starts 16-byte aligned for every dtype.
// A build may override it for the tuning sweep (scripts/gpu-check sweep).
#ifndef EMSA_CUDA_CHUNK_ELEMS
#define EMSA_CUDA_CHUNK_ELEMS 32768
#endif
constexpr int64_t kChunkElems = EMSA_CUDA_CHUNK_ELEMS;
static_assert((kChunkElems & (kChunkElems - 1)) == 0, "kChunkElems is a power of two");
static_assert((int64_t{1} << 32) % kChunkElems == 0, "chunks must not straddle 2^32 boundaries");

using emsa::kParamKinds;
using emsa::ParamKind;  // kernels/param_kind.h: the CPU kernels dispatch on the same key

// Everything an update kernel is compiled for besides the optimizer.
struct Variant {
  ParamKind param = ParamKind::kF32;
  bool grad_f32 = true;     // else the grad has the param's 16-bit dtype
  bool state_bf16 = false;  // else float32 state
};
constexpr int kVariants = kParamKinds * 4;
constexpr int VariantIndex(Variant v) {
  return static_cast<int>(v.param) * 4 + (v.grad_f32 ? 2 : 0) + (v.state_bf16 ? 1 : 0);
}

// DeviceTensor::flags
constexpr uint32_t kTensorVector = 1u;      // every stream 16-byte aligned: vector path
constexpr uint32_t kTensorGradVector = 2u;  // the grad 16-byte aligned (grad statistics)
constexpr uint32_t kTensorAbsent = 4u;      // no gradient this step: updates and stats skip it

#if defined(__CUDACC__)
#define EMSA_TABLE_HD __host__ __device__ inline
#else
#define EMSA_TABLE_HD inline
#endif

EMSA_TABLE_HD bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// A tensor's flags from its streams (null counts as aligned: an absent stream). One definition
// for Create (host) and SetGradPointers (device), so a new gradient gets the flags Create would
// have given it.
EMSA_TABLE_HD uint16_t TensorFlags(const void* param, const void* grad, const void* exp_avg,
                                   const void* exp_avg_sq, const void* master) {
  const bool vector = Aligned16(param) && Aligned16(grad) && Aligned16(exp_avg) &&
                      Aligned16(exp_avg_sq) && Aligned16(master);
  return static_cast<uint16_t>((vector ? kTensorVector : 0u) |
                               (Aligned16(grad) ? kTensorGradVector : 0u));
}

// The flags with absence: a null gradient of a tensor that has elements (numel 0 has nothing to
// read and is never absent).
EMSA_TABLE_HD uint16_t TensorFlags(const void* param, const void* grad, const void* exp_avg,
                                   const void* exp_avg_sq, const void* master, int64_t numel) {
  const bool absent = grad == nullptr && numel > 0;
  return static_cast<uint16_t>(TensorFlags(param, grad, exp_avg, exp_avg_sq, master) |
                               (absent ? kTensorAbsent : 0u));
}

struct alignas(16) DeviceTensor {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;  // null for Lion
  float* master;     // null without a master copy
  int64_t numel;
  int32_t group;        // index into DeviceScalars' groups
  uint16_t flags;       // kTensor*
  uint16_t grad_dtype;  // DType, for the grad statistics kernel
  int32_t slot;         // index into DeviceScalars' slot steps (tables with slots), else 0
  int32_t reserved;     // pads to 64 bytes: four 16-byte loads
};
static_assert(sizeof(DeviceTensor) == 64, "DeviceTensor is a device-memory layout");

struct DeviceChunk {
  int64_t
      begin;  // first element, within the tensor; the chunk ends at min(begin + kChunkElems, numel)
  int32_t tensor;  // index into the table's DeviceTensor array
  int32_t reserved;
};
static_assert(sizeof(DeviceChunk) == 16, "DeviceChunk is a device-memory layout");

// Per-block partial of the gradient statistics, and the table's reduced result.
struct GradPartial {
  double sum_sq;
  long long nonfinite;
  long long first_bad;  // smallest tensor index with a non-finite element, or INT64_MAX
  long long reserved;
};
struct GradTableStats {
  double sum_sq;
  long long nonfinite;
  long long first_bad;  // -1 when none
  unsigned int ticket;  // blocks done; the last block resets it to 0
  unsigned int reserved;
};

// ---- launchers (defined in the .cu files; each checks its launch) ------------------------------

struct UpdateLaunch {
  const DeviceChunk* chunks;  // this variant's first chunk
  int64_t chunk_count;
  const DeviceTensor* tensors;
  const DeviceStepHeader* header;
  const DeviceGroupScalars* groups;
  const int64_t* slot_steps;  // tables with slots: each tensor's step; null: its group's step
  int32_t stochastic_state;   // bf16 state stores round stochastically
  int32_t bulk;               // the bulk-copy kernel (BulkUpdateKernel), not the per-thread one
  int grid;
};

// The variant the bulk-copy kernel serves: fp32 param, grad and state.
constexpr bool BulkVariant(Variant v) {
  return v.param == ParamKind::kF32 && v.grad_f32 && !v.state_bf16;
}
// Whether the current device runs `optimizer`'s bulk-copy kernel: compute capability 9.0 or
// later and the kernel compiled for it (not JIT-compiled from older PTX, where it is empty).
// Sets the kernel's dynamic shared memory limit on the way (once per device is enough).
Result<bool> BulkAvailable(OptimizerKind optimizer);
// Blocks of the update kernel for (optimizer, variant) that fit on one SM at once (bulk: the
// bulk-copy kernel with its shared memory).
Result<int> UpdateBlocksPerSm(OptimizerKind optimizer, Variant variant, bool bulk);
// window: null or bytes 0 for a plain launch; else launched with that access-policy window.
Status LaunchUpdate(OptimizerKind optimizer, Variant variant, const UpdateLaunch& launch,
                    cudaStream_t stream, const DeviceAccessWindow* window = nullptr);

struct GradStatsLaunch {
  const DeviceChunk* chunks;  // every chunk of the table
  int64_t chunk_count;
  const DeviceTensor* tensors;
  GradPartial* partials;  // grid of them
  GradTableStats* table_stats;
  DeviceStepHeader* header;
  int grid;
};
Result<int> GradStatsBlocksPerSm();
Status LaunchGradStats(const GradStatsLaunch& launch, cudaStream_t stream);

// Writes grads[i] into tensors[i].grad and re-derives tensors[i].flags (TensorFlags), i < count.
Status LaunchSetGrads(DeviceTensor* tensors, const void* const* grads, int64_t count,
                      cudaStream_t stream);

// The small kernels behind DeviceScalars.
Status LaunchSetGroupHyper(DeviceGroupScalars* groups, int64_t index,
                           const DeviceGroupScalars& value, cudaStream_t stream);
Status LaunchSetGroup(DeviceGroupScalars* groups, int64_t index, const DeviceGroupScalars& value,
                      cudaStream_t stream);
Status LaunchSetInputs(DeviceStepHeader* header, float grad_unscale, float max_norm, uint64_t seed,
                       cudaStream_t stream);
Status LaunchBeginStep(DeviceStepHeader* header, cudaStream_t stream);
Status LaunchFinishGradStats(DeviceStepHeader* header, cudaStream_t stream);
Status LaunchAdvanceSteps(const DeviceStepHeader* header, DeviceGroupScalars* groups,
                          int64_t group_count, cudaStream_t stream);
// Unless found_inf: ++slot_steps[tensors[i].slot] for every tensor i < count not absent.
Status LaunchAdvanceSlots(const DeviceStepHeader* header, const DeviceTensor* tensors,
                          int64_t count, int64_t* slot_steps, cudaStream_t stream);
Status LaunchSetUnscaleFrom(DeviceStepHeader* header, const float* scale, cudaStream_t stream);
Status LaunchWriteFoundInf(const DeviceStepHeader* header, float* dst, cudaStream_t stream);

}  // namespace cuda
}  // namespace emsa
