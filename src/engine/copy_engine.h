// copy_engine.h — what the host tier's scheduling core asks of the copy engine: events (record,
// wait, query, synchronize, elapsed time), async copies on a stream, the device-delta kernel and
// its device staging buffer, pinned host memory for the release of a gated step.
//
// The product's engine is CUDA's (CudaCopyEngine: each call is the CUDA runtime call it names).
// Tests pass one of their own (tests/cpp/fake_copy_engine.h: copies on threads, events kept
// honestly), so the core's ordering, pacing and waiting run, and are tested, without a GPU.
// Streams and events are CUDA's handle types; an engine that is not CUDA's gives its own objects
// those types and is the only one to look inside them. Every call may come from any of the
// tier's threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "emsa/status.h"

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

namespace emsa {

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;

  // The device later calls on this thread work on.
  virtual Status SetDevice(int device) = 0;
  // timed: ElapsedSeconds may read it; blocking: Synchronize sleeps instead of spinning.
  virtual Status CreateEvent(bool timed, bool blocking, cudaEvent_t* out) = 0;
  virtual void DestroyEvent(cudaEvent_t event) = 0;
  // The event completes once everything enqueued on `stream` before it has.
  virtual Status Record(cudaEvent_t event, cudaStream_t stream) = 0;
  // Work enqueued on `stream` after this waits for the event's last record (as of this call).
  virtual Status StreamWait(cudaStream_t stream, cudaEvent_t event) = 0;
  // *done: the event's last record has completed (true for one never recorded).
  virtual Status Query(cudaEvent_t event, const char* what, bool* done) = 0;
  // Blocks the calling thread until the event's last record has completed.
  virtual Status Synchronize(cudaEvent_t event, const char* what) = 0;
  // Seconds between two completed timed events.
  virtual Status ElapsedSeconds(cudaEvent_t start, cudaEvent_t end, double* out) = 0;
  // Pinned host memory from and to device memory, in `stream`'s order.
  virtual Status CopyToHost(void* dst, const void* src, size_t bytes, cudaStream_t stream) = 0;
  virtual Status CopyToDevice(void* dst, const void* src, size_t bytes, cudaStream_t stream) = 0;
  // param[i] = param[i] * decay + delta[i] for i < n, on the device, in `stream`'s order.
  virtual Status ApplyDelta(float* param, const float* delta, int64_t n, float decay,
                            cudaStream_t stream) = 0;
  // Device memory (kOutOfMemory with the engine's reason when there is none).
  virtual Status AllocateDevice(size_t bytes, void** out) = 0;
  virtual void FreeDevice(void* ptr) = 0;
  // Pinned host memory, which CopyToHost may fill from device memory (the release of a gated
  // step copies the device's step header there, records an event after it and waits for it).
  virtual Status AllocatePinned(size_t bytes, void** out) = 0;
  virtual void FreePinned(void* ptr) = 0;
};

// CUDA's engine (one for the process); without CUDA, one that refuses every call with
// kUnsupported (so callers check their arguments first and fail at the first CUDA call).
CopyEngine* CudaCopyEngine();

// An event of `engine` owned by the object holding it: made once at Create, destroyed with its
// holder, so that the parts of the host tier keep their events as plain members. Moving one
// moves ownership.
class EngineEvent {
 public:
  EngineEvent() = default;
  EngineEvent(EngineEvent&& other) noexcept
      : engine_(other.engine_), event_(std::exchange(other.event_, nullptr)) {}
  EngineEvent& operator=(EngineEvent&& other) noexcept {
    std::swap(engine_, other.engine_);
    std::swap(event_, other.event_);
    return *this;
  }
  EngineEvent(const EngineEvent&) = delete;
  EngineEvent& operator=(const EngineEvent&) = delete;
  ~EngineEvent() {
    if (event_ != nullptr) engine_->DestroyEvent(event_);
  }

  Status Create(CopyEngine* engine, bool timed, bool blocking) {
    engine_ = engine;
    return engine->CreateEvent(timed, blocking, &event_);
  }
  cudaEvent_t get() const { return event_; }
  explicit operator bool() const { return event_ != nullptr; }

 private:
  CopyEngine* engine_ = nullptr;
  cudaEvent_t event_ = nullptr;
};

}  // namespace emsa
