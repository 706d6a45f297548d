// pinned_pages.h — pinned host memory for the profile's and HostLoad's copies: mapped pages,
// large where the kernel offers them, filled, then registered with CUDA.
//
// Registering pages that already exist is several times faster than cudaHostAlloc, which
// allocates, zeroes and pins page by page: the measurement and the probe under load should not
// wait for their buffers. The memory is the same kind the host tier copies from (page-locked,
// portable, not write-combined), so the copies measured are the ones it gets. CUDA builds only.
#pragma once

#include "common/cuda_util.h"

#if EMSA_HAVE_CUDA

#include <sys/mman.h>

#include <cstddef>
#include <cstring>

namespace emsa::profile_internal {

class PinnedPages {
 public:
  PinnedPages() = default;
  PinnedPages(const PinnedPages&) = delete;
  PinnedPages& operator=(const PinnedPages&) = delete;
  ~PinnedPages() {
    if (registered_) (void)cudaHostUnregister(ptr_);
    if (ptr_ != nullptr) (void)munmap(ptr_, bytes_);
  }

  // cudaErrorMemoryAllocation when the pages cannot be had; the registration's error otherwise.
  cudaError_t Allocate(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return cudaErrorMemoryAllocation;
    ptr_ = p;
    bytes_ = bytes;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE);  // advice: a kernel without it is fine
#endif
    std::memset(p, 0, bytes);  // the pages exist before they are pinned
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    registered_ = e == cudaSuccess;
    return e;
  }

  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool registered_ = false;
};

}  // namespace emsa::profile_internal

#endif  // EMSA_HAVE_CUDA
