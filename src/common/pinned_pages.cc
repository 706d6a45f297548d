// pinned_pages.cc — large-page mappings, their population and their registration with CUDA.
#include "common/pinned_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL (then pages are touched)
#endif

namespace emsa {

int MapLargePages(uint64_t bytes, MappedPages* out) {
  const uint64_t rounded = (bytes + kLargePageBytes - 1) / kLargePageBytes * kLargePageBytes;
  // One large page more than needed, so that an aligned range can be cut out of it; the slack on
  // either side is unmapped at once.
  const uint64_t span = rounded + kLargePageBytes;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return errno;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kLargePageBytes - 1) / kLargePageBytes * kLargePageBytes;
  if (aligned > start) (void)munmap(raw, aligned - start);
  if (start + span > aligned + rounded) {
    (void)munmap(reinterpret_cast<void*>(aligned + rounded), start + span - (aligned + rounded));
  }
  out->data = reinterpret_cast<void*>(aligned);
  out->bytes = rounded;
  out->huge_pages = madvise(out->data, rounded, MADV_HUGEPAGE) == 0;
  return 0;
}

void UnmapPages(const MappedPages& pages) {
  if (pages.data != nullptr) (void)munmap(pages.data, pages.bytes);
}

int PopulatePages(void* p, uint64_t bytes) {
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno == EINVAL) break;                           // a kernel without it
    if (errno != EINTR && errno != EAGAIN) return errno;  // ENOMEM, EFAULT, EHWPOISON
  }
  auto* base = static_cast<unsigned char*>(p);
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  for (uint64_t at = 0; at < bytes; at += page) {
    __atomic_fetch_or(base + at, static_cast<unsigned char>(0), __ATOMIC_RELAXED);
  }
  return 0;
}

int PopulateInParallel(void* data, uint64_t bytes, ThreadPool* pool) {
  char* base = static_cast<char*>(data);
  std::atomic<int> error{0};
  ForLargePageShares(bytes, pool, [base, &error](uint64_t begin, uint64_t end) {
    const int e = PopulatePages(base + begin, end - begin);
    if (e != 0) error.store(e, std::memory_order_relaxed);
  });
  return error.load();
}

#if EMSA_HAVE_CUDA

cudaError_t RegisterPages(void* data, uint64_t bytes) {
  return cudaHostRegister(data, bytes, cudaHostRegisterPortable);
}

PinnedPages::~PinnedPages() {
  if (registered_) (void)cudaHostUnregister(pages_.data);
  UnmapPages(pages_);
}

cudaError_t PinnedPages::Allocate(size_t bytes) {
  if (MapLargePages(bytes, &pages_) != 0) return cudaErrorMemoryAllocation;
  if (PopulatePages(pages_.data, pages_.bytes) != 0) return cudaErrorMemoryAllocation;
  const cudaError_t e = RegisterPages(pages_.data, pages_.bytes);
  registered_ = e == cudaSuccess;
  return e;
}

#endif  // EMSA_HAVE_CUDA

}  // namespace emsa
