// emsa/host_arena.h — the pinned host arena: one allocation per plan, state tensors are views.
//
// When pinned memory is asked for and a CUDA device is usable, the memory is page-locked by
// cudaHostAlloc (portable, never write-combined: the CPU reads state back every step, and
// write-combined memory is slow to read). Otherwise it is plain 2 MiB-aligned memory advised to
// transparent huge pages (fewer TLB misses while the CPU streams through state). Either way it
// is zero-filled once, in parallel when given a pool, and freed exactly once by the destructor.
// Nothing grows later.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "emsa/status.h"

namespace emsa {

class ThreadPool;

class HostArena {
 public:
  enum class Kind { kPinned, kPageable };
  // bytes must be in [1, 1 PiB] (else kInvalidArgument); a failed allocation is kOutOfMemory.
  // want_pinned=false never touches CUDA; want_pinned=true without a usable device (or in a
  // build without CUDA) falls back to pageable memory: kind() says which one was obtained.
  static Result<std::unique_ptr<HostArena>> Create(uint64_t bytes, bool want_pinned = true,
                                                   ThreadPool* zero_fill_pool = nullptr);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  void* data() const { return data_; }
  uint64_t size() const { return size_; }
  Kind kind() const { return kind_; }
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
  void* data_ = nullptr;
  uint64_t size_ = 0;
  Kind kind_ = Kind::kPageable;
};

}  // namespace emsa
