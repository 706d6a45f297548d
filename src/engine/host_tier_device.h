// host_tier_device.h — the host tier's GPU-updated path (HostTierTensor::device_update): a
// bucket's moments come up from the pinned host arena into device staging slots, a kernel
// updates the parameters and moments where they are (the CPU's bits), and the moments go back.
//
// Its own streams (moments up, kernels, moments down; the kernels' stream may be the caller's)
// and staging slots, used in turn. Runs are enqueued by Submit's caller or, under pacing, by
// the path's own streamer thread, which picks them as slots free up; one of the two only, so
// the slots need no lock. What it shares with the rest of the tier is in TierShared, under its
// mutex. CUDA builds only.
//
// Gated steps: a run's kernel must wait for the release on the GPU, and a stream can only wait
// for an event recorded before the wait is enqueued, so no run of a gated step is enqueued
// before the release: Submit defers them (returns at once) and the release enqueues them, or
// the streamer, which never blocks for a release (it waits on the tier's condition variable,
// which the release notifies), picks them up after it. Released from device memory, the
// kernels read the verdict from the path's own copy of the step header (made on the release's
// stream after the previous step's kernels have read theirs); released as values, the multiplier
// travels as a launch argument and a skipped step's runs are not enqueued at all.
#pragma once

#include "common/cuda_util.h"

#if EMSA_HAVE_CUDA

#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "emsa/host_tier.h"
#include "engine/cuda_event.h"
#include "engine/host_tier_state.h"

namespace emsa {

class DeviceUpdatePath {
 public:
  // buckets and shared belong to the tier and outlive the path.
  DeviceUpdatePath(const HostTierOptions& options, const StepOptions& step_options,
                   std::vector<TierBucket>* buckets, TierShared* shared);
  ~DeviceUpdatePath();  // joins the streamer (the tier has set stop), waits for the last copies
  DeviceUpdatePath(const DeviceUpdatePath&) = delete;
  DeviceUpdatePath& operator=(const DeviceUpdatePath&) = delete;

  // At Create: the staging slots for moments of `state_dtype`, the largest device-updated
  // tensor `largest` elements; the streams; each device-updated bucket's runs and events; and,
  // under pacing, the streamer.
  Status Init(DType state_dtype, int64_t largest);

  // Bucket `index` is submitted with its device gradients: enqueues its runs here, or under
  // pacing hands them to the streamer.
  Status Submit(size_t index, const void* const* grads, size_t count);
  // Waits on the host for every run's copies down and times the slots (the streamer is idle:
  // the tier has drained).
  Status Synchronize();
  // The release on `stream` (caller's thread): after the previous step's kernels, copies the
  // step header into the path's own device copy (CopyHeader); then the kernels' stream waits
  // for the release's event (WaitRelease), before any run of the step is enqueued.
  Status CopyHeader(const DeviceStepHeader* device_header, cudaStream_t stream);
  Status WaitRelease(cudaEvent_t released);
  // Without the streamer: enqueues the runs Submit deferred in a gated step (highest bucket
  // first), now that it is released, or marks them done when it is skipped by value.
  Status EnqueueDeferred();
  // Joins the streamer once the tier has set stop (idempotent).
  void Join();

  cudaStream_t kernels() const { return kernels_; }

 private:
  // Elements [first, first + count) of tensor `tensor`, updated through one staging slot.
  struct Span {
    size_t tensor = 0;
    int64_t first = 0, count = 0;
  };
  struct Runs {  // one device-updated bucket's
    std::vector<Span> spans;
    size_t next = 0;                 // the next to enqueue (under mu)
    bool started = false;            // a run of this step is enqueued (the first waits more)
    bool deferred = false;           // submitted in a gated step before its release (under mu)
    OwnedEvent written_back;         // its moments are back on the host
    std::vector<const void*> grads;  // Submit's device pointers
  };
  // A staging slot; its moments have come up (in_done), been updated (updated) and gone back
  // down (free).
  struct Slot {
    void* exp_avg = nullptr;
    void* exp_avg_sq = nullptr;
    OwnedEvent in_done, updated, free;
    OwnedEvent up_start;  // before its moments' copies up (with in_done: their time)
    bool used = false;    // `updated` has been recorded
    bool timed = true;    // the last run's copies up are in the stats
    int64_t step = 0;     // the step of the last run through it
  };

  // What a run's kernel applies: the multiplier, as an argument or (header) read on the device
  // with found_inf; skip: enqueue nothing (a step skipped by value).
  struct RunVerdict {
    const DeviceStepHeader* header = nullptr;
    float grad_multiplier = 1.0f;
    bool skip = false;
  };

  Status MakeSlots(DType state_dtype, int64_t largest);
  void CutRuns(TierBucket& b, Runs& runs) const;
  void TimeSlot(Slot& slot);
  RunVerdict VerdictLocked() const;  // the current step's, under mu
  // The first span from r whose tensor is present this step (spans.size(): none).
  size_t NextPresent(size_t index, size_t r) const;
  Status EnqueueRun(size_t index, size_t r, int64_t s, const RunVerdict& v);
  // After a bucket's last run: its done and written-back events.
  Status FinishRuns(size_t index);
  // Every present run of bucket `index`, then FinishRuns (nothing when v.skip).
  Status EnqueueBucket(size_t index, int64_t s, const RunVerdict& v);
  // Under mu: bucket `index` is done for step s (Wait may return).
  void MarkDone(size_t index, int64_t s);
  size_t PickBucket() const;
  void Stream();

  HostTierOptions options_;
  StepOptions step_options_;
  std::vector<TierBucket>& buckets_;
  TierShared& shared_;
  std::vector<Runs> runs_;  // per bucket (empty for CPU-updated ones)
  std::vector<Slot> slots_;
  size_t next_slot_ = 0;
  void* staging_ = nullptr;             // the slots' device memory
  DeviceStepHeader* header_ = nullptr;  // device: the released step header the kernels read
  OwnedEvent kernels_mark_;             // on kernels_ at a release: the kernels before it
  cudaStream_t up_ = nullptr, kernels_ = nullptr, down_ = nullptr;
  bool own_kernels_ = true;      // kernels_ was made here (not options.device_update_stream)
  std::vector<size_t> waiting_;  // submitted buckets with runs left, for the streamer (under mu)
  std::thread streamer_;
};

}  // namespace emsa

#else  // !EMSA_HAVE_CUDA

#include "emsa/host_tier.h"
#include "engine/host_tier_state.h"

namespace emsa {

// Without CUDA no bucket is updated on the device: Create refuses such tensors before making
// one, so that the tier's other files need no guards of their own.
class DeviceUpdatePath {
 public:
  DeviceUpdatePath(const HostTierOptions&, const StepOptions&, std::vector<TierBucket>*,
                   TierShared*) {}
  Status Init(DType, int64_t) { return Status::Unsupported("device-updated tensors need CUDA"); }
  Status Submit(size_t, const void* const*, size_t) { return Init(DType::kFloat32, 0); }
  Status Synchronize() { return Status::Ok(); }
  Status CopyHeader(const DeviceStepHeader*, cudaStream_t) { return Status::Ok(); }
  Status WaitRelease(cudaEvent_t) { return Status::Ok(); }
  Status EnqueueDeferred() { return Status::Ok(); }
  cudaStream_t kernels() const { return nullptr; }
};

}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
