// host_tier_state.h — what the host tier's threads share: the caller's (Submit, Wait, ...), the
// worker and, for GPU-updated buckets under pacing, the streamer.
//
// Every field marked "under mu" is read and written with TierShared::mu held; the rest of a
// bucket is touched by one side at a time, ordered by the queue (the caller records its events
// in Submit, then the worker or the streamer reads them; BeginStep waits for both to drain
// before a bucket can be submitted again).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "emsa/update.h"
#include "engine/copy_engine.h"
#include "engine/host_tier_copies.h"
#include "engine/host_tier_stats.h"

namespace emsa {

struct TierBucket {
  std::vector<TensorUpdate> updates;  // its tensors, in creation order
  std::vector<void*> device_params;
  std::vector<int32_t> groups;
  std::vector<size_t> tensors;  // the tier's index of each (creation order): its step count
  // This step's Submit: which tensors have a gradient (non-null, or numel 0); the rest are not
  // copied, updated or uploaded. Written by Submit, read by whoever the queue hands b to.
  std::vector<uint8_t> present;
  bool all_present = true;
  int64_t settled = 0;         // step whose counts were last advanced for b (under mu)
  bool device_update = false;  // the GPU updates it (HostTierTensor::device_update)
  EngineEvent ready;           // on the compute stream: the gradients are final
  int64_t grad_bytes = 0;      // its gradients, on the device
  GradCopies grads;            // CPU-updated buckets: gradients down
  Uploads upload;              // parameters up; for every bucket, done() when they are there
  int64_t copied = 0;          // step whose gradient copies were last all enqueued (under mu)
  int64_t submitted = 0;       // step of the last Submit (under mu)
  int64_t uploaded = 0;        // step whose upload was last enqueued (under mu)
  bool h2d_timed = true;       // the last upload's time is in the stats (under mu)
  // This step's host times, seconds since its BeginStep (-1: not yet): Trace() (under mu).
  double t_submit = -1, t_start = -1, t_end = -1;
};

// The current step's verdict (gated steps): what the updates wait for. Under mu.
struct StepVerdict {
  bool gated = false;     // the step's updates wait for a release
  bool released = false;  // Release or ReleaseValues has been called
  // Release: the verdict is in device memory (the device path's kernels read its copy there);
  // the host learns it once the release's event completes (known).
  bool from_device = false;
  bool known = false;  // grad_multiplier and found_inf hold the verdict
  float grad_multiplier = 1.0f;
  bool found_inf = false;
  // Whether the step's updates may run (ungated, or released).
  bool open() const { return !gated || released; }
};

struct TierShared {
  std::mutex mu;
  std::condition_variable cv;
  int64_t step = 0;     // BeginStep count (under mu; written by the caller's thread only)
  bool stop = false;    // the tier is being destroyed (under mu)
  Status error;         // the first failure; the tier does nothing after it (under mu)
  int64_t pending = 0;  // submitted buckets whose upload is not yet enqueued (under mu)
  StatsRing stats;      // under mu
  std::chrono::steady_clock::time_point step_start;  // the current step's BeginStep
  std::atomic<int64_t> copies_total{0};              // buckets whose copies were all enqueued, ever
  StepVerdict verdict;                               // the current step's (under mu)
  bool last_skipped = false;  // the last step whose verdict is known was skipped (under mu)

  // Seconds since the current step's BeginStep.
  double Since() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
  }
  // Under mu: keeps the first error.
  void Fail(const Status& st) {
    if (!st.ok() && error.ok()) error = st;
  }
};

}  // namespace emsa
