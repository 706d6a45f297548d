// emsa/host_arena.h — the host arena: one allocation per plan, state tensors are views.
//
// Memory is mapped anonymously, aligned to 2 MiB and advised to transparent huge pages (fewer
// TLB misses while the CPU streams through state, and fewer pages for the driver to pin), then
// zero-filled: every page is touched now, in parallel on a pool, so no page fault lands in a
// step and, on a NUMA host, each page lies near the thread that filled it. When pinned memory is
// asked for and a CUDA device is usable, the filled range is then page-locked in one
// cudaHostRegister (portable: any context may copy from it). Registering memory that is already
// resident costs a fraction of cudaHostAlloc, which locks and clears pages one by one in the
// driver; cudaHostAlloc (portable, never write-combined: the CPU reads state back every step)
// is only the fallback when registering fails, and facts() says which way the memory was
// pinned and why. Registered memory is not inherited by a fork (MADV_DONTFORK). The arena is freed
// exactly once, by the destructor, with the call matching how it was obtained. Nothing grows later.
//
// Before anything is mapped, Create checks that the host can hold the arena (CheckFits): more
// than the memory available now (MemAvailable) less a reserve for the rest of the process fails
// with kOutOfMemory naming the size that fits, instead of a visit from the OOM killer during
// the fill. Thread safety: Create may run on any thread; an arena is immutable afterwards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "emsa/status.h"

namespace emsa {

class ThreadPool;

struct HostArenaOptions {
  // Page-locked for the device's DMA when a CUDA device is usable (else pageable, and facts()
  // says why). false never touches CUDA.
  bool want_pinned = true;
  // The zero fill runs on fill_pool when given; else on a pool of fill_threads threads made
  // for it (0: every CPU this process may run on; 1: the calling thread alone).
  ThreadPool* fill_pool = nullptr;
  int32_t fill_threads = 0;
  // Host memory the arena may take, in bytes: 0 reads MemAvailable from /proc/meminfo (the
  // physical memory where that cannot be read). A figure given here stands for it (tests).
  uint64_t available_bytes = 0;
};

// How an arena was obtained.
enum class HostPin {
  kNone,        // pageable: not asked for, or no usable device (fallback_reason says)
  kRegistered,  // mapped, filled, then cudaHostRegister
  kHostAlloc,   // cudaHostAlloc, because registering failed (fallback_reason says why)
};

struct HostArenaFacts {
  HostPin pin = HostPin::kNone;
  std::string fallback_reason;  // "" when pinned by registering, or when pinning was not asked
  bool huge_pages = false;      // the kernel accepted MADV_HUGEPAGE for the mapping
  uint64_t locked_bytes = 0;    // page-locked (may exceed size(): whole 2 MiB pages)
  uint64_t pageable_bytes = 0;  // resident but not locked
  // The soft RLIMIT_MEMLOCK (UINT64_MAX: unlimited), for messages: CUDA's pinning does not
  // count against it, so it is reported, not enforced.
  uint64_t locked_limit_bytes = 0;
  int32_t fill_threads = 1;  // threads that ran the zero fill
  double fill_seconds = 0;   // zero fill (first touch of every page)
  double pin_seconds = 0;    // cudaHostRegister, or cudaHostAlloc on the fallback
};

class HostArena {
 public:
  enum class Kind { kPinned, kPageable };
  // bytes must be in [1, 1 PiB] (else kInvalidArgument). A host without room for it is
  // kOutOfMemory before anything is allocated (CheckFits); a failed allocation is kOutOfMemory.
  static Result<std::unique_ptr<HostArena>> Create(uint64_t bytes, const HostArenaOptions& options);
  // The same with default options except these (a null pool fills on the calling thread).
  static Result<std::unique_ptr<HostArena>> Create(uint64_t bytes, bool want_pinned = true,
                                                   ThreadPool* zero_fill_pool = nullptr);
  // OK when the host can hold an arena of `bytes` now; else the kOutOfMemory (or
  // kInvalidArgument for a bad size) that Create would return. Allocates nothing.
  static Status CheckFits(uint64_t bytes, const HostArenaOptions& options);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  void* data() const { return data_; }  // 2 MiB-aligned
  uint64_t size() const { return size_; }
  Kind kind() const { return facts_.pin == HostPin::kNone ? Kind::kPageable : Kind::kPinned; }
  const HostArenaFacts& facts() const { return facts_; }
  // A typed view at a byte offset; null (never out of range) when the view does not fit or is
  // misaligned for T.
  template <typename T>
  T* View(uint64_t offset, uint64_t count) const {
    if (offset % alignof(T) != 0 || offset > size_ || count > (size_ - offset) / sizeof(T)) {
      return nullptr;
    }
    return reinterpret_cast<T*>(static_cast<char*>(data_) + offset);
  }

 private:
  HostArena() = default;
  Status MapAndFill(ThreadPool* pool);
  Status Register();
  Status HostAllocFallback(ThreadPool* pool);
  void Release();

  void* data_ = nullptr;
  uint64_t size_ = 0;
  uint64_t mapped_ = 0;  // bytes of the mapping at data_ (size_ rounded up to 2 MiB); 0: none
  HostArenaFacts facts_;
};

}  // namespace emsa
