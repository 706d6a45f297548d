// emsa/device_arena.h — the device arena: one device allocation per plan; state tensors are views.
//
// Create() obtains the whole arena at once, zero-fills it once and never grows it. Two ways:
//
//  - kVmm: the CUDA virtual-memory API. One virtual range is reserved, aligned to 2 MiB (or the
//    device's allocation granularity when larger), backed by one physical allocation of the
//    rounded size, mapped, and made readable and writable from `device`. The driver is reached
//    at run time (cudaGetDriverEntryPointByVersion), so libemsa never links libcuda.
//  - kCudaMalloc: plain cudaMalloc, when VMM is switched off, unsupported by the device or
//    driver, or fails. The returned pointer is still aligned to 2 MiB (over-allocating one granule
//    when cudaMalloc does not align it).
//
// No silent fallback: fallback_reason() says why kCudaMalloc was used, and the engine reports it
// with the plan. Both kinds behave the same for every user of the arena.
//
// Lifetime: the destructor frees the memory exactly once with the calls matching its kind (unmap,
// release, free the range; or cudaFree). It first waits for all work on the device, because
// work still in flight may use the arena. A destructor cannot return an error: failures are
// counted (ReleaseErrorCount()) and the first is written to stderr. To let frameworks alias
// arena memory without a copy, hold the arena in a std::shared_ptr and export views as DLPack
// tensors (src/memory/dlpack_export.h): each export keeps the arena alive until its consumer is
// done, so the memory is freed when emsa and every framework tensor have let go.
//
// Threads: Create() and the destructor may run on any host thread; they set the CUDA device
// they need and restore the caller's afterwards. data(), View() and the accessors are const and
// safe to call concurrently.
//
// Without a CUDA build, or without a usable device, Create() returns kUnsupported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "emsa/status.h"

// The runtime's stream handle, declared as cuda_runtime.h declares it, so that this header
// does not need the CUDA toolkit.
typedef struct CUstream_st* cudaStream_t;

namespace emsa {

struct DeviceArenaOptions {
  // Try the virtual-memory API first (default). false forces cudaMalloc: for tests, and for
  // tools that must coexist with a driver whose VMM misbehaves.
  bool allow_vmm = true;
  // The stream the one-time zero fill (cudaMemsetAsync) runs on. nullptr: the legacy default
  // stream, which orders it before later work on every blocking stream.
  cudaStream_t zero_stream = nullptr;
  // true (default): Create() returns after the zero fill has finished. false: it returns once
  // the fill is enqueued on zero_stream, and the caller must order other streams' use of the
  // arena after it (an event).
  bool wait_for_zero_fill = true;
};

class DeviceArena {
 public:
  enum class Kind { kVmm, kCudaMalloc };
  using Options = DeviceArenaOptions;

  // bytes must be in [1, 1 PiB] and `device` a valid CUDA ordinal (else kInvalidArgument). The
  // arena is rounded up to granularity(); size() stays `bytes`. Memory the device does not have
  // is kOutOfMemory; other CUDA failures are kCudaError.
  static Result<std::unique_ptr<DeviceArena>> Create(uint64_t bytes, int device,
                                                     const Options& options = Options());
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  void* data() const { return data_; }     // a device pointer, aligned to granularity()
  uint64_t size() const { return size_; }  // bytes views may address: what Create() was asked
  uint64_t mapped_bytes() const { return mapped_bytes_; }  // size() rounded to granularity()
  uint64_t granularity() const { return granularity_; }    // 2 MiB, or the device's, if larger
  int device() const { return device_; }
  Kind kind() const { return kind_; }
  // Empty for kVmm; for kCudaMalloc, why VMM was not used ("Options::allow_vmm is false",
  // "cuMemCreate: CUDA_ERROR_...", ...).
  const std::string& fallback_reason() const { return fallback_reason_; }

  // A device pointer to [offset, offset + bytes), or null when that range is not inside
  // [0, size()). Never dereference it on the host.
  void* View(uint64_t offset, uint64_t bytes) const {
    if (offset > size_ || bytes > size_ - offset) return nullptr;
    return static_cast<char*>(data_) + offset;
  }
  // A typed view of `count` elements; also null when offset is misaligned for T.
  template <typename T>
  T* TypedView(uint64_t offset, uint64_t count) const {
    if (offset % alignof(T) != 0 || offset > size_ || count > (size_ - offset) / sizeof(T)) {
      return nullptr;
    }
    return reinterpret_cast<T*>(static_cast<char*>(data_) + offset);
  }

  // Process-wide count of failed release calls in destructors since the process started.
  static uint64_t ReleaseErrorCount();

 private:
  DeviceArena() = default;
  Status MapVmm();
  Status AllocateCudaMalloc();
  void Release();

  void* data_ = nullptr;
  uint64_t size_ = 0;
  uint64_t mapped_bytes_ = 0;
  uint64_t granularity_ = 0;
  int device_ = 0;
  Kind kind_ = Kind::kCudaMalloc;
  std::string fallback_reason_;
  // CUDA builds only (unused without CUDA).
  [[maybe_unused]] uint64_t vmm_handle_ = 0;      // CUmemGenericAllocationHandle, kVmm only
  [[maybe_unused]] void* malloc_base_ = nullptr;  // what cudaMalloc returned, kCudaMalloc only
  [[maybe_unused]] uint64_t malloc_bytes_ = 0;    // what was asked of cudaMalloc
};

const char* DeviceArenaKindName(DeviceArena::Kind kind);  // "vmm", "cudaMalloc"

}  // namespace emsa
