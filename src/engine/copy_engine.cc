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
  Status AllocatePinned(size_t bytes, void** out) override {
    const cudaError_t err = cudaHostAlloc(out, bytes, cudaHostAllocDefault);
    if (err == cudaSuccess) return Status::Ok();
    (void)cudaGetLastError();
    return Status::OutOfMemory(cudaGetErrorString(err));
  }
  void FreePinned(void* ptr) override { (void)cudaFreeHost(ptr); }
};

}  // namespace

CopyEngine* CudaCopyEngine() {
  static CudaEngine engine;
  return &engine;
}

}  // namespace emsa

#else  // !EMSA_HAVE_CUDA

namespace emsa {
namespace {

// Without CUDA every call is refused, so the host tier still checks its arguments first and then
// answers kUnsupported from its first CUDA call.
Status NoCuda() {
  return Status::Unsupported(
      "the host tier for CUDA parameters needs a CUDA build of emsa (nvcc was not found when it "
      "was built)");
}

class NoCudaEngine final : public CopyEngine {
 public:
  Status SetDevice(int) override { return NoCuda(); }
  Status CreateEvent(bool, bool, cudaEvent_t*) override { return NoCuda(); }
  void DestroyEvent(cudaEvent_t) override {}
  Status Record(cudaEvent_t, cudaStream_t) override { return NoCuda(); }
  Status StreamWait(cudaStream_t, cudaEvent_t) override { return NoCuda(); }
  Status Query(cudaEvent_t, const char*, bool*) override { return NoCuda(); }
  Status Synchronize(cudaEvent_t, const char*) override { return NoCuda(); }
  Status ElapsedSeconds(cudaEvent_t, cudaEvent_t, double*) override { return NoCuda(); }
  Status CopyToHost(void*, const void*, size_t, cudaStream_t) override { return NoCuda(); }
  Status CopyToDevice(void*, const void*, size_t, cudaStream_t) override { return NoCuda(); }
  Status ApplyDelta(float*, const float*, int64_t, float, cudaStream_t) override {
    return NoCuda();
  }
  Status AllocateDevice(size_t, void**) override { return NoCuda(); }
  void FreeDevice(void*) override {}
  Status AllocatePinned(size_t, void**) override { return NoCuda(); }
  void FreePinned(void*) override {}
};

}  // namespace

CopyEngine* CudaCopyEngine() {
  static NoCudaEngine engine;
  return &engine;
}

}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
