// device_host.h — host-side helpers of the device tier's objects (device_update.cc,
// device_scalars.cc): owned device memory, bind-time uploads, the current-device and pinned-memory
// checks. Internal to src/kernels/cuda; CUDA builds only.
#pragma once

#if EMSA_HAVE_CUDA

#include <cstddef>

#include "common/cuda_util.h"
#include "emsa/status.h"

namespace emsa {
namespace device_host {

// kUnsupported naming `what`: no driver or no GPU visible.
Status NoDevice(const char* what);

// Device memory that frees itself. Errors of the free are ignored: nothing can act on them.
struct DeviceMemory {
  void* ptr = nullptr;
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    if (ptr != nullptr) (void)cudaFree(ptr);
  }
  void* release() {
    void* p = ptr;
    ptr = nullptr;
    return p;
  }
};

// cudaMalloc into *mem; kOutOfMemory with the size when the device has no room.
Status Allocate(DeviceMemory* mem, size_t bytes, const char* what);

// A bind-time upload. A synchronous cudaMemcpy from pageable memory may return before its DMA
// lands, and the caller's non-blocking streams are not ordered after the legacy stream: so copy
// on the legacy stream and wait for it (FinishUploads) before the object is handed out.
Status Upload(void* dst, const void* src, size_t bytes, const char* what);
Status FinishUploads(const char* what);

// kInvalidArgument unless the current device is `expected` (the object's).
Status CurrentDevice(int expected, const char* what);

// Pinned (page-locked or registered) host memory: what an asynchronous, capturable copy needs.
Status CheckPinned(const void* p, const char* what);

inline size_t RoundUp(size_t x, size_t to) { return (x + to - 1) / to * to; }

}  // namespace device_host
}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
