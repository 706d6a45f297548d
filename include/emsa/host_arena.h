// emsa/host_arena.h — the host arena: one allocation per plan, state tensors are views.
//
// Memory is mapped anonymously, aligned to 2 MiB and advised to transparent huge pages (fewer
// TLB misses while the CPU streams through state, and fewer pages for the driver to pin). Every
// page is faulted in before a step can reach it (populated, in parallel on a pool; on a NUMA host
// each page lies near the thread that faulted it), so no page fault lands in a step. Fresh
// anonymous memory reads as zero already: nothing is written to populate it, and populating
// never changes what a page holds.
//
// Only a prefix of the arena is page-locked (HostArenaOptions::locked_bytes; all of it by
// default): the views a copy to or from the device touches (the plan puts them first:
// Prediction::host_locked_bytes). When pinned memory is asked for and a CUDA device is usable,
// the prefix is populated, then locked with one cudaHostRegister (portable: any context may copy
// from it); the rest stays pageable, touched by CPU threads alone. Page-locking costs time per
// byte and locked memory cannot be reclaimed, so what no DMA reads is not locked. Registering
// memory that is already resident costs a fraction of cudaHostAlloc, which locks and clears
// pages one by one in the driver; cudaHostAlloc (portable, never write-combined: the CPU reads
// state back every step) of the whole arena is only the fallback when registering fails, and
// facts() says which way the memory was pinned and why. The arena is not inherited by a fork
// when pinned (MADV_DONTFORK). The arena is freed exactly once, by the destructor, with the call
// matching how it was obtained. Nothing grows later.
//
// The pageable part may be populated in the background (populate_in_background): Create then
// returns once the prefix is locked, a thread of the arena's own populates the rest front to
// back on its own pool, and WaitPopulated(offset) blocks until everything before offset is
// resident. State may be read and written meanwhile: populating preserves contents.
//
// Before anything is mapped, Create checks that the host can hold the whole arena (CheckFits):
// more than the memory available now (MemAvailable) less a reserve for the rest of the process
// fails with kOutOfMemory naming the size that fits, instead of a visit from the OOM killer
// during the fill. Thread safety: Create may run on any thread; the arena's layout is immutable
// afterwards; WaitPopulated and facts() may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "emsa/status.h"

namespace emsa {

class ThreadPool;

// The arena is mapped, locked and populated in whole pages of this size (a transparent huge
// page): a locked prefix ends on one.
inline constexpr uint64_t kHostArenaPageBytes = uint64_t{2} << 20;

struct HostArenaOptions {
  // Page-locked for the device's DMA when a CUDA device is usable (else pageable, and facts()
  // says why). false never touches CUDA.
  bool want_pinned = true;
  // The prefix that is page-locked (when pinned), rounded up to whole kHostArenaPageBytes pages;
  // the rest stays pageable. The default, UINT64_MAX: all of it.
  uint64_t locked_bytes = UINT64_MAX;
  // The part after the locked prefix is populated on a thread of the arena's own after Create
  // returns (WaitPopulated waits for it) instead of before. false: before.
  bool populate_in_background = false;
  // The population before Create returns runs on fill_pool when given; else on a pool of
  // fill_threads threads made for it (0: every CPU this process may run on; 1: the calling
  // thread alone). A background population runs on a pool of fill_threads threads of its own.
  ThreadPool* fill_pool = nullptr;
  int32_t fill_threads = 0;
  // Host memory the arena may take, in bytes: 0 reads MemAvailable from /proc/meminfo (the
  // physical memory where that cannot be read). A figure given here stands for it (tests).
  uint64_t available_bytes = 0;
};

// How an arena was obtained.
enum class HostPin {
  kNone,        // pageable: not asked for, or no usable device (fallback_reason says)
  kRegistered,  // mapped, populated, then the locked prefix cudaHostRegister'ed
  kHostAlloc,   // cudaHostAlloc of all of it: registering failed (fallback_reason says why)
};

struct HostArenaFacts {
  HostPin pin = HostPin::kNone;
  std::string fallback_reason;  // "" when pinned by registering, or when pinning was not asked
  bool huge_pages = false;      // the kernel accepted MADV_HUGEPAGE for the mapping
  uint64_t locked_bytes = 0;    // page-locked (may exceed size(): whole 2 MiB pages)
  uint64_t pageable_bytes = 0;  // not locked: resident, or being populated in the background
  // The soft RLIMIT_MEMLOCK (UINT64_MAX: unlimited), for messages: CUDA's pinning does not
  // count against it, so it is reported, not enforced.
  uint64_t locked_limit_bytes = 0;
  int32_t fill_threads = 1;  // threads that populated the part populated before Create returned
  double fill_seconds = 0;   // populating before Create returned (with a background population:
                             // the locked prefix alone)
  double pin_seconds = 0;    // cudaHostRegister, or cudaHostAlloc on the fallback
  // The background population: whether there is one, whether it has finished (every page
  // resident), and how long it took (0 until it has finished).
  bool populate_in_background = false;
  bool populated = true;
  double populate_seconds = 0;
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
  // OK when the host can hold an arena of `bytes` now (all of it, locked or not); else the
  // kOutOfMemory (or kInvalidArgument for a bad size) that Create would return. Allocates
  // nothing.
  static Status CheckFits(uint64_t bytes, const HostArenaOptions& options);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  void* data() const { return data_; }  // 2 MiB-aligned
  uint64_t size() const { return size_; }
  Kind kind() const { return facts_.pin == HostPin::kNone ? Kind::kPageable : Kind::kPinned; }
  HostArenaFacts facts() const;  // a snapshot: a background population may still be running
  // Blocks until every page before byte `offset` (clamped to size()) is resident; at once where
  // nothing is populated in the background or it got there. kOutOfMemory when the kernel could
  // not supply the pages (the arena must then not be used for steps).
  Status WaitPopulated(uint64_t offset) const;
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
  class Populator;  // the background population (host_arena.cc)
  HostArena();
  Status Map();
  Status Fill(uint64_t bytes, ThreadPool* pool);
  bool PopulateInBackground(int32_t threads);  // false: the OS refused the thread
  Status Register();
  Status HostAllocFallback(ThreadPool* pool);
  void Release();

  void* data_ = nullptr;
  uint64_t size_ = 0;
  uint64_t mapped_ = 0;  // bytes of the mapping at data_ (size_ rounded up to 2 MiB); 0: none
  uint64_t prefix_ = 0;  // the locked prefix's bytes (whole pages, at most mapped_)
  HostArenaFacts facts_;
  std::unique_ptr<Populator> populator_;
};

}  // namespace emsa
