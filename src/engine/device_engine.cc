// device_engine.cc — DeviceEngine: per-bucket updates on a side stream (emsa/device_engine.h).
#include "emsa/device_engine.h"

#include <string>
#include <utility>
#include <vector>

#include "common/cuda_util.h"
#include "emsa/cuda_update.h"

#if EMSA_HAVE_CUDA

namespace emsa {

struct DeviceEngine::Impl {
  std::vector<DeviceUpdateTable*> tables;
  const DeviceScalars* scalars = nullptr;
  cudaStream_t side = nullptr;
  int device = -1;
  std::vector<cudaEvent_t> ready;  // per bucket, on the compute stream
  std::vector<cudaEvent_t> done;   // per bucket, on the side stream
  cudaEvent_t all_done = nullptr;  // WaitAll's, on the side stream
  long long submitted = 0;

  ~Impl() {
    if (side != nullptr) (void)cudaStreamSynchronize(side);
    for (cudaEvent_t e : ready) (void)cudaEventDestroy(e);
    for (cudaEvent_t e : done) (void)cudaEventDestroy(e);
    if (all_done != nullptr) (void)cudaEventDestroy(all_done);
  }

  Status CheckBucket(size_t b, const char* what) const {
    if (b < tables.size()) return Status::Ok();
    return Status::InvalidArgument(std::string(what) + ": bucket " + std::to_string(b) +
                                   " is out of range (the engine has " +
                                   std::to_string(tables.size()) + " buckets)");
  }
};

Result<std::unique_ptr<DeviceEngine>> DeviceEngine::Create(DeviceUpdateTable* const* tables,
                                                           size_t count,
                                                           const DeviceScalars* scalars,
                                                           cudaStream_t side) {
  if (scalars == nullptr) return Status::InvalidArgument("DeviceEngine::Create: scalars is null");
  if (tables == nullptr && count > 0) {
    return Status::InvalidArgument("DeviceEngine::Create: tables is null");
  }
  if (side == nullptr) {
    return Status::InvalidArgument(
        "DeviceEngine::Create: side is the default stream; give the engine a stream of its own "
        "(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) so that updates can overlap");
  }
  if (!CudaDeviceUsable()) {
    return Status::Unsupported("DeviceEngine::Create: no usable CUDA device");
  }
  int device = -1;
  EMSA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (scalars->device() != device) {
    return Status::InvalidArgument("DeviceEngine::Create: the scalars are on device " +
                                   std::to_string(scalars->device()) + ", the current device is " +
                                   std::to_string(device) + " (make it current first)");
  }
  for (size_t b = 0; b < count; ++b) {
    if (tables[b] == nullptr) {
      return Status::InvalidArgument("DeviceEngine::Create: tables[" + std::to_string(b) +
                                     "] is null");
    }
    if (tables[b]->device() != device) {
      return Status::InvalidArgument("DeviceEngine::Create: tables[" + std::to_string(b) +
                                     "] is on device " + std::to_string(tables[b]->device()) +
                                     ", the scalars on " + std::to_string(device));
    }
    if (tables[b]->groups_needed() > scalars->group_count()) {
      return Status::InvalidArgument("DeviceEngine::Create: tables[" + std::to_string(b) +
                                     "] needs " + std::to_string(tables[b]->groups_needed()) +
                                     " param groups, the scalars hold " +
                                     std::to_string(scalars->group_count()));
    }
  }
  auto impl = std::make_unique<Impl>();
  impl->tables.assign(tables, tables + count);
  impl->scalars = scalars;
  impl->device = device;
  impl->ready.reserve(count);
  impl->done.reserve(count);
  for (size_t b = 0; b < count; ++b) {
    cudaEvent_t e = nullptr;
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    impl->ready.push_back(e);
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    impl->done.push_back(e);
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&impl->all_done, cudaEventDisableTiming));
  impl->side = side;  // set last: the destructor synchronizes it only once it is the engine's
  return std::unique_ptr<DeviceEngine>(new DeviceEngine(std::move(impl)));
}

DeviceEngine::DeviceEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceEngine::~DeviceEngine() = default;

Status DeviceEngine::Submit(size_t bucket, cudaStream_t compute) {
  Impl& m = *impl_;
  EMSA_RETURN_IF_ERROR(m.CheckBucket(bucket, "DeviceEngine::Submit"));
  if (compute == m.side) {
    return Status::InvalidArgument(
        "DeviceEngine::Submit: the compute stream is the engine's side stream; submit from the "
        "stream that produced the gradients");
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(m.ready[bucket], compute));
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(m.side, m.ready[bucket], 0));
  EMSA_RETURN_IF_ERROR(m.tables[bucket]->Update(*m.scalars, m.side));
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(m.done[bucket], m.side));
  ++m.submitted;
  return Status::Ok();
}

Status DeviceEngine::Wait(size_t bucket, cudaStream_t stream) {
  Impl& m = *impl_;
  EMSA_RETURN_IF_ERROR(m.CheckBucket(bucket, "DeviceEngine::Wait"));
  // An event never recorded counts as complete: waiting on it is a no-op.
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, m.done[bucket], 0));
  return Status::Ok();
}

Status DeviceEngine::WaitAll(cudaStream_t stream) {
  Impl& m = *impl_;
  if (m.submitted == 0) return Status::Ok();
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(m.all_done, m.side));
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, m.all_done, 0));
  return Status::Ok();
}

Status DeviceEngine::Synchronize() {
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->side));
  return Status::Ok();
}

size_t DeviceEngine::bucket_count() const { return impl_->tables.size(); }
long long DeviceEngine::submitted() const { return impl_->submitted; }

}  // namespace emsa

#else  // !EMSA_HAVE_CUDA

namespace emsa {

struct DeviceEngine::Impl {};

Result<std::unique_ptr<DeviceEngine>> DeviceEngine::Create(DeviceUpdateTable* const*, size_t,
                                                           const DeviceScalars*, cudaStream_t) {
  return Status::Unsupported(
      "the device engine needs a CUDA build of emsa (nvcc was not found when it was built)");
}
DeviceEngine::DeviceEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceEngine::~DeviceEngine() = default;
Status DeviceEngine::Submit(size_t, cudaStream_t) { return Status::Unsupported("no CUDA"); }
Status DeviceEngine::Wait(size_t, cudaStream_t) { return Status::Unsupported("no CUDA"); }
Status DeviceEngine::WaitAll(cudaStream_t) { return Status::Unsupported("no CUDA"); }
Status DeviceEngine::Synchronize() { return Status::Unsupported("no CUDA"); }
size_t DeviceEngine::bucket_count() const { return 0; }
long long DeviceEngine::submitted() const { return 0; }

}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
