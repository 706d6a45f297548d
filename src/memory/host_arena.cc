// host_arena.cc — one host allocation per plan: cudaHostAlloc'd (pinned) when asked and a CUDA
// device can use it, else 2 MiB-aligned memory on transparent huge pages; zero-filled once and
// freed once with the matching call.
#include "emsa/host_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "common/cuda_util.h"
#include "common/thread_pool.h"

namespace emsa {
namespace {

constexpr uint64_t kHugePage = uint64_t{2} << 20;
constexpr uint64_t kMaxBytes = uint64_t{1} << 50;  // 1 PiB: larger is a units mistake

// Writing every page now, rather than on first use in a step, moves the page faults out of the
// step; with a pool, each worker touches a contiguous share, so on a NUMA host the pages land
// near the threads that will update them.
void ZeroFill(void* data, uint64_t bytes, ThreadPool* pool) {
  char* base = static_cast<char*>(data);
  if (pool == nullptr || pool->size() <= 1) {
    std::memset(base, 0, bytes);
    return;
  }
  pool->ParallelFor(static_cast<int64_t>(bytes), static_cast<int64_t>(kHugePage),
                    [base](int64_t begin, int64_t end) {
                      std::memset(base + begin, 0, static_cast<size_t>(end - begin));
                    });
}

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
  return pages > 0 && page_size > 0 ? static_cast<uint64_t>(pages) * page_size : 0;
}

}  // namespace

Result<std::unique_ptr<HostArena>> HostArena::Create(uint64_t bytes, bool want_pinned,
                                                     ThreadPool* zero_fill_pool) {
  if (bytes == 0 || bytes > kMaxBytes) {
    return Status::InvalidArgument("host arena size must be between 1 byte and 1 PiB, got " +
                                   std::to_string(bytes) + " bytes");
  }
  // Overcommit would let a larger plain allocation succeed, and the zero fill would then meet
  // the OOM killer instead of returning an error.
  const uint64_t physical = PhysicalMemoryBytes();
  if (physical != 0 && bytes > physical) {
    return Status::OutOfMemory("a host arena of " + std::to_string(bytes) +
                               " bytes exceeds this machine's physical memory (" +
                               std::to_string(physical) + " bytes); lower the host budget");
  }
  std::unique_ptr<HostArena> arena(new HostArena());
  arena->size_ = bytes;

#if EMSA_HAVE_CUDA
  if (want_pinned && CudaDeviceUsable()) {
    // Portable: any context may copy from it. Not write-combined: the CPU reads state back
    // every step, and reads from write-combined memory are uncached.
    cudaError_t err = cudaHostAlloc(&arena->data_, bytes, cudaHostAllocPortable);
    if (err != cudaSuccess) {
      arena->data_ = nullptr;
      (void)cudaGetLastError();
      if (err == cudaErrorMemoryAllocation) {
        return Status::OutOfMemory(
            "cannot allocate a pinned host arena of " + std::to_string(bytes) +
            " bytes; lower the host budget or raise the locked-memory limit");
      }
      return CudaStatus(err, "cudaHostAlloc for the host arena");
    }
    arena->kind_ = Kind::kPinned;
    ZeroFill(arena->data_, bytes, zero_fill_pool);
    return arena;
  }
#endif

  // aligned_alloc wants a size that is a multiple of the alignment.
  const uint64_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  arena->data_ = std::aligned_alloc(kHugePage, rounded);
  if (arena->data_ == nullptr) {
    return Status::OutOfMemory("cannot allocate a host arena of " + std::to_string(bytes) +
                               " bytes; lower the host budget or free host memory");
  }
  arena->kind_ = Kind::kPageable;
  // Huge pages: fewer TLB misses while the CPU streams through state. Advice only.
  (void)madvise(arena->data_, rounded, MADV_HUGEPAGE);
  ZeroFill(arena->data_, bytes, zero_fill_pool);
  return arena;
}

HostArena::~HostArena() {
  if (data_ == nullptr) return;
#if EMSA_HAVE_CUDA
  if (kind_ == Kind::kPinned) {
    (void)cudaFreeHost(data_);
    return;
  }
#endif
  std::free(data_);
}

}  // namespace emsa
