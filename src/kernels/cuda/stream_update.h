// stream_update.h — the device half of the host tier's device-updated buckets
// (HostTierTensor::device_update): one run of an fp32 tensor updated on the device, its moments
// brought from the host arena into device staging and sent back afterwards by the caller. The
// arithmetic is update_math.cuh's, the constants made on the host as the CPU kernels make them:
// the bits the CPU update would store.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "emsa/cuda_update.h"
#include "emsa/status.h"
#include "emsa/types.h"

namespace emsa {
namespace cuda {

struct StreamRun {
  float* param = nullptr;       // device, fp32, updated in place
  const float* grad = nullptr;  // device, fp32
  void* exp_avg = nullptr;      // device staging, state dtype
  void* exp_avg_sq = nullptr;   // device staging; null for Lion
  int64_t first = 0;            // index of param[0] within its tensor (stochastic rounding)
  int64_t count = 0;            // elements; [first, first + count) within one 2^32 block
  // A gated step's verdict in device memory (null: ungated, the launch's grad_multiplier
  // applies): found_inf != 0 writes nothing; else the gradients are multiplied by its
  // grad_multiplier (the launch's is then 1).
  const DeviceStepHeader* header = nullptr;
};

// Enqueues the update of one run on `stream`. state_dtype fp32 or bf16 (stochastic: bf16 moments
// round stochastically, keyed by seed, step and element index, as the CPU's).
Status LaunchStreamUpdate(OptimizerKind optimizer, DType state_dtype, bool stochastic,
                          uint64_t seed, const DeviceGroupScalars& group, float grad_multiplier,
                          const StreamRun& run, cudaStream_t stream);

}  // namespace cuda
}  // namespace emsa
