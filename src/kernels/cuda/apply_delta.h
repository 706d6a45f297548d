// apply_delta.h — the device half of the host tier's delta uploads (HostTierOptions::
// device_delta): param[i] = param[i] * decay + delta[i] on the device, each operation rounded on
// its own, the bits the CPU update would have stored (TensorUpdate::delta).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "emsa/status.h"

namespace emsa {
namespace cuda {

// Enqueues the update of n fp32 parameters on `stream`. Any alignment; n >= 0.
Status LaunchApplyDelta(float* param, const float* delta, int64_t n, float decay,
                        cudaStream_t stream);

}  // namespace cuda
}  // namespace emsa
