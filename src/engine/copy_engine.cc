// copy_engine.cc — CUDA's copy engine (engine/copy_engine.h): each call the CUDA runtime call it
// names, its error turned into a Status.
#include "engine/copy_engine.h"

#include "common/cuda_util.h"

#if EMSA_HAVE_CUDA

#include <string>

#include "kernels/cuda/apply_delta.h"

namespace emsa {

namespace {

class CudaEngine final : public CopyEngine {
 public:
  Status SetDevice(int device) override {
    return CudaStatus(cudaSetDevice(device), "cudaSetDevice (host tier)");
  }
  Status CreateEvent(bool timed, bool blocking, cudaEvent_t* out) override {
    const unsigned flags = (timed ? cudaEventDefault : cudaEventDisableTiming) |
                           (blocking ? cudaEventBlockingSync : cudaEventDefault);
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(out, flags));
    return Status::Ok();
  }
  void DestroyEvent(cudaEvent_t event) override { (void)cudaEventDestroy(event); }
  Status Record(cudaEvent_t event, cudaStream_t stream) override {
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(event, stream));
    return Status::Ok();
  }
  Status StreamWait(cudaStream_t stream, cudaEvent_t event) override {
    EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, event, 0));
    return Status::Ok();
  }
  Status Query(cudaEvent_t event, const char* what, bool* done) override {
    const cudaError_t q = cudaEventQuery(event);
    *done = q == cudaSuccess;
    return q == cudaErrorNotReady ? Status::Ok() : CudaStatus(q, what);
  }
  Status Synchronize(cudaEvent_t event, const char* what) override {
    return CudaStatus(cudaEventSynchronize(event), what);
  }
  Status ElapsedSeconds(cudaEvent_t start, cudaEvent_t end, double* out) override {
    float ms = 0.0f;
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, end));
    *out = ms * 1e-3;
    return Status::Ok();
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes, cudaStream_t stream) override {
    EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
    return Status::Ok();
  }
  Status CopyToDevice(void* dst, const void* src, size_t bytes, cudaStream_t stream) override {
    EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
    return Status::Ok();
  }
  Status ApplyDelta(float* param, const float* delta, int64_t n, float decay,
                    cudaStream_t stream) override {
    return cuda::LaunchApplyDelta(param, delta, n, decay, stream);
  }
  Status AllocateDevice(size_t bytes, void** out) override {
    const cudaError_t err = cudaMalloc(out, bytes);
    if (err == cudaSuccess) return Status::Ok();
    (void)cudaGetLastError();
    return Status::OutOfMemory(cudaGetErrorString(err));
  }
  void FreeDevice(void* ptr) override { (void)cudaFree(ptr); }
};

}  // namespace

CopyEngine* CudaCopyEngine() {
  static CudaEngine engine;
  return &engine;
}

}  // namespace emsa

#else  // !EMSA_HAVE_CUDA

namespace emsa {

CopyEngine* CudaCopyEngine() { return nullptr; }

}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
