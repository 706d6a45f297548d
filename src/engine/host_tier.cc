// host_tier.cc — HostTier: the D2H -> CPU -> H2D pipeline of the host tier (emsa/host_tier.h).
//
// Threads: the caller's thread (Submit, Wait, BeginStep, ...) and one worker. Everything the two
// share is under mu_: the queue, each bucket's submitted/uploaded step, the error, the stats.
// A bucket's events and staging buffers are touched by one side at a time: the caller records
// the D2H events in Submit, the worker reads them and records the H2D events; BeginStep waits
// for the worker to drain before a bucket can be submitted again.
#include "emsa/host_tier.h"

#include <algorithm>
#include <string>

#include "emsa/cpu_update.h"

namespace emsa {

int HostTierThreads(int cores) { return std::max(cores - 1, 1); }

bool HostTierAppliesDelta(OptimizerKind optimizer, DType param_dtype, DType grad_dtype,
                          bool has_master) {
  return optimizer != OptimizerKind::kAdam && param_dtype == DType::kFloat32 &&
         grad_dtype == DType::kFloat32 && !has_master;
}

int64_t HostTier::StreamStagingBytes(const HostTierOptions& options, DType state_dtype,
                                     int64_t largest) {
  return int64_t{options.stream_slots} * std::min(options.stream_piece_elements, largest) *
         static_cast<int64_t>(DTypeSize(state_dtype)) * StateCount(options.optimizer);
}

}  // namespace emsa

#if EMSA_HAVE_CUDA

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "common/cuda_util.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cuda/apply_delta.h"
#include "kernels/cuda/stream_update.h"

namespace emsa {

namespace {

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

Status ElapsedSeconds(cudaEvent_t start, cudaEvent_t end, double* out) {
  float ms = 0.0f;
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, end));
  *out = ms * 1e-3;
  return Status::Ok();
}

}  // namespace

struct HostTier::Impl {
  // One host-to-device copy: part of a tensor's parameter or, under device_delta, part of its
  // change (into the device staging buffer), then applied to `apply` with group's decay.
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    float* apply = nullptr;  // device parameters p = p * decay + dst, bytes / 4 of them
    int32_t group = 0;
  };
  // Elements [first, last) of a bucket (counted across its tensors), updated together and then
  // uploaded by copies [copy_begin, copy_end) between the two events.
  struct Piece {
    int64_t first = 0, last = 0;
    size_t copy_begin = 0, copy_end = 0;
    cudaEvent_t start = nullptr, end = nullptr;
  };
  // Part of tensor `tensor`'s gradient: `bytes` at byte `offset`, copied from the device buffer
  // Submit is given into the staging buffer.
  struct GradCopy {
    size_t tensor;
    size_t offset;
    size_t bytes;
  };
  // Elements [first, last) of a bucket's gradients, copied down together by grad_copies
  // [copy_begin, copy_end); `landed` is recorded on the D2H stream after them.
  struct GradPiece {
    int64_t first = 0, last = 0;
    size_t copy_begin = 0, copy_end = 0;
    cudaEvent_t landed = nullptr;
    cudaEvent_t start = nullptr;  // paced_copies only: the copy's own time, not its wait
  };
  // device_update: elements [first, first + count) of tensor `tensor`, updated on the device
  // through one staging slot.
  struct Span {
    size_t tensor = 0;
    int64_t first = 0, count = 0;
  };
  struct Bucket {
    std::vector<TensorUpdate> updates;
    std::vector<void*> device_params;
    std::vector<int32_t> groups;
    std::vector<Piece> pieces;  // one covering the bucket unless upload_piece_elements
    std::vector<Copy> copies;
    std::vector<GradPiece> grad_pieces;  // one covering the bucket unless grad_piece_elements
    std::vector<GradCopy> grad_copies;
    cudaEvent_t ready = nullptr;            // on the compute stream: the gradients are final
    cudaEvent_t d2h_start = nullptr;        // unpaced: the stats time the copies from here
    std::vector<const void*> device_grads;  // paced_copies: Submit's pointers, copied later
    bool device_update = false;             // the GPU updates it (HostTierTensor::device_update)
    std::vector<Span> runs;                 // device_update: its runs, in order
    size_t next_run = 0;                    // device_update: the next run to enqueue (under mu)
    cudaEvent_t written_back = nullptr;     // device_update: its moments are back on the host
    size_t enqueued = 0;                    // paced_copies: grad pieces enqueued this step
    int64_t grad_bytes = 0;                 // the bucket's gradients, on the device
    int64_t copied = 0;     // step whose gradient copies were last all enqueued (under mu)
    int64_t submitted = 0;  // step of the last Submit
    int64_t uploaded = 0;   // step whose upload was last enqueued
    bool h2d_timed = true;  // the last upload's time is in the stats
    // The last piece's end: the whole upload is done.
    cudaEvent_t uploaded_event() const { return pieces.back().end; }
    // The last gradient piece has landed: all of them have (one stream, in order).
    cudaEvent_t d2h_end() const { return grad_pieces.back().landed; }
    // This step's host times, seconds since its BeginStep (-1: not yet): Trace().
    double t_submit = -1, t_start = -1, t_end = -1;
  };

  CpuUpdater* updater = nullptr;
  HostTierOptions options;
  StepOptions step_options;
  cudaStream_t d2h = nullptr, h2d = nullptr;
  std::vector<Bucket> buckets;
  std::vector<HyperParams> hypers;
  std::vector<float> decays;  // per group, this step: 1 - lr*wd as the CPU kernels round it
  float* staging = nullptr;   // device, delta_staging_elements floats (device_delta only)

  // device_update: staging slots used in turn; per slot, its moments have come up (in_done),
  // been updated (updated) and gone back down (free). Submit alone touches these.
  struct Slot {
    void* exp_avg = nullptr;
    void* exp_avg_sq = nullptr;
    cudaEvent_t in_done = nullptr, updated = nullptr, free = nullptr;
    cudaEvent_t up_start = nullptr;  // before its moments' copies up (with in_done: their time)
    bool used = false;               // `updated` has been recorded
    bool timed = true;               // the last run's copies up are in the stats
    int64_t step = 0;                // the step of the last run through it
  };

  // A slot's last copies up into the stats of their step, if not counted yet and done. Whoever
  // enqueues runs (the streamer, or Submit without it), or the caller with the streamer idle.
  void TimeSlot(Slot& slot) {
    if (slot.timed) return;
    if (cudaEventQuery(slot.in_done) != cudaSuccess) return;  // not done (or failed): later
    double seconds = 0.0;
    if (!ElapsedSeconds(slot.up_start, slot.in_done, &seconds).ok()) return;
    slot.timed = true;
    std::lock_guard<std::mutex> lock(mu);
    if (slot.step > step - static_cast<int64_t>(stats.size())) {
      StatsOf(slot.step).stream_up_s += seconds;
    }
  }
  std::vector<Slot> slots;
  size_t next_slot = 0;
  void* stream_staging = nullptr;  // the slots' device memory
  // The tier's own streams for device-updated buckets: moments up, kernels, moments down.
  cudaStream_t up = nullptr, kernels = nullptr, down = nullptr;
  bool own_kernels = true;  // `kernels` was made here (not HostTierOptions::device_update_stream)
  std::vector<size_t> gpu_waiting;  // device-updated buckets submitted with runs left (under mu)
  std::thread streamer;             // enqueues their runs (Stream())

  // The upload of bucket b's tensor k, elements [lo, hi): fn(copy) for each copy, in order. A
  // tensor under device_delta goes through the staging buffer a part at a time.
  template <typename Fn>
  void ForEachUpload(const Bucket& b, size_t k, int64_t lo, int64_t hi, Fn&& fn) const {
    const TensorUpdate& u = b.updates[k];
    if (u.delta == nullptr) {
      const size_t size = DTypeSize(u.param_dtype);
      fn(Copy{static_cast<char*>(b.device_params[k]) + lo * size,
              static_cast<const char*>(u.param) + lo * size, static_cast<size_t>(hi - lo) * size});
      return;
    }
    const int64_t part = options.delta_staging_elements;
    for (int64_t at = lo; at < hi; at += part) {
      fn(Copy{staging, u.delta + at, static_cast<size_t>(std::min(hi - at, part)) * sizeof(float),
              static_cast<float*>(b.device_params[k]) + at, b.groups[k]});
    }
  }

  std::mutex mu;
  std::condition_variable cv;
  // Submitted buckets the worker has not taken, oldest first (capacity reserved at Create).
  std::vector<size_t> waiting;
  std::vector<size_t> candidates;  // the worker's copy of `waiting`, also reserved
  int64_t pending = 0;             // submitted, upload not yet enqueued
  static constexpr size_t kNone = ~size_t{0};
  // paced_copies: the bucket the worker takes next, already out of `waiting`, whose first
  // pieces it copies down while it finishes the current one (worker thread only; kNone: none).
  size_t next = kNone;
  double choose_wait_seconds = 0.0;      // worker only: Choose blocked, charged to the next bucket
  std::atomic<int64_t> copies_total{0};  // buckets whose copies were all enqueued, ever
  int64_t held_bytes = 0;  // paced_copies: submitted gradients not yet enqueued (under mu)
  int64_t step = 0;
  bool stop = false;
  Status error;
  std::vector<HostTierStepStats> stats;  // ring, indexed by step % history
  std::thread worker;
  std::chrono::steady_clock::time_point step_start;

  double Since() const { return Seconds(std::chrono::steady_clock::now() - step_start); }

  HostTierStepStats& StatsOf(int64_t s) { return stats[static_cast<size_t>(s) % stats.size()]; }

  // Under mu: an H2D time for step s, and whether that completes its stats.
  void AddUpload(int64_t s, double seconds) {
    if (s <= step - static_cast<int64_t>(stats.size())) return;  // fell out of the history
    HostTierStepStats& st = StatsOf(s);
    st.h2d_s += seconds;
    ++uploads_timed[static_cast<size_t>(s) % stats.size()];
    st.complete = uploads_timed[static_cast<size_t>(s) % stats.size()] == st.buckets;
  }
  std::vector<int64_t> uploads_timed;

  // Times bucket b's last upload once it has finished (waits for it). Caller holds no lock.
  Status TimeUpload(Bucket& b) {
    int64_t s;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (b.h2d_timed || b.uploaded == 0) return Status::Ok();
      s = b.uploaded;
    }
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b.uploaded_event()));
    double seconds = 0.0;
    for (const Piece& piece : b.pieces) {
      double piece_seconds = 0.0;
      EMSA_RETURN_IF_ERROR(ElapsedSeconds(piece.start, piece.end, &piece_seconds));
      seconds += piece_seconds;
    }
    std::lock_guard<std::mutex> lock(mu);
    if (!b.h2d_timed) {
      b.h2d_timed = true;
      AddUpload(s, seconds);
    }
    return Status::Ok();
  }

  // With worker_upload_elements: what the pool's threads need to enqueue the uploads of what they
  // have just written, and the first CUDA error any of them met.
  struct WorkerUploads {
    Impl* m = nullptr;
    Bucket* b = nullptr;
    std::atomic<int> error{0};
  };
  static void UploadWritten(void* context, size_t tensor, int64_t begin, int64_t end) {
    auto* u = static_cast<WorkerUploads*>(context);
    thread_local int current_device = -1;  // the pool's threads start on device 0
    cudaError_t err = cudaSuccess;
    if (current_device != u->m->options.device) {
      err = cudaSetDevice(u->m->options.device);
      if (err == cudaSuccess) current_device = u->m->options.device;
    }
    if (err == cudaSuccess) {  // no deltas here: Create refuses them with worker uploads
      u->m->ForEachUpload(*u->b, tensor, begin, end, [&](const Copy& copy) {
        err = cudaMemcpyAsync(copy.dst, copy.src, copy.bytes, cudaMemcpyHostToDevice, u->m->h2d);
      });
    }
    if (err != cudaSuccess) {
      int none = 0;
      u->error.compare_exchange_strong(none, static_cast<int>(err));
    }
  }

  // device_update: enqueues run r of bucket b through the next staging slot: moments up (after
  // the slot's last write-back, and for the bucket's first run after its own last one), the
  // kernel (the bucket's first after its gradients are final on the compute stream), moments
  // down. Recording an event only moves what later waits on it refer to, and every wait below
  // is enqueued after the record it is meant for, so the slots' events can be reused in turn.
  // One thread calls this: the streamer when there is one, else Submit's caller.
  Status EnqueueRun(Bucket& b, size_t r, int64_t s) {
    const Span& run = b.runs[r];
    const TensorUpdate& u = b.updates[run.tensor];
    Slot& slot = slots[next_slot];
    next_slot = (next_slot + 1) % slots.size();
    const size_t state = DTypeSize(u.state_dtype);
    const size_t bytes = static_cast<size_t>(run.count) * state;
    const size_t at = static_cast<size_t>(run.first) * state;
    TimeSlot(slot);  // what it last carried, before its events move on
    EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(up, slot.free, 0));
    if (r == 0 && b.uploaded > 0) {  // written_back was recorded by its last update
      EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(up, b.written_back, 0));
    }
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.up_start, up));
    slot.step = s;
    slot.timed = false;
    EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.exp_avg, static_cast<char*>(u.exp_avg) + at,
                                              bytes, cudaMemcpyHostToDevice, up));
    if (u.exp_avg_sq != nullptr) {
      EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.exp_avg_sq,
                                                static_cast<char*>(u.exp_avg_sq) + at, bytes,
                                                cudaMemcpyHostToDevice, up));
    }
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.in_done, up));
    EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(kernels, slot.in_done, 0));
    if (r == 0) EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(kernels, b.ready, 0));
    cuda::StreamRun k;
    k.param = static_cast<float*>(b.device_params[run.tensor]) + run.first;
    k.grad = static_cast<const float*>(b.device_grads[run.tensor]) + run.first;
    k.exp_avg = slot.exp_avg;
    k.exp_avg_sq = u.exp_avg_sq != nullptr ? slot.exp_avg_sq : nullptr;
    k.first = run.first;
    k.count = run.count;
    EMSA_RETURN_IF_ERROR(cuda::LaunchStreamUpdate(
        options.optimizer, u.state_dtype, options.rounding == Rounding::kStochastic, options.seed,
        ToDeviceScalars(*u.hyper, u.step), step_options.grad_multiplier, k, kernels));
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.updated, kernels));
    slot.used = true;
    EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(down, slot.updated, 0));
    EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(u.exp_avg) + at, slot.exp_avg,
                                              bytes, cudaMemcpyDeviceToHost, down));
    if (u.exp_avg_sq != nullptr) {
      EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(u.exp_avg_sq) + at,
                                                slot.exp_avg_sq, bytes, cudaMemcpyDeviceToHost,
                                                down));
    }
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.free, down));
    if (r + 1 == b.runs.size()) {
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.uploaded_event(), kernels));
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.written_back, down));
    }
    return Status::Ok();
  }

  // device_update: of the submitted buckets with runs left, the one the next forward needs
  // first (the highest index) among those whose gradients are final, else the oldest (lowest
  // index: final first). Streamer only; caller holds mu.
  size_t PickDeviceBucket() {
    size_t oldest = kNone, ready = kNone;
    for (size_t c : gpu_waiting) {
      if (oldest == kNone || c < oldest) oldest = c;
      if ((ready == kNone || c > ready) && cudaEventQuery(buckets[c].ready) == cudaSuccess) {
        ready = c;
      }
    }
    return ready != kNone ? ready : oldest;
  }

  // The streamer: enqueues the device-updated buckets' runs with at most one run per staging
  // slot in flight, so that what comes next is chosen when a slot frees up: during backward the
  // buckets as their gradients become final, after it what the next forward needs first (as
  // the worker chooses for the CPU). A failed bucket is marked done so no Wait blocks on it.
  void Stream() {
    Status set = CudaStatus(cudaSetDevice(options.device), "cudaSetDevice (host tier streamer)");
    std::unique_lock<std::mutex> lock(mu);
    if (!set.ok() && error.ok()) error = set;
    for (;;) {
      cv.wait(lock, [&] { return stop || !gpu_waiting.empty(); });
      if (gpu_waiting.empty()) return;  // stop, and nothing left
      Status st = error;
      const Slot& slot = slots[next_slot];
      if (st.ok() && slot.used) {  // the slot's last kernel is done: choose now, not earlier
        lock.unlock();
        st = CudaStatus(cudaEventSynchronize(slot.updated), "cudaEventSynchronize (slot)");
        lock.lock();
      }
      const size_t index = PickDeviceBucket();
      Bucket& b = buckets[index];
      const size_t r = b.next_run;
      if (st.ok()) {
        lock.unlock();
        st = EnqueueRun(b, r, b.submitted);
        lock.lock();
      }
      if (!st.ok() && error.ok()) error = st;
      if (error.ok() && r + 1 < b.runs.size()) {
        b.next_run = r + 1;
        continue;
      }
      gpu_waiting.erase(std::find(gpu_waiting.begin(), gpu_waiting.end(), index));
      b.uploaded = b.submitted;
      b.copied = b.submitted;
      copies_total.fetch_add(1, std::memory_order_release);
      --pending;
      cv.notify_all();
    }
  }

  // paced_copies: enqueues bucket b's next gradient piece on the D2H stream (the first after
  // the compute stream's event, and under device_delta after the last upload, which read the
  // staging buffer the copy overwrites).
  Status EnqueuePiece(Bucket& b, int64_t s) {
    const size_t i = b.enqueued;
    if (i == 0) {
      EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(d2h, b.ready, 0));
      if (staging != nullptr && b.uploaded > 0) {
        EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(d2h, b.uploaded_event(), 0));
      }
    }
    const GradPiece& piece = b.grad_pieces[i];
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(piece.start, d2h));
    for (size_t c = piece.copy_begin; c < piece.copy_end; ++c) {
      const GradCopy& copy = b.grad_copies[c];
      EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          static_cast<char*>(const_cast<void*>(b.updates[copy.tensor].grad)) + copy.offset,
          static_cast<const char*>(b.device_grads[copy.tensor]) + copy.offset, copy.bytes,
          cudaMemcpyDeviceToHost, d2h));
    }
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(piece.landed, d2h));
    if (++b.enqueued == b.grad_pieces.size()) {
      {
        std::lock_guard<std::mutex> lock(mu);
        b.copied = s;
        held_bytes -= b.grad_bytes;
        copies_total.fetch_add(1, std::memory_order_release);
      }
      cv.notify_all();
    }
    return Status::Ok();
  }

  // paced_copies: bucket b's first `consumed` pieces are updated; keeps paced_copies pieces
  // enqueued beyond them, from b and then from the bucket taken next.
  Status Feed(Bucket& b, size_t consumed, int64_t s) {
    const size_t window = static_cast<size_t>(options.paced_copies);
    size_t ahead = b.enqueued - consumed;
    if (next != kNone) ahead += buckets[next].enqueued;
    while (ahead < window) {
      if (b.enqueued < b.grad_pieces.size()) {
        EMSA_RETURN_IF_ERROR(EnqueuePiece(b, s));
      } else {
        if (next == kNone) {  // take the next bucket early (never blocks)
          EMSA_ASSIGN_OR_RETURN(next, TakeReady(nullptr));
          if (next == kNone) break;
        }
        Bucket& n = buckets[next];
        if (n.enqueued == n.grad_pieces.size()) break;
        EMSA_RETURN_IF_ERROR(EnqueuePiece(n, s));
      }
      ++ahead;
    }
    return Status::Ok();
  }

  // The worker's part for one bucket submitted in step s. When its gradients have all landed
  // it is updated in one pass per upload piece; when some are still on their way (the CPU
  // caught up with the D2H stream, as at the start of a step) it follows them, gradient piece
  // by gradient piece, instead of idling until the last has landed.
  Status Process(size_t index, int64_t s) {
    Bucket& b = buckets[index];
    const bool paced = options.paced_copies > 0;
    bool landed = false;  // paced: follow the pieces, copying more as each is updated
    if (!paced) {
      const cudaError_t q = cudaEventQuery(b.d2h_end());
      if (q != cudaSuccess && q != cudaErrorNotReady) {
        return CudaStatus(q, "cudaEventQuery (gradient copy)");
      }
      landed = q == cudaSuccess;
    }
    // The previous upload reads what the update is about to write: it must be done.
    EMSA_RETURN_IF_ERROR(TimeUpload(b));
    if (paced) EMSA_RETURN_IF_ERROR(Feed(b, 0, s));
    b.t_start = Since();
    const auto started = std::chrono::steady_clock::now();
    double cpu_seconds = 0.0;
    double wait_seconds = 0.0;  // blocked until a gradient piece had landed
    WorkerUploads uploads;
    uploads.m = this;
    uploads.b = &b;
    RangeDone done;
    done.fn = &UploadWritten;
    done.context = &uploads;
    done.elements = options.worker_upload_elements;
    const RangeDone* by_workers = options.worker_upload_elements > 0 ? &done : nullptr;
    size_t g = 0;  // the gradient piece holding `first`
    for (const Piece& piece : b.pieces) {
      // Worker uploads start during the update: the H2D time is then the piece's span.
      if (by_workers != nullptr) EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(piece.start, h2d));
      for (int64_t first = piece.first; first < piece.last;) {
        int64_t last = piece.last;
        if (!landed) {
          while (b.grad_pieces[g].last <= first) ++g;
          const auto w0 = std::chrono::steady_clock::now();
          EMSA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b.grad_pieces[g].landed));
          wait_seconds += Seconds(std::chrono::steady_clock::now() - w0);
          last = std::min(last, b.grad_pieces[g].last);
        }
        const auto t0 = std::chrono::steady_clock::now();
        EMSA_RETURN_IF_ERROR(updater->StepRange(b.updates.data(), b.updates.size(), step_options,
                                                first, last, by_workers));
        cpu_seconds += Seconds(std::chrono::steady_clock::now() - t0);
        if (paced && last == b.grad_pieces[g].last) EMSA_RETURN_IF_ERROR(Feed(b, g + 1, s));
        if (const int err = uploads.error.load()) {
          return CudaStatus(static_cast<cudaError_t>(err), "cudaMemcpyAsync (parameter upload)");
        }
        first = last;
      }
      if (by_workers == nullptr) {
        EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(piece.start, h2d));
        for (size_t k = piece.copy_begin; k < piece.copy_end; ++k) {
          const Copy& copy = b.copies[k];
          EMSA_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(copy.dst, copy.src, copy.bytes, cudaMemcpyHostToDevice, h2d));
          if (copy.apply != nullptr) {
            EMSA_RETURN_IF_ERROR(
                cuda::LaunchApplyDelta(copy.apply, static_cast<const float*>(copy.dst),
                                       static_cast<int64_t>(copy.bytes / sizeof(float)),
                                       decays[static_cast<size_t>(copy.group)], h2d));
          }
        }
      }
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(piece.end, h2d));
    }
    b.t_end = Since();
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b.d2h_end()));  // done long since
    double d2h_seconds = 0.0;
    if (!paced) {
      EMSA_RETURN_IF_ERROR(ElapsedSeconds(b.d2h_start, b.d2h_end(), &d2h_seconds));
    } else {  // the copies' own times: the span between them is the pacing's wait
      for (const GradPiece& piece : b.grad_pieces) {
        double piece_seconds = 0.0;
        EMSA_RETURN_IF_ERROR(ElapsedSeconds(piece.start, piece.landed, &piece_seconds));
        d2h_seconds += piece_seconds;
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    HostTierStepStats& st = StatsOf(s);
    st.d2h_s += d2h_seconds;
    st.cpu_s += cpu_seconds;
    st.grad_wait_s += wait_seconds + choose_wait_seconds;
    st.worker_s += Seconds(std::chrono::steady_clock::now() - started) + choose_wait_seconds;
    choose_wait_seconds = 0.0;
    b.uploaded = s;
    b.h2d_timed = false;
    return Status::Ok();
  }

  // What a bucket waits for before the worker may take it: its first gradient piece on the host
  // or, under paced_copies (the worker copies them itself), its gradients final on the device.
  cudaEvent_t Gate(const Bucket& b) const {
    return options.paced_copies > 0 ? b.ready : b.grad_pieces.front().landed;
  }

  // Of the waiting buckets whose Gate has passed, the one the next forward needs first (the
  // highest index: buckets are in gradient-ready order, the reverse of the forward's), taken out
  // of `waiting`; kNone when none has. *oldest (if given): the oldest waiting bucket, kNone when
  // none waits. Caller holds no lock; only the worker takes buckets out, so what it saw stays.
  Result<size_t> TakeReady(size_t* oldest) {
    {
      std::lock_guard<std::mutex> lock(mu);
      candidates.assign(waiting.begin(), waiting.end());
    }
    if (oldest != nullptr) *oldest = candidates.empty() ? kNone : candidates.front();
    std::sort(candidates.begin(), candidates.end(), std::greater<size_t>());
    for (size_t c : candidates) {
      const cudaError_t q = cudaEventQuery(Gate(buckets[c]));
      if (q == cudaErrorNotReady) continue;
      if (q != cudaSuccess) return CudaStatus(q, "cudaEventQuery (bucket gate)");
      std::lock_guard<std::mutex> lock(mu);
      waiting.erase(std::find(waiting.begin(), waiting.end(), c));
      return c;
    }
    return kNone;
  }

  // Which waiting bucket to update next (waiting is not empty): TakeReady's, else wait for the
  // oldest's gate (copies finish in submission order) and choose again. Updating in arrival
  // order instead would leave the embedding, which the next forward needs first, for last, and
  // forbid any overlap of CPU updates with the next forward.
  Result<size_t> Choose(std::unique_lock<std::mutex>& lock) {
    lock.unlock();
    for (;;) {
      size_t oldest = kNone;
      Result<size_t> taken = TakeReady(&oldest);
      if (!taken.ok() || *taken != kNone) {
        lock.lock();
        return taken;
      }
      const auto w0 = std::chrono::steady_clock::now();
      const Status st = CudaStatus(cudaEventSynchronize(Gate(buckets[oldest])),
                                   "cudaEventSynchronize (bucket gate)");
      choose_wait_seconds += Seconds(std::chrono::steady_clock::now() - w0);
      if (!st.ok()) {
        lock.lock();
        return st;
      }
    }
  }

  void Run() {
    Status set = CudaStatus(cudaSetDevice(options.device), "cudaSetDevice (host tier worker)");
    std::unique_lock<std::mutex> lock(mu);
    if (!set.ok() && error.ok()) error = set;
    for (;;) {
      cv.wait(lock, [&] { return stop || !waiting.empty() || next != kNone; });
      if (waiting.empty() && next == kNone) return;  // stop, and nothing left
      size_t index = waiting.empty() ? next : waiting.front();
      int64_t s = step;
      bool failed = !error.ok();
      if (next != kNone) {  // taken already (its first pieces are on their way)
        index = next;
        next = kNone;
      } else if (!failed) {
        Result<size_t> chosen = Choose(lock);
        if (chosen.ok()) {
          index = *chosen;
        } else {
          error = chosen.status();
          failed = true;
        }
      }
      if (failed) {
        auto it = std::find(waiting.begin(), waiting.end(), index);
        if (it != waiting.end()) waiting.erase(it);
      }
      lock.unlock();
      Status st = failed ? Status::Ok() : Process(index, s);
      lock.lock();
      if (!st.ok() && error.ok()) error = st;
      if (!error.ok()) buckets[index].uploaded = s;  // so no Wait() blocks on it forever
      --pending;
      cv.notify_all();
    }
  }

  // Cuts [0, total) every `step` elements (0: not at all) where CpuUpdater::StepRange accepts
  // a cut; calls cut(first, last) for each part, in order.
  template <typename Cut>
  static void CutElements(const Bucket& b, int64_t step, Cut&& cut) {
    int64_t total = 0;
    for (const TensorUpdate& t : b.updates) total += t.numel;
    for (int64_t first = 0;;) {
      const int64_t last =
          step == 0 || total - first <= step
              ? total
              : CpuUpdater::Aligned(b.updates.data(), b.updates.size(), first + step);
      cut(first, last);
      if (last >= total) break;
      first = last;
    }
  }

  // Calls fn(k, lo, hi) for each tensor k of bucket b holding some of the bucket's elements
  // [first, last): its elements [lo, hi).
  template <typename Fn>
  static void ForEachTensorRange(const Bucket& b, int64_t first, int64_t last, Fn&& fn) {
    int64_t start = 0;
    for (size_t k = 0; k < b.updates.size(); start += b.updates[k].numel, ++k) {
      const int64_t lo = std::max(first, start) - start;
      const int64_t hi = std::min(last, start + b.updates[k].numel) - start;
      if (lo < hi) fn(k, lo, hi);
    }
  }

  // Bucket b's gradient pieces, upload pieces and their copies (at Create): one piece of each
  // for the whole bucket, or cuts every grad_piece_elements / upload_piece_elements.
  void CutPieces(Bucket& b) {
    if (b.device_update) {  // runs within one tensor and one 2^32 block of its indices
      const int64_t piece = options.stream_piece_elements;
      for (size_t k = 0; k < b.updates.size(); ++k) {
        for (int64_t first = 0; first < b.updates[k].numel;) {
          const int64_t block_end = (first / (int64_t{1} << 32) + 1) << 32;
          const int64_t last = std::min({first + piece, b.updates[k].numel, block_end});
          b.runs.push_back({k, first, last - first});
          first = last;
        }
      }
    }
    CutElements(b, options.grad_piece_elements, [&b](int64_t first, int64_t last) {
      GradPiece piece;
      piece.first = first;
      piece.last = last;
      piece.copy_begin = b.grad_copies.size();
      ForEachTensorRange(b, first, last, [&b](size_t k, int64_t lo, int64_t hi) {
        const size_t size = DTypeSize(b.updates[k].grad_dtype);
        b.grad_copies.push_back(
            {k, static_cast<size_t>(lo) * size, static_cast<size_t>(hi - lo) * size});
      });
      piece.copy_end = b.grad_copies.size();
      b.grad_pieces.push_back(piece);
    });
    CutElements(b, options.upload_piece_elements, [&](int64_t first, int64_t last) {
      Piece piece;
      piece.first = first;
      piece.last = last;
      piece.copy_begin = b.copies.size();
      ForEachTensorRange(b, first, last, [&](size_t k, int64_t lo, int64_t hi) {
        ForEachUpload(b, k, lo, hi, [&b](const Copy& copy) { b.copies.push_back(copy); });
      });
      piece.copy_end = b.copies.size();
      b.pieces.push_back(piece);
    });
  }

  // Under mu: bucket `index` is submitted in this step and joins the worker's queue.
  void Queue(size_t index) {
    Bucket& b = buckets[index];
    b.submitted = step;
    b.t_submit = Since();
    waiting.push_back(index);
    ++pending;
    ++StatsOf(step).buckets;
    StatsOf(step).complete = false;
  }

  // Under mu: blocks until the worker has no bucket left, or failed.
  void Drain(std::unique_lock<std::mutex>& lock) {
    cv.wait(lock, [&] { return pending == 0 || !error.ok(); });
  }

  ~Impl() {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return pending == 0; });
      stop = true;
    }
    cv.notify_all();
    if (worker.joinable()) worker.join();
    if (streamer.joinable()) streamer.join();
    if (down != nullptr) (void)cudaStreamSynchronize(down);  // the device updates' last copies
    if (staging != nullptr) (void)cudaFree(staging);
    if (stream_staging != nullptr) (void)cudaFree(stream_staging);
    for (cudaStream_t st : {up, own_kernels ? kernels : nullptr, down}) {
      if (st != nullptr) (void)cudaStreamDestroy(st);
    }
    for (const Slot& slot : slots) {
      for (cudaEvent_t e : {slot.in_done, slot.updated, slot.free, slot.up_start}) {
        if (e != nullptr) (void)cudaEventDestroy(e);
      }
    }
    for (Bucket& b : buckets) {
      for (cudaEvent_t e : {b.ready, b.d2h_start, b.written_back}) {
        if (e != nullptr) (void)cudaEventDestroy(e);
      }
      for (const GradPiece& piece : b.grad_pieces) {
        for (cudaEvent_t e : {piece.landed, piece.start}) {
          if (e != nullptr) (void)cudaEventDestroy(e);
        }
      }
      for (const Piece& piece : b.pieces) {
        for (cudaEvent_t e : {piece.start, piece.end}) {
          if (e != nullptr) (void)cudaEventDestroy(e);
        }
      }
    }
  }
};

Result<std::unique_ptr<HostTier>> HostTier::Create(CpuUpdater* updater,
                                                   const HostTierTensor* tensors, size_t count,
                                                   size_t bucket_count, size_t group_count,
                                                   cudaStream_t d2h_stream, cudaStream_t h2d_stream,
                                                   const HostTierOptions& options) {
  if (updater == nullptr) return Status::InvalidArgument("updater is null");
  if (tensors == nullptr && count > 0) return Status::InvalidArgument("tensors is null");
  if (bucket_count == 0 || group_count == 0) {
    return Status::InvalidArgument("bucket_count and group_count must be at least 1");
  }
  if (options.history == 0) return Status::InvalidArgument("options.history must be >= 1");
  if (options.upload_piece_elements != 0 && options.upload_piece_elements < 64) {
    return Status::InvalidArgument("options.upload_piece_elements is " +
                                   std::to_string(options.upload_piece_elements) +
                                   "; use 0 (upload each bucket whole) or at least 64");
  }
  if (options.worker_upload_elements != 0 && options.worker_upload_elements < 64) {
    return Status::InvalidArgument("options.worker_upload_elements is " +
                                   std::to_string(options.worker_upload_elements) +
                                   "; use 0 (the worker uploads each piece) or at least 64");
  }
  if (options.grad_piece_elements != 0 && options.grad_piece_elements < 64) {
    return Status::InvalidArgument("options.grad_piece_elements is " +
                                   std::to_string(options.grad_piece_elements) +
                                   "; use 0 (copy each bucket's gradients whole) or at least 64");
  }
  if (options.device_delta && options.worker_upload_elements != 0) {
    return Status::InvalidArgument(
        "options.device_delta and options.worker_upload_elements cannot be combined (the pool's "
        "threads would share the device staging buffer); set one of them");
  }
  if (options.paced_copies < 0 || (options.paced_copies > 0 && options.grad_piece_elements == 0)) {
    return Status::InvalidArgument(
        "options.paced_copies is " + std::to_string(options.paced_copies) +
        (options.paced_copies < 0 ? "; use 0 (copies enqueued at Submit) or a piece count >= 1"
                                  : " with grad_piece_elements 0; pacing copies a piece at a "
                                    "time: set grad_piece_elements too (e.g. 1 Mi)"));
  }
  if (options.stream_piece_elements < 64 || options.stream_slots < 1) {
    return Status::InvalidArgument(
        "options.stream_piece_elements is " + std::to_string(options.stream_piece_elements) +
        " and options.stream_slots " + std::to_string(options.stream_slots) +
        "; use at least 64 elements and 1 slot (defaults 8 Mi and 3)");
  }
  if (options.device_delta && options.delta_staging_elements < 64) {
    return Status::InvalidArgument("options.delta_staging_elements is " +
                                   std::to_string(options.delta_staging_elements) +
                                   "; use at least 64 (default 4 Mi)");
  }
  auto impl = std::make_unique<Impl>();
  impl->updater = updater;
  impl->options = options;
  impl->step_options.optimizer = options.optimizer;
  impl->step_options.rounding = options.rounding;
  impl->step_options.seed = options.seed;
  impl->d2h = d2h_stream;
  impl->h2d = h2d_stream;
  impl->hypers.assign(group_count, HyperParams{});
  impl->decays.assign(group_count, 1.0f);
  bool any_delta = false;
  bool any_device_update = false;
  DType state_dtype = DType::kFloat32;
  int64_t largest = 1;  // elements of the largest device-updated tensor
  impl->buckets.resize(bucket_count);
  for (size_t i = 0; i < count; ++i) {
    const HostTierTensor& t = tensors[i];
    const std::string where = "tensors[" + std::to_string(i) + "]";
    if (t.bucket < 0 || static_cast<size_t>(t.bucket) >= bucket_count) {
      return Status::InvalidArgument(where + ".bucket is " + std::to_string(t.bucket) +
                                     "; it must be in [0, " + std::to_string(bucket_count) + ")");
    }
    if (t.group < 0 || static_cast<size_t>(t.group) >= group_count) {
      return Status::InvalidArgument(where + ".group is " + std::to_string(t.group) +
                                     "; it must be in [0, " + std::to_string(group_count) + ")");
    }
    if (t.update.numel > 0 && t.device_param == nullptr) {
      return Status::InvalidArgument(where + ".device_param is null");
    }
    TensorUpdate u = t.update;
    u.step = 1;
    u.hyper = &impl->hypers[static_cast<size_t>(t.group)];
    u.delta = nullptr;
    Impl::Bucket& into = impl->buckets[static_cast<size_t>(t.bucket)];
    if (!into.updates.empty() && into.device_update != t.device_update) {
      return Status::InvalidArgument(where + ".device_update differs from the rest of bucket " +
                                     std::to_string(t.bucket) +
                                     "; a bucket is updated on the device or on the CPU, whole");
    }
    into.device_update = t.device_update;
    if (t.device_update) {
      if (u.param_dtype != DType::kFloat32 || u.grad_dtype != DType::kFloat32 ||
          u.master != nullptr ||
          (u.state_dtype != DType::kFloat32 && u.state_dtype != DType::kBFloat16)) {
        return Status::InvalidArgument(
            where +
            ".device_update needs an fp32 parameter without a master, an fp32 gradient "
            "and fp32 or bf16 moments; update this tensor on the CPU instead");
      }
      if (any_device_update && u.state_dtype != state_dtype) {
        return Status::InvalidArgument(
            "device-updated tensors must all have moments of one dtype (their staging is "
            "shared)");
      }
      any_device_update = true;
      state_dtype = u.state_dtype;
      largest = std::max(largest, u.numel);
    }
    if (options.device_delta && !t.device_update && u.numel > 0 &&
        HostTierAppliesDelta(options.optimizer, u.param_dtype, u.grad_dtype, u.master != nullptr)) {
      u.delta = static_cast<float*>(const_cast<void*>(u.grad));  // in place of the gradient
      any_delta = true;
    }
    Status valid = updater->Validate(&u, 1, impl->step_options);
    if (!valid.ok()) return valid.Annotate(where);
    into.updates.push_back(u);
    into.device_params.push_back(t.device_param);
    into.groups.push_back(t.group);
  }
  for (size_t i = 0; i < bucket_count; ++i) {
    if (impl->buckets[i].updates.empty()) {
      return Status::InvalidArgument("bucket " + std::to_string(i) + " has no tensors");
    }
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  if (any_delta) {
    void* staging = nullptr;
    const size_t bytes = static_cast<size_t>(options.delta_staging_elements) * sizeof(float);
    const cudaError_t err = cudaMalloc(&staging, bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::OutOfMemory("the host tier's device staging buffer for deltas (" +
                                 std::to_string(bytes) + " bytes): " + cudaGetErrorString(err) +
                                 "; lower options.delta_staging_elements or turn device_delta off");
    }
    impl->staging = static_cast<float*>(staging);
  }
  if (any_device_update) {
    const int64_t bytes = StreamStagingBytes(options, state_dtype, largest);
    void* slab = nullptr;
    const cudaError_t err = cudaMalloc(&slab, static_cast<size_t>(bytes));
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::OutOfMemory("the host tier's device staging for device-updated tensors (" +
                                 std::to_string(bytes) + " bytes): " + cudaGetErrorString(err) +
                                 "; lower options.stream_piece_elements or stream_slots, or "
                                 "update those tensors on the CPU");
    }
    impl->stream_staging = slab;
    const size_t moment = static_cast<size_t>(std::min(options.stream_piece_elements, largest)) *
                          DTypeSize(state_dtype);
    const bool two = StateCount(options.optimizer) == 2;
    impl->slots.resize(static_cast<size_t>(options.stream_slots));
    char* at = static_cast<char*>(slab);
    for (Impl::Slot& slot : impl->slots) {
      slot.exp_avg = at;
      at += moment;
      if (two) {
        slot.exp_avg_sq = at;
        at += moment;
      }
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.free, cudaEventDisableTiming));
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&slot.in_done));  // timed: the copies up
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&slot.up_start));
      // The streamer waits on it: blocking sync, so it sleeps instead of taking a core.
      EMSA_CUDA_RETURN_IF_ERROR(
          cudaEventCreateWithFlags(&slot.updated, cudaEventDisableTiming | cudaEventBlockingSync));
    }
    impl->kernels = options.device_update_stream;
    impl->own_kernels = impl->kernels == nullptr;
    for (cudaStream_t* st : {&impl->up, &impl->kernels, &impl->down}) {
      if (*st == nullptr) {
        EMSA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(st, cudaStreamNonBlocking));
      }
    }
  }
  for (Impl::Bucket& b : impl->buckets) impl->CutPieces(b);
  for (Impl::Bucket& b : impl->buckets) {
    // Blocking sync: under paced_copies the worker may wait on it.
    EMSA_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&b.ready, cudaEventDisableTiming | cudaEventBlockingSync));
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&b.d2h_start));
    if (b.device_update) {
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&b.written_back, cudaEventDisableTiming));
    }
    b.device_grads.assign(b.updates.size(), nullptr);
    for (const TensorUpdate& u : b.updates) {
      b.grad_bytes += u.numel * static_cast<int64_t>(DTypeSize(u.grad_dtype));
    }
    // The worker waits on these: blocking sync lets it sleep instead of spinning on a core the
    // CPU pool and the Python thread launching the forward both need.
    for (Impl::GradPiece& piece : b.grad_pieces) {
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&piece.landed, cudaEventBlockingSync));
      if (options.paced_copies > 0) EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&piece.start));
    }
    for (Impl::Piece& piece : b.pieces) {
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&piece.start));
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&piece.end, cudaEventBlockingSync));
    }
  }
  impl->waiting.reserve(bucket_count);
  impl->gpu_waiting.reserve(bucket_count);
  impl->candidates.reserve(bucket_count);
  impl->stats.assign(options.history, HostTierStepStats{});
  impl->uploads_timed.assign(options.history, 0);
  Impl* raw = impl.get();
  impl->worker = std::thread([raw] { raw->Run(); });
  if (any_device_update && options.paced_copies > 0) {
    impl->streamer = std::thread([raw] { raw->Stream(); });
  }
  return std::unique_ptr<HostTier>(new HostTier(std::move(impl)));
}

HostTier::HostTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostTier::~HostTier() = default;

size_t HostTier::bucket_count() const { return impl_->buckets.size(); }
size_t HostTier::bucket_size(size_t bucket) const {
  return bucket < impl_->buckets.size() ? impl_->buckets[bucket].updates.size() : 0;
}

Status HostTier::BeginStep(const HyperParams* hypers, const int64_t* steps, size_t group_count) {
  Impl& m = *impl_;
  if (group_count != m.hypers.size() || hypers == nullptr || steps == nullptr) {
    return Status::InvalidArgument("BeginStep needs " + std::to_string(m.hypers.size()) +
                                   " groups' hyperparameters and steps, got " +
                                   std::to_string(group_count));
  }
  for (size_t g = 0; g < group_count; ++g) {
    if (steps[g] < 1) {
      return Status::InvalidArgument("steps[" + std::to_string(g) + "] is " +
                                     std::to_string(steps[g]) + "; it must be >= 1");
    }
  }
  std::unique_lock<std::mutex> lock(m.mu);
  m.Drain(lock);
  EMSA_RETURN_IF_ERROR(m.error);
  for (size_t g = 0; g < group_count; ++g) {
    m.hypers[g] = hypers[g];
    TensorUpdate probe;  // the decay exactly as the CPU kernels round it
    probe.hyper = &m.hypers[g];
    probe.step = steps[g];
    m.decays[g] = cpu::MakeUpdateArgs(probe, m.step_options).decay;
  }
  for (Impl::Bucket& b : m.buckets) {
    for (size_t k = 0; k < b.updates.size(); ++k) {
      b.updates[k].step = steps[static_cast<size_t>(b.groups[k])];
    }
  }
  ++m.step;
  m.step_start = std::chrono::steady_clock::now();
  for (Impl::Bucket& b : m.buckets) b.t_submit = b.t_start = b.t_end = -1;
  HostTierStepStats& st = m.StatsOf(m.step);
  st = HostTierStepStats{};
  st.step = m.step;
  m.uploads_timed[static_cast<size_t>(m.step) % m.stats.size()] = 0;
  return Status::Ok();
}

Status HostTier::Submit(size_t bucket, const void* const* grads, size_t count,
                        cudaStream_t compute) {
  Impl& m = *impl_;
  if (bucket >= m.buckets.size()) {
    return Status::InvalidArgument("bucket " + std::to_string(bucket) + " does not exist (" +
                                   std::to_string(m.buckets.size()) + " buckets)");
  }
  Impl::Bucket& b = m.buckets[bucket];
  if (count != b.updates.size() || (grads == nullptr && count > 0)) {
    return Status::InvalidArgument("bucket " + std::to_string(bucket) + " holds " +
                                   std::to_string(b.updates.size()) + " tensors; got " +
                                   std::to_string(count) + " gradients");
  }
  bool after_upload = false;  // under device_delta: the last upload read the staging buffer
  {
    std::lock_guard<std::mutex> lock(m.mu);
    EMSA_RETURN_IF_ERROR(m.error);
    if (m.step == 0) return Status::InvalidArgument("Submit before the first BeginStep");
    after_upload = m.staging != nullptr && b.uploaded > 0;
    if (b.submitted == m.step) {
      return Status::InvalidArgument("bucket " + std::to_string(bucket) +
                                     " was submitted already in this step");
    }
  }
  for (size_t k = 0; k < count; ++k) {
    if (grads[k] == nullptr && b.updates[k].numel > 0) {
      return Status::InvalidArgument("bucket " + std::to_string(bucket) + ": gradient " +
                                     std::to_string(k) + " is null");
    }
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.ready, compute));
  if (b.device_update) {
    std::copy(grads, grads + count, b.device_grads.begin());
    // Under paced_copies the streamer enqueues its runs (the caller keeps the gradients until
    // then); else they are enqueued here, in submission order.
    const bool streamed = m.streamer.joinable() && !b.runs.empty();
    Status st;
    for (size_t r = 0; !streamed && r < b.runs.size() && st.ok(); ++r)
      st = m.EnqueueRun(b, r, m.step);
    {
      std::lock_guard<std::mutex> lock(m.mu);
      if (!st.ok() && m.error.ok()) m.error = st;
      b.submitted = m.step;
      b.t_submit = m.Since();
      b.next_run = 0;
      ++m.StatsOf(m.step).device_buckets;
      if (streamed) {
        m.gpu_waiting.push_back(bucket);
        ++m.pending;
      } else {
        b.uploaded = b.copied = m.step;
        m.copies_total.fetch_add(1, std::memory_order_release);
      }
    }
    m.cv.notify_all();
    return st;
  }
  bool paced = m.options.paced_copies > 0;
  if (paced) {
    std::lock_guard<std::mutex> lock(m.mu);
    const int64_t limit = m.options.paced_hold_bytes;
    if (limit >= 0 && m.held_bytes + b.grad_bytes > limit) {
      paced = false;  // copied now: holding it would pass the device memory allowed
      b.enqueued = b.grad_pieces.size();
    } else {
      m.held_bytes += b.grad_bytes;
    }
  }
  if (paced) {  // the worker copies them, a few pieces ahead of the CPU
    std::copy(grads, grads + count, b.device_grads.begin());
    {
      std::lock_guard<std::mutex> lock(m.mu);
      b.enqueued = 0;
      m.Queue(bucket);
    }
    m.cv.notify_all();
    return Status::Ok();
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(m.d2h, b.ready, 0));
  if (after_upload) {
    // Under device_delta the last upload read this bucket's deltas from the gradient staging
    // buffer the copies below overwrite (the forward's wait on it usually orders them already).
    EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(m.d2h, b.uploaded_event(), 0));
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.d2h_start, m.d2h));
  for (const Impl::GradPiece& piece : b.grad_pieces) {
    if (piece.start != nullptr) EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(piece.start, m.d2h));
    for (size_t c = piece.copy_begin; c < piece.copy_end; ++c) {
      const Impl::GradCopy& copy = b.grad_copies[c];
      EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          static_cast<char*>(const_cast<void*>(b.updates[copy.tensor].grad)) + copy.offset,
          static_cast<const char*>(grads[copy.tensor]) + copy.offset, copy.bytes,
          cudaMemcpyDeviceToHost, m.d2h));
    }
    EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(piece.landed, m.d2h));
  }
  {
    std::lock_guard<std::mutex> lock(m.mu);
    b.copied = m.step;  // before the count moves: a caller that sees it sees this too
    m.copies_total.fetch_add(1, std::memory_order_release);
    m.Queue(bucket);
  }
  m.cv.notify_all();
  return Status::Ok();
}

Status HostTier::Wait(size_t bucket, cudaStream_t stream) {
  Impl& m = *impl_;
  if (bucket >= m.buckets.size()) {
    return Status::InvalidArgument("bucket " + std::to_string(bucket) + " does not exist");
  }
  Impl::Bucket& b = m.buckets[bucket];
  {
    std::unique_lock<std::mutex> lock(m.mu);
    auto ready = [&] { return !m.error.ok() || b.uploaded >= b.submitted; };
    if (!ready()) {
      auto t0 = std::chrono::steady_clock::now();
      m.cv.wait(lock, ready);
      m.StatsOf(m.step).wait_s += Seconds(std::chrono::steady_clock::now() - t0);
    }
    EMSA_RETURN_IF_ERROR(m.error);
    if (b.uploaded == 0) return Status::Ok();
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, b.uploaded_event(), 0));
  return Status::Ok();
}

Status HostTier::WaitGradsCopied(cudaStream_t stream) {
  Impl& m = *impl_;
  int64_t s;
  {
    std::unique_lock<std::mutex> lock(m.mu);
    s = m.step;
    // Under paced_copies the worker enqueues the copies: wait until it has (their events are
    // recorded), or failed.
    m.cv.wait(lock, [&] {
      if (!m.error.ok()) return true;
      for (const Impl::Bucket& b : m.buckets) {
        if (b.submitted == s && b.copied != s) return false;
      }
      return true;
    });
    EMSA_RETURN_IF_ERROR(m.error);
  }
  for (Impl::Bucket& b : m.buckets) {
    if (b.submitted == s && s > 0) {  // device_update: the kernels are what read them
      EMSA_CUDA_RETURN_IF_ERROR(
          cudaStreamWaitEvent(stream, b.device_update ? b.uploaded_event() : b.d2h_end(), 0));
    }
  }
  return Status::Ok();
}

Status HostTier::Synchronize() {
  Impl& m = *impl_;
  {
    std::unique_lock<std::mutex> lock(m.mu);
    m.Drain(lock);
    EMSA_RETURN_IF_ERROR(m.error);
  }
  for (Impl::Bucket& b : m.buckets) EMSA_RETURN_IF_ERROR(m.TimeUpload(b));
  if (m.down != nullptr) {  // its last copies follow every device update enqueued
    EMSA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.down));
    for (Impl::Slot& slot : m.slots) m.TimeSlot(slot);  // the streamer is idle: drained
  }
  return Status::Ok();
}

cudaStream_t HostTier::update_stream() const { return impl_->kernels; }

bool HostTier::BucketCopiesEnqueued(size_t bucket) const {
  Impl& m = *impl_;
  if (bucket >= m.buckets.size()) return false;
  std::lock_guard<std::mutex> lock(m.mu);
  const Impl::Bucket& b = m.buckets[bucket];
  return b.copied == b.submitted || !m.error.ok();  // a failed tier enqueues no more
}

int64_t HostTier::copies_enqueued() const {
  return impl_->copies_total.load(std::memory_order_acquire);
}

size_t HostTier::Trace(double* submit, double* start, double* end, size_t count) const {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  const size_t n = std::min(count, m.buckets.size());
  for (size_t b = 0; b < n; ++b) {
    submit[b] = m.buckets[b].t_submit;
    start[b] = m.buckets[b].t_start;
    end[b] = m.buckets[b].t_end;
  }
  return n;
}

size_t HostTier::Stats(int64_t first, HostTierStepStats* out, size_t capacity) const {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  int64_t oldest = m.step - static_cast<int64_t>(m.stats.size()) + 1;
  if (first < oldest) first = oldest;
  if (first < 1) first = 1;
  size_t n = 0;
  for (int64_t s = first; s <= m.step && n < capacity; ++s) out[n++] = m.StatsOf(s);
  return n;
}

}  // namespace emsa

#else  // !EMSA_HAVE_CUDA

namespace emsa {

struct HostTier::Impl {};

Result<std::unique_ptr<HostTier>> HostTier::Create(CpuUpdater*, const HostTierTensor*, size_t,
                                                   size_t, size_t, cudaStream_t, cudaStream_t,
                                                   const HostTierOptions&) {
  return Status::Unsupported(
      "the host tier for CUDA parameters needs a CUDA build of emsa (nvcc was not found when "
      "it was built)");
}
HostTier::HostTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostTier::~HostTier() = default;
Status HostTier::BeginStep(const HyperParams*, const int64_t*, size_t) {
  return Status::Unsupported("no CUDA");
}
Status HostTier::Submit(size_t, const void* const*, size_t, cudaStream_t) {
  return Status::Unsupported("no CUDA");
}
Status HostTier::Wait(size_t, cudaStream_t) { return Status::Unsupported("no CUDA"); }
Status HostTier::WaitGradsCopied(cudaStream_t) { return Status::Unsupported("no CUDA"); }
Status HostTier::Synchronize() { return Status::Unsupported("no CUDA"); }
size_t HostTier::Stats(int64_t, HostTierStepStats*, size_t) const { return 0; }
bool HostTier::BucketCopiesEnqueued(size_t) const { return false; }
int64_t HostTier::copies_enqueued() const { return 0; }
size_t HostTier::Trace(double*, double*, double*, size_t) const { return 0; }
size_t HostTier::bucket_count() const { return 0; }
size_t HostTier::bucket_size(size_t) const { return 0; }
cudaStream_t HostTier::update_stream() const { return nullptr; }

}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
