// gpu_profile.cc — the GPU half of the device profile: what the device is (CUDA runtime
// attributes) and three timed copies: device-to-device (HBM), pinned host to device and back.
//
// A build without CUDA, a machine without a driver, or one without a device all give
// {present = false} and OK: the planner then works from a preset profile instead.
#include <string>

#include "common/cuda_util.h"
#include "emsa/profile.h"
#include "emsa/profile_cache.h"

#if EMSA_HAVE_CUDA

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <vector>

#include "common/pinned_pages.h"
#include "common/thread_pool.h"
#include "emsa/cpu_update.h"
#include "emsa/host_tier_costs.h"
#include "profile/update_probe.h"

namespace emsa {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kHbmCopyBytes = 1024 * kMiB;  // per buffer; the copy moves twice this
constexpr uint64_t kPcieCopyBytes = 256 * kMiB;
constexpr int kTimedCopies = 5;

// Owners for the measurement's resources, so that every early return frees what was taken.
// Errors from the frees themselves are ignored: nothing useful can be done with them here.
struct DeviceBuffer {
  void* ptr = nullptr;
  ~DeviceBuffer() {
    if (ptr != nullptr) (void)cudaFree(ptr);
  }
};
struct PinnedBuffer {
  PinnedPages pages;
  void* ptr = nullptr;
};
struct Stream {
  cudaStream_t stream = nullptr;
  ~Stream() {
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};
struct Event {
  cudaEvent_t event = nullptr;
  ~Event() {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
};
// Measuring must not change which device the caller's thread works on.
struct RestoreDevice {
  int device = -1;
  ~RestoreDevice() {
    if (device >= 0) (void)cudaSetDevice(device);
  }
};

Status AllocDevice(DeviceBuffer* buf, uint64_t bytes) {
  cudaError_t err = cudaMalloc(&buf->ptr, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return Status::OutOfMemory("GPU profile: cudaMalloc of " + std::to_string(bytes) +
                               " bytes failed; free device memory or set measure_bandwidth=false");
  }
  return CudaStatus(err, "GPU profile: cudaMalloc");
}

// Runs copy() once untimed (first-use costs: page tables, copy-engine setup), then
// kTimedCopies times between events; returns bytes_counted / median seconds.
template <typename CopyFn>
Result<double> MedianBandwidth(cudaStream_t stream, double bytes_counted, const char* what,
                               CopyFn&& copy) {
  Event start, stop;
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start.event));
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop.event));
  EMSA_RETURN_IF_ERROR(CudaStatus(copy(), what));
  std::vector<float> ms(kTimedCopies);
  for (float& m : ms) {
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.event, stream));
    EMSA_RETURN_IF_ERROR(CudaStatus(copy(), what));
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop.event, stream));
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop.event));
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&m, start.event, stop.event));
  }
  std::sort(ms.begin(), ms.end());
  const double seconds = ms[ms.size() / 2] * 1e-3;
  return seconds > 0.0 ? bytes_counted / seconds : 0.0;
}

// The host tier's CPU update and copies both ways at once, each measured under the other.
struct UpdateAndCopies {
  double update = 0.0;  // B/s, the CPU update (28 B per parameter) while the copies run
  double copies = 0.0;  // B/s each way, the copies while the CPU update runs
};

// The host tier's CPU update (CpuProfile's measurement: 28 B per parameter, the host tier's pool
// size) while `enqueue_pair` copies `pair_bytes` each way on `stream`. Copies for well over a
// pass are enqueued first, and passes run back to back until they have finished: the update's
// rate is the best pass that ended while they still ran; the copies' is their event-timed
// duration, the CPU updating throughout it. Either is 0 when it did not qualify (the copies
// finished within the first pass, or outlasted kMaxPasses).
template <typename Enqueue>
Result<UpdateAndCopies> UpdateWhileCopying(int threads, cudaStream_t stream, double pair_bytes,
                                           Enqueue&& enqueue_pair) {
  CpuUpdaterOptions o;
  o.threads = HostTierThreads(threads);
  Result<std::unique_ptr<CpuUpdater>> updater = CpuUpdater::Create(o);
  if (!updater.ok()) return updater.status();
  constexpr int64_t n = int64_t{64} << 20;  // parameters: 1 GiB of four fp32 arrays
  const profile_internal::HostFloats data =
      profile_internal::TouchedHostFloats((*updater)->pool(), 4 * n, 1 << 16);
  if (data == nullptr) {
    return Status::OutOfMemory("GPU profile: could not allocate " +
                               std::to_string(4 * n * sizeof(float)) +
                               " bytes for the host update under copies; set "
                               "measure_bandwidth=false");
  }
  const HyperParams hyper;
  TensorUpdate t = profile_internal::FourArrayUpdate(data.get(), n, &hyper);
  const StepOptions step = profile_internal::NearestRounding();
  EMSA_RETURN_IF_ERROR((*updater)->Step(&t, 1, step));  // first touch, warm pool
  Event start, done;
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start.event));
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&done.event));
  constexpr int kPairs = 24;      // 256 MiB each way per pair: a tenth of a second or more
  constexpr int kMaxPasses = 64;  // tens of milliseconds each
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.event, stream));
  for (int i = 0; i < kPairs; ++i) {
    EMSA_RETURN_IF_ERROR(CudaStatus(enqueue_pair(), "GPU profile: copies both ways"));
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(done.event, stream));
  UpdateAndCopies out;
  bool copying = true;
  for (int pass = 0; pass < kMaxPasses && copying; ++pass) {
    ++t.step;
    const auto begin = std::chrono::steady_clock::now();
    EMSA_RETURN_IF_ERROR((*updater)->Step(&t, 1, step));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    const cudaError_t q = cudaEventQuery(done.event);
    if (q != cudaSuccess && q != cudaErrorNotReady) {
      return CudaStatus(q, "GPU profile: cudaEventQuery");
    }
    copying = q == cudaErrorNotReady;
    if (copying && seconds > 0.0)
      out.update = std::max(out.update, profile_internal::kFourArrayUpdateBytes * n / seconds);
    // The copies ended during a pass after the first: the CPU updated throughout them.
    if (!copying && pass > 0) {
      float ms = 0.0f;
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.event, done.event));
      if (ms > 0.0f) out.copies = kPairs * pair_bytes / (ms * 1e-3);
    }
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done.event));
  return out;
}

Status AllocPinned(PinnedBuffer* buf, uint64_t bytes) {
  const cudaError_t err = buf->pages.Allocate(bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return Status::OutOfMemory("GPU profile: pinning " + std::to_string(bytes) +
                               " bytes of host memory failed; set measure_bandwidth=false");
  }
  buf->ptr = buf->pages.get();
  return CudaStatus(err, "GPU profile: cudaHostRegister");
}

// Device to device: `bytes` read and written, so 2 x bytes counted.
Status MeasureHbm(GpuProfile* gpu, cudaStream_t stream, const DeviceBuffer& src,
                  const DeviceBuffer& dst, uint64_t bytes) {
  // cudaMalloc does not initialise; copying garbage is fine, but defined contents keep tools
  // such as compute-sanitizer quiet.
  EMSA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(src.ptr, 0, bytes, stream));
  EMSA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst.ptr, 0, bytes, stream));
  auto d2d = [&] {
    return cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice, stream);
  };
  EMSA_ASSIGN_OR_RETURN(
      gpu->hbm_bandwidth,
      MedianBandwidth(stream, 2.0 * bytes, "GPU profile: device-to-device cudaMemcpyAsync", d2d));
  return Status::Ok();
}

// PCIe one direction at a time; each counts the bytes that crossed the link once.
Status MeasureOneWay(GpuProfile* gpu, cudaStream_t stream, const DeviceBuffer& src,
                     const DeviceBuffer& dst, const PinnedBuffer& host, uint64_t bytes) {
  auto h2d = [&] {
    return cudaMemcpyAsync(dst.ptr, host.ptr, bytes, cudaMemcpyHostToDevice, stream);
  };
  auto d2h = [&] {
    return cudaMemcpyAsync(host.ptr, src.ptr, bytes, cudaMemcpyDeviceToHost, stream);
  };
  EMSA_ASSIGN_OR_RETURN(
      gpu->h2d_bandwidth,
      MedianBandwidth(stream, 1.0 * bytes, "GPU profile: host-to-device cudaMemcpyAsync", h2d));
  EMSA_ASSIGN_OR_RETURN(
      gpu->d2h_bandwidth,
      MedianBandwidth(stream, 1.0 * bytes, "GPU profile: device-to-host cudaMemcpyAsync", d2h));
  return Status::Ok();
}

// Both directions at once: the H2D copy on a second stream that joins the first (so the events
// on the first time both), the D2H copy into a second pinned buffer; then the same copies under
// the host tier's CPU update. Returns once `stream` is idle.
Status MeasureDuplex(GpuProfile* gpu, int threads, cudaStream_t stream, const DeviceBuffer& src,
                     const DeviceBuffer& dst, const PinnedBuffer& host, uint64_t bytes) {
  Stream other;
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&other.stream, cudaStreamNonBlocking));
  PinnedBuffer host_out;
  EMSA_RETURN_IF_ERROR(AllocPinned(&host_out, bytes));
  Event fork, join;
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&fork.event, cudaEventDisableTiming));
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&join.event, cudaEventDisableTiming));
  auto both = [&] {
    cudaError_t e = cudaEventRecord(fork.event, stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(other.stream, fork.event, 0);
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(dst.ptr, host.ptr, bytes, cudaMemcpyHostToDevice, other.stream);
    }
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(host_out.ptr, src.ptr, bytes, cudaMemcpyDeviceToHost, stream);
    }
    if (e == cudaSuccess) e = cudaEventRecord(join.event, other.stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, join.event, 0);
    return e;
  };
  EMSA_ASSIGN_OR_RETURN(
      gpu->duplex_bandwidth,
      MedianBandwidth(stream, 1.0 * bytes, "GPU profile: copies both ways at once", both));
  EMSA_ASSIGN_OR_RETURN(const UpdateAndCopies together,
                        UpdateWhileCopying(threads, stream, 1.0 * bytes, both));
  gpu->host_update_duplex_bandwidth = together.update;
  gpu->duplex_under_update_bandwidth = together.copies;
  return CudaStatus(cudaStreamSynchronize(stream), "GPU profile: cudaStreamSynchronize");
}

Status MeasureCopies(GpuProfile* gpu, int threads) {
  Stream stream;
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking));

  // Two buffers of up to 1 GiB, but never more than half of what is free (others may share
  // the device), rounded to 2 MiB.
  uint64_t hbm_bytes = std::min(kHbmCopyBytes, gpu->free_memory / 4) / (2 * kMiB) * (2 * kMiB);
  if (hbm_bytes == 0) {
    return Status::OutOfMemory("GPU profile: only " + std::to_string(gpu->free_memory) +
                               " bytes free on device " + std::to_string(gpu->device) +
                               ", too little to measure bandwidth; set measure_bandwidth=false");
  }
  DeviceBuffer src, dst;
  EMSA_RETURN_IF_ERROR(AllocDevice(&src, hbm_bytes));
  EMSA_RETURN_IF_ERROR(AllocDevice(&dst, hbm_bytes));
  EMSA_RETURN_IF_ERROR(MeasureHbm(gpu, stream.stream, src, dst, hbm_bytes));

  // PCIe: pinned, portable, not write-combined (the same kind of memory as the host arena).
  const uint64_t pcie_bytes = std::min(kPcieCopyBytes, hbm_bytes);
  PinnedBuffer host;
  EMSA_RETURN_IF_ERROR(AllocPinned(&host, pcie_bytes));
  EMSA_RETURN_IF_ERROR(MeasureOneWay(gpu, stream.stream, src, dst, host, pcie_bytes));
  return MeasureDuplex(gpu, threads, stream.stream, src, dst, host, pcie_bytes);
}

Status DeviceAttribute(int* value, cudaDeviceAttr attr, const char* name, int device) {
  return CudaStatus(cudaDeviceGetAttribute(value, attr, device), name);
}

}  // namespace

Result<GpuProfile> MeasureGpuProfile(const ProfileOptions& options) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    // No driver (or an unusable one): a CPU-only machine, not an error. Clear the sticky
    // error so that it does not surface in an unrelated later call.
    (void)cudaGetLastError();
    return GpuProfile{};
  }
  if (count == 0) return GpuProfile{};
  if (options.gpu_device < 0 || options.gpu_device >= count) {
    return Status::InvalidArgument("ProfileOptions.gpu_device is " +
                                   std::to_string(options.gpu_device) + " but this machine has " +
                                   std::to_string(count) + " CUDA device(s): use 0.." +
                                   std::to_string(count - 1));
  }
  const int dev = options.gpu_device;
  RestoreDevice restore;
  int previous = 0;
  EMSA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  EMSA_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev));
  restore.device = previous;

  GpuProfile gpu;
  gpu.present = true;
  gpu.device = dev;
  cudaDeviceProp prop{};
  EMSA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, dev));
  gpu.name = prop.name;
  int major = 0, minor = 0, sms = 0, l2 = 0, persisting = 0;
  EMSA_RETURN_IF_ERROR(DeviceAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                       "cudaDevAttrComputeCapabilityMajor", dev));
  EMSA_RETURN_IF_ERROR(DeviceAttribute(&minor, cudaDevAttrComputeCapabilityMinor,
                                       "cudaDevAttrComputeCapabilityMinor", dev));
  EMSA_RETURN_IF_ERROR(
      DeviceAttribute(&sms, cudaDevAttrMultiProcessorCount, "cudaDevAttrMultiProcessorCount", dev));
  EMSA_RETURN_IF_ERROR(DeviceAttribute(&l2, cudaDevAttrL2CacheSize, "cudaDevAttrL2CacheSize", dev));
  // 0 under MIG and on devices without persisting L2: the planner then never uses tier L0.
  EMSA_RETURN_IF_ERROR(DeviceAttribute(&persisting, cudaDevAttrMaxPersistingL2CacheSize,
                                       "cudaDevAttrMaxPersistingL2CacheSize", dev));
  gpu.compute_capability_major = major;
  gpu.compute_capability_minor = minor;
  gpu.sm_count = sms;
  gpu.l2_bytes = static_cast<uint64_t>(std::max(l2, 0));
  gpu.max_persisting_l2_bytes = static_cast<uint64_t>(std::max(persisting, 0));

  size_t free_bytes = 0, total_bytes = 0;
  EMSA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  gpu.total_memory = total_bytes;
  gpu.free_memory = free_bytes;

  if (options.measure_bandwidth) {
    const int threads = options.threads > 0 ? options.threads : ThreadPool::AvailableCpus();
    EMSA_RETURN_IF_ERROR(MeasureCopies(&gpu, threads));
    // Re-read after the measurement's buffers are gone: what is free now is what a plan gets.
    EMSA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    gpu.free_memory = free_bytes;
  }
  return gpu;
}

std::string GpuDriverVersion() {
  int api = 0;
  if (cudaDriverGetVersion(&api) != cudaSuccess || api == 0) {
    (void)cudaGetLastError();
    return "none";
  }
  // The kernel module's version is finer than the API's (two drivers share one API version):
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..." names it.
  std::string module;
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  if (in && std::getline(in, line)) {
    const std::string marker = "Kernel Module";
    const size_t at = line.find(marker);
    if (at != std::string::npos) {
      const size_t begin = line.find_first_not_of(' ', at + marker.size());
      const size_t end = line.find(' ', begin == std::string::npos ? line.size() : begin);
      if (begin != std::string::npos) module = line.substr(begin, end - begin) + " ";
    }
  }
  return module + "cuda " + std::to_string(api);
}

}  // namespace emsa

#else  // !EMSA_HAVE_CUDA

namespace emsa {

Result<GpuProfile> MeasureGpuProfile(const ProfileOptions& options) {
  (void)options;
  return GpuProfile{};
}

std::string GpuDriverVersion() { return "none"; }

}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
