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
