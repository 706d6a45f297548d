// cuda_event.h — a CUDA event owned by the object holding it (the host tier's parts).
//
// Made once at Create, destroyed with its holder, so that the parts of the host tier can keep
// their events as plain members. Moving one moves ownership.
#pragma once

#include <utility>

#include "common/cuda_util.h"

#if EMSA_HAVE_CUDA

namespace emsa {

class OwnedEvent {
 public:
  OwnedEvent() = default;
  OwnedEvent(OwnedEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  OwnedEvent& operator=(OwnedEvent&& other) noexcept {
    std::swap(event_, other.event_);
    return *this;
  }
  OwnedEvent(const OwnedEvent&) = delete;
  OwnedEvent& operator=(const OwnedEvent&) = delete;
  ~OwnedEvent() {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
  }

  // cudaEventCreateWithFlags(flags) once (cudaEventDefault: timed, spinning).
  Status Create(unsigned flags) {
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event_, flags));
    return Status::Ok();
  }
  cudaEvent_t get() const { return event_; }
  explicit operator bool() const { return event_ != nullptr; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
