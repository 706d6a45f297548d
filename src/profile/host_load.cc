// host_load.cc — HostLoad (emsa/profile.h): the host tier's load on the machine, made on
// purpose, so that the probe can time the model's forward and backward under it.

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

#include "common/cuda_util.h"
#include "common/pinned_pages.h"
#include "common/thread_pool.h"
#include "emsa/cpu_update.h"
#include "emsa/host_tier_costs.h"
#include "emsa/profile.h"
#include "profile/update_probe.h"

namespace emsa {

struct HostLoad::Impl {
  HostLoadOptions options;
  std::unique_ptr<CpuUpdater> updater;
  profile_internal::HostFloats state{nullptr, &std::free};
  HyperParams hyper;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> updates{0}, copies{0};
  std::mutex mu;
  Status error;  // the first either thread met; guarded by mu
  std::thread cpu, dma;
  bool stopped = false;
#if EMSA_HAVE_CUDA
  void* device[2] = {nullptr, nullptr};
  PinnedPages pinned[2];
  cudaStream_t streams[2] = {nullptr, nullptr};
#endif

  void Fail(const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (error.ok()) error = s;
    stop.store(true);
  }

  void UpdateLoop() {
    TensorUpdate t = profile_internal::FourArrayUpdate(state.get(), options.update_params, &hyper);
    const StepOptions step = profile_internal::NearestRounding();
    while (!stop.load(std::memory_order_relaxed)) {
      ++t.step;
      const Status s = updater->Step(&t, 1, step);
      if (!s.ok()) return Fail(s);
      updates.fetch_add(1);
    }
  }

#if EMSA_HAVE_CUDA
  // Four copies each way per round, then a wait for both: the link stays busy (each copy is
  // milliseconds long) and the stop flag is seen within a round.
  void CopyLoop() {
    Status s = CudaStatus(cudaSetDevice(options.gpu_device), "HostLoad: cudaSetDevice");
    const size_t bytes = options.copy_bytes;
    while (s.ok() && !stop.load(std::memory_order_relaxed)) {
      for (int k = 0; k < 4 && s.ok(); ++k) {
        s = CudaStatus(
            cudaMemcpyAsync(device[0], pinned[0].get(), bytes, cudaMemcpyHostToDevice, streams[0]),
            "HostLoad: copy to the device");
        if (s.ok()) {
          s = CudaStatus(cudaMemcpyAsync(pinned[1].get(), device[1], bytes, cudaMemcpyDeviceToHost,
                                         streams[1]),
                         "HostLoad: copy to the host");
        }
      }
      for (cudaStream_t st : streams) {
        const Status w = CudaStatus(cudaStreamSynchronize(st), "HostLoad: cudaStreamSynchronize");
        if (s.ok()) s = w;
      }
      if (s.ok()) copies.fetch_add(4);
    }
    if (!s.ok()) Fail(s);
  }

  Status AllocateCopies() {
    EMSA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.gpu_device));
    for (int k = 0; k < 2; ++k) {
      cudaError_t e = cudaMalloc(&device[k], options.copy_bytes);
      if (e == cudaSuccess) e = cudaMemset(device[k], 0, options.copy_bytes);
      if (e == cudaSuccess) e = pinned[k].Allocate(options.copy_bytes);
      if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        return Status::OutOfMemory("HostLoad: could not allocate two copy buffers of " +
                                   std::to_string(options.copy_bytes) +
                                   " bytes on the device and pinned on the host; lower "
                                   "copy_bytes or set copies = false");
      }
      EMSA_CUDA_RETURN_IF_ERROR(e);
      EMSA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&streams[k], cudaStreamNonBlocking));
    }
    return Status::Ok();
  }
#endif

  Status Join() {
    stop.store(true);
    if (cpu.joinable()) cpu.join();
    if (dma.joinable()) dma.join();
    std::lock_guard<std::mutex> lock(mu);
    return error;
  }

  ~Impl() {
    (void)Join();
#if EMSA_HAVE_CUDA
    for (int k = 0; k < 2; ++k) {
      if (streams[k] != nullptr) (void)cudaStreamDestroy(streams[k]);
      if (device[k] != nullptr) (void)cudaFree(device[k]);
    }
#endif
  }
};

HostLoad::HostLoad(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostLoad::~HostLoad() = default;

Result<std::unique_ptr<HostLoad>> HostLoad::Start(const HostLoadOptions& options) {
  if (options.threads < 0) {
    return Status::InvalidArgument("HostLoadOptions.threads is " + std::to_string(options.threads) +
                                   "; use 0 (the host tier's own count) or more");
  }
  if (options.update_params < 64) {
    return Status::InvalidArgument("HostLoadOptions.update_params is " +
                                   std::to_string(options.update_params) + "; use at least 64");
  }
  if (options.copies && options.copy_bytes == 0) {
    return Status::InvalidArgument("HostLoadOptions.copy_bytes is 0; use > 0 or copies = false");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  CpuUpdaterOptions o;
  o.threads = options.threads > 0 ? options.threads : HostTierThreads(ThreadPool::AvailableCpus());
  EMSA_ASSIGN_OR_RETURN(impl->updater, CpuUpdater::Create(o));
  impl->state = profile_internal::TouchedHostFloats(impl->updater->pool(),
                                                    4 * options.update_params, 1 << 16);
  if (impl->state == nullptr) {
    return Status::OutOfMemory("HostLoad: could not allocate " +
                               std::to_string(4 * options.update_params * sizeof(float)) +
                               " bytes of host memory; lower update_params");
  }
  bool copies = false;
#if EMSA_HAVE_CUDA
  int count = 0;
  if (options.copies && cudaGetDeviceCount(&count) == cudaSuccess && count > 0) {
    if (options.gpu_device < 0 || options.gpu_device >= count) {
      return Status::InvalidArgument("HostLoadOptions.gpu_device is " +
                                     std::to_string(options.gpu_device) + " but this machine has " +
                                     std::to_string(count) + " CUDA device(s)");
    }
    int current = 0;
    EMSA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
    const Status s = impl->AllocateCopies();
    (void)cudaSetDevice(current);
    EMSA_RETURN_IF_ERROR(s);
    copies = true;
  } else {
    (void)cudaGetLastError();
  }
#endif
  Impl* raw = impl.get();
  try {
    raw->cpu = std::thread([raw] { raw->UpdateLoop(); });
#if EMSA_HAVE_CUDA
    if (copies) raw->dma = std::thread([raw] { raw->CopyLoop(); });
#endif
  } catch (const std::system_error& e) {
    (void)raw->Join();
    return Status::OutOfMemory(std::string("HostLoad: could not start a thread: ") + e.what());
  }
  // Running once each has done a round (or one failed).
  while (raw->updates.load() == 0 || (copies && raw->copies.load() == 0)) {
    if (raw->stop.load()) return raw->Join();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return std::unique_ptr<HostLoad>(new HostLoad(std::move(impl)));
}

Status HostLoad::Stop() {
  if (impl_->stopped) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->error;
  }
  impl_->stopped = true;
  return impl_->Join();
}

int64_t HostLoad::update_rounds() const { return impl_->updates.load(); }
int64_t HostLoad::copy_rounds() const { return impl_->copies.load(); }

}  // namespace emsa
