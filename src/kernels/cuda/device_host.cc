// device_host.cc — host-side helpers of the device tier's objects (device_host.h).
#if EMSA_HAVE_CUDA

#include "kernels/cuda/device_host.h"

#include <string>

namespace emsa {
namespace device_host {
namespace {

// Lets this thread make a pure query while a stream capture may be active: in global or
// thread-local capture mode the runtime may refuse calls it counts as unsafe (and invalidate
// the capture). The pointer query below changes nothing, so relaxing the thread's mode for it
// is sound; the previous mode is restored.
class RelaxedCaptureScope {
 public:
  RelaxedCaptureScope() { ok_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess; }
  ~RelaxedCaptureScope() {
    if (ok_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = false;
};

}  // namespace

Status NoDevice(const char* what) {
  return Status::Unsupported(std::string(what) +
                             ": no usable CUDA device (no driver, or no GPU visible to this "
                             "process); the device tier needs one, the host tier does not");
}

Status Allocate(DeviceMemory* mem, size_t bytes, const char* what) {
  const cudaError_t err = cudaMalloc(&mem->ptr, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return Status::OutOfMemory(std::string(what) + ": cudaMalloc of " + std::to_string(bytes) +
                               " bytes failed; free device memory first");
  }
  return CudaStatus(err, what);
}

Status Upload(void* dst, const void* src, size_t bytes, const char* what) {
  if (bytes == 0) return Status::Ok();
  return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cudaStreamLegacy),
                    what);
}
Status FinishUploads(const char* what) {
  return CudaStatus(cudaStreamSynchronize(cudaStreamLegacy), what);
}

Status CurrentDevice(int expected, const char* what) {
  int current = -1;
  EMSA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  if (current != expected) {
    return Status::InvalidArgument(std::string(what) + ": the current device is " +
                                   std::to_string(current) + " but the object lives on device " +
                                   std::to_string(expected) + "; call cudaSetDevice(" +
                                   std::to_string(expected) + ") first");
  }
  return Status::Ok();
}

Status CheckPinned(const void* p, const char* what) {
  if (p == nullptr) return Status::InvalidArgument(std::string(what) + ": source is null");
  cudaPointerAttributes attr{};
  cudaError_t err;
  {
    RelaxedCaptureScope relaxed;
    err = cudaPointerGetAttributes(&attr, p);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return CudaStatus(err, what);
  }
  if (attr.type != cudaMemoryTypeHost) {
    return Status::InvalidArgument(std::string(what) +
                                   ": the source is not pinned host memory; allocate it with "
                                   "cudaHostAlloc or register it with cudaHostRegister");
  }
  return Status::Ok();
}

}  // namespace device_host
}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
