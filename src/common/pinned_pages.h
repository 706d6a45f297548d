// pinned_pages.h — host memory the device copies to and from, one implementation for the host
// arena and the profile's and HostLoad's buffers: mapped anonymously on 2 MiB boundaries, advised
// to transparent huge pages, populated (every page faulted in, in parallel on a pool, contents
// preserved), then page-locked with cudaHostRegister.
//
// Registering pages that already exist is several times faster than cudaHostAlloc, which
// allocates, zeroes and pins page by page. The memory is page-locked, portable (any context may
// copy from it) and not write-combined (the CPU reads it back), the kind the host tier copies
// from, so the copies the profile measures are the ones the host tier gets.
#pragma once

#include <cstdint>

#include "common/cuda_util.h"
#include "common/thread_pool.h"

namespace emsa {

// The page everything here is mapped, populated and locked in: a transparent huge page.
inline constexpr uint64_t kLargePageBytes = uint64_t{2} << 20;

// An anonymous mapping of whole large pages, starting on one.
struct MappedPages {
  void* data = nullptr;
  uint64_t bytes = 0;       // `bytes` asked for, rounded up to kLargePageBytes
  bool huge_pages = false;  // the kernel accepted MADV_HUGEPAGE (advice: base pages serve else)
};
// 0, or the errno of the failed mmap (out untouched). Nothing is resident yet.
int MapLargePages(uint64_t bytes, MappedPages* out);
void UnmapPages(const MappedPages& pages);

// Faults [p, p + bytes) in writable without changing what it holds: one MADV_POPULATE_WRITE
// where the kernel has it, else an atomic no-op write per base page, so that data another thread
// writes meanwhile survives. Fresh anonymous memory reads as zero already: what is missing is its
// pages, which the kernel hands over zeroed, a huge page at a time where it can. 0, or the errno
// that says why the pages cannot be had (ENOMEM, EFAULT).
int PopulatePages(void* p, uint64_t bytes);

// Runs fn(begin, end) over [0, bytes) in contiguous kLargePageBytes-grained shares, one per
// worker of `pool` (the calling thread alone where it is null), so that on a NUMA host each
// share's pages land near the thread that touched them.
template <typename Fn>
void ForLargePageShares(uint64_t bytes, ThreadPool* pool, Fn fn) {
  if (pool == nullptr || pool->size() <= 1) {
    fn(uint64_t{0}, bytes);
    return;
  }
  pool->ParallelFor(static_cast<int64_t>(bytes), static_cast<int64_t>(kLargePageBytes),
                    [&fn](int64_t begin, int64_t end) {
                      fn(static_cast<uint64_t>(begin), static_cast<uint64_t>(end));
                    });
}

// PopulatePages over [data, data + bytes) in ForLargePageShares; 0 or the first errno.
int PopulateInParallel(void* data, uint64_t bytes, ThreadPool* pool);

#if EMSA_HAVE_CUDA

// cudaHostRegister, portable, of pages that are resident already: the driver only pins and maps
// them. The caller unregisters (cudaHostUnregister) before unmapping.
cudaError_t RegisterPages(void* data, uint64_t bytes);

// A pinned buffer of its own: mapped, populated on the calling thread, registered; unregistered
// and unmapped by the destructor.
class PinnedPages {
 public:
  PinnedPages() = default;
  PinnedPages(const PinnedPages&) = delete;
  PinnedPages& operator=(const PinnedPages&) = delete;
  ~PinnedPages();

  // cudaErrorMemoryAllocation when the pages cannot be had; the registration's error otherwise.
  cudaError_t Allocate(size_t bytes);
  void* get() const { return pages_.data; }

 private:
  MappedPages pages_;
  bool registered_ = false;
};

#endif  // EMSA_HAVE_CUDA

}  // namespace emsa
