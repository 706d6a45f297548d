// cuda_util.h — turning CUDA runtime errors into emsa::Status, for .cc and .cu files.
//
// Only meaningful when EMSA_HAVE_CUDA; without it the header is empty so that callers can include
// it unconditionally and guard their own CUDA code.
#pragma once

#if EMSA_HAVE_CUDA

#include <cuda_runtime.h>

#include <string>

#include "emsa/status.h"

namespace emsa {

// OK for cudaSuccess; otherwise kCudaError "what: cudaErrorX (description)". Allocation
// failures stay kCudaError here: callers that allocate map them to kOutOfMemory with the size.
inline Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::CudaError(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                           cudaGetErrorString(err) + ")");
}

// True when this process can use at least one CUDA device. A missing driver or no device is
// "no" rather than an error; the sticky error the runtime records for it is cleared, so later
// cudaGetLastError() calls do not report it.
inline bool CudaDeviceUsable() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

}  // namespace emsa

// EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(...)); the call's text becomes the message prefix.
#define EMSA_CUDA_RETURN_IF_ERROR(call) EMSA_RETURN_IF_ERROR(::emsa::CudaStatus((call), #call))

#endif  // EMSA_HAVE_CUDA
