// host_tier_impl.h — HostTier's state (HostTier::Impl), shared by the coordinator's two files:
// host_tier.cc (Create and the caller's side: Submit, Wait, BeginStep, ...) and
// host_tier_worker.cc (the worker that takes buckets from the queue and updates them on the
// CPU). Private to the engine. Every copy and event goes through `engine` (CUDA's in the
// product), so that all of it but the GPU-updated path builds and runs without CUDA.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "emsa/cpu_update.h"
#include "emsa/host_tier.h"
#include "engine/host_tier_device.h"
#include "engine/host_tier_state.h"

namespace emsa {

inline double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

inline constexpr size_t kNoBucket = ~size_t{0};

// What Create needs to know about the tensors once they are sorted into buckets.
struct TensorSummary {
  bool any_delta = false;               // some tensor takes the device-delta path
  bool any_device_update = false;       // some bucket is updated on the GPU
  DType state_dtype = DType::kFloat32;  // the GPU-updated tensors' moments (all alike)
  int64_t largest = 1;                  // elements of the largest GPU-updated tensor
};

struct HostTier::Impl {
  explicit Impl(size_t bucket_count) : buckets(bucket_count) {}
  ~Impl();

  CpuUpdater* updater = nullptr;
  CopyEngine* engine = nullptr;
  HostTierOptions options;
  StepOptions step_options;
  cudaStream_t d2h = nullptr, h2d = nullptr;
  std::vector<TierBucket> buckets;
  std::vector<HyperParams> hypers;
  std::vector<float> decays;       // per group, this step: 1 - lr*wd as the CPU kernels round it
  float* delta_staging = nullptr;  // device, delta_staging_elements floats (deltas only)
  TierShared shared;
  std::unique_ptr<DeviceUpdatePath> device;  // when some bucket is GPU-updated
  std::vector<int64_t> steps;  // per tensor, creation order: its step count (under mu)
  // The release: the step header copied here (pinned) and the event after it; verdict_mu
  // orders the one read of it (the worker's, or Synchronize's with the worker idle).
  DeviceStepHeader* pinned_header = nullptr;
  EngineEvent released;
  std::mutex verdict_mu;

  // The queue. Submitted buckets the worker has not taken, oldest first (capacity reserved at
  // Create; under mu).
  std::vector<size_t> waiting;
  std::vector<size_t> candidates;  // the worker's copy of `waiting`, also reserved
  // Pacing: the bucket the worker takes next, already out of `waiting`, whose first pieces it
  // copies down while it finishes the current one (worker thread only; kNoBucket: none).
  size_t next = kNoBucket;
  double choose_wait_seconds = 0.0;  // worker only: Choose blocked, charged to the next bucket
  int64_t held_bytes = 0;            // pacing: submitted gradients not yet enqueued (under mu)
  std::thread worker;

  // Create's steps.
  Status AddTensor(size_t i, const HostTierTensor& t, TensorSummary* summary);
  Status AddTensors(const HostTierTensor* tensors, size_t count, TensorSummary* summary);
  Status MakeDeltaStaging();
  Status InitBucket(TierBucket& b);

  // The caller's side.
  Status CheckSubmit(size_t bucket, const void* const* grads, size_t count, bool* after_upload,
                     bool* gated);
  bool HoldForPacing(TierBucket& b);
  Status CopyAtSubmit(size_t index, const void* const* grads, bool after_upload);
  // Under mu: bucket `index` is submitted in this step and joins the worker's queue.
  void JoinQueue(size_t index);
  // Under mu: the current step is gated and not yet released (what waits on it never returns
  // until then): kInvalidArgument for `call`, else Ok.
  Status CheckReleased(const char* call) const;
  // Bucket b's present tensors and their update's step (count + 1), for this Submit. Under mu.
  void MarkPresent(TierBucket& b, const void* const* grads);
  // The current step's verdict, read from the release's pinned header once its event has
  // completed (a gated, released step; the worker, or the caller with the worker idle).
  Status ReadVerdict();
  // Under mu, the workers idle: advances the counts of the present tensors of the step's
  // submitted buckets, unless it was skipped (reads the verdict first; may unlock meanwhile).
  Status Settle(std::unique_lock<std::mutex>& lock);
  Status Begin(const HyperParams* hypers, size_t group_count, bool gated,
               const int64_t* group_steps);
  // Under mu: blocks until the worker has no bucket left, or failed.
  void Drain(std::unique_lock<std::mutex>& lock) {
    shared.cv.wait(lock, [&] { return shared.pending == 0 || !shared.error.ok(); });
  }

  // The worker's side.
  void Run();
  Result<size_t> Choose(std::unique_lock<std::mutex>& lock);
  Result<size_t> TakeReady(size_t* oldest);
  cudaEvent_t Gate(const TierBucket& b) const;
  Status Process(size_t index, int64_t s, const StepOptions& options);
  Status Skip(size_t index, int64_t s);
  // The worker's verdict for a bucket it takes in step s: *options with its multiplier, *skip.
  Status Verdict(std::unique_lock<std::mutex>& lock, StepOptions* options, bool* skip);
  Status UpdateAsLanded(TierBucket& b, bool landed, int64_t s, const StepOptions& options,
                        double* cpu_seconds, double* wait_seconds);
  // StepRange over [first, last) of b's elements, the absent tensors left out.
  Status StepPresent(const TierBucket& b, const StepOptions& options, int64_t first, int64_t last);
  Status Feed(TierBucket& b, size_t consumed, int64_t s);
  Status EnqueuePiece(TierBucket& b, int64_t s);
  Status TimeUpload(TierBucket& b);
};

}  // namespace emsa
