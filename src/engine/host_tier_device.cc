// host_tier_device.cc — DeviceUpdatePath (host_tier_device.h).
#include "engine/host_tier_device.h"

#if EMSA_HAVE_CUDA

#include <algorithm>
#include <string>

#include "kernels/cuda/stream_update.h"

namespace emsa {

namespace {

constexpr size_t kNone = ~size_t{0};

}  // namespace

DeviceUpdatePath::DeviceUpdatePath(const HostTierOptions& options, const StepOptions& step_options,
                                   std::vector<TierBucket>* buckets, TierShared* shared)
    : options_(options), step_options_(step_options), buckets_(*buckets), shared_(*shared) {}

DeviceUpdatePath::~DeviceUpdatePath() {
  Join();
  if (down_ != nullptr) (void)cudaStreamSynchronize(down_);  // the device updates' last copies
  if (staging_ != nullptr) (void)cudaFree(staging_);
  if (header_ != nullptr) (void)cudaFree(header_);
  for (cudaStream_t st : {up_, own_kernels_ ? kernels_ : nullptr, down_}) {
    if (st != nullptr) (void)cudaStreamDestroy(st);
  }
}

void DeviceUpdatePath::Join() {
  if (streamer_.joinable()) streamer_.join();
}

Status DeviceUpdatePath::Init(DType state_dtype, int64_t largest) {
  EMSA_RETURN_IF_ERROR(MakeSlots(state_dtype, largest));
  kernels_ = options_.device_update_stream;
  own_kernels_ = kernels_ == nullptr;
  for (cudaStream_t* st : {&up_, &kernels_, &down_}) {
    if (*st == nullptr) {
      EMSA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(st, cudaStreamNonBlocking));
    }
  }
  runs_.resize(buckets_.size());
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (!buckets_[i].device_update) continue;
    CutRuns(buckets_[i], runs_[i]);
    EMSA_RETURN_IF_ERROR(runs_[i].written_back.Create(cudaEventDisableTiming));
    runs_[i].grads.assign(buckets_[i].updates.size(), nullptr);
  }
  EMSA_RETURN_IF_ERROR(kernels_mark_.Create(cudaEventDisableTiming));
  void* header = nullptr;
  EMSA_CUDA_RETURN_IF_ERROR(cudaMalloc(&header, sizeof(DeviceStepHeader)));
  header_ = static_cast<DeviceStepHeader*>(header);
  waiting_.reserve(buckets_.size());
  if (options_.paced()) streamer_ = std::thread([this] { Stream(); });
  return Status::Ok();
}

Status DeviceUpdatePath::MakeSlots(DType state_dtype, int64_t largest) {
  const int64_t bytes = HostTier::StreamStagingBytes(options_, state_dtype, largest);
  const cudaError_t err = cudaMalloc(&staging_, static_cast<size_t>(bytes));
  if (err != cudaSuccess) {
    staging_ = nullptr;
    (void)cudaGetLastError();
    return Status::OutOfMemory("the host tier's device staging for device-updated tensors (" +
                               std::to_string(bytes) + " bytes): " + cudaGetErrorString(err) +
                               "; lower options.stream_piece_elements or stream_slots, or "
                               "update those tensors on the CPU");
  }
  const size_t moment = static_cast<size_t>(std::min(options_.stream_piece_elements, largest)) *
                        DTypeSize(state_dtype);
  const bool two = StateCount(options_.optimizer) == 2;
  slots_.resize(static_cast<size_t>(options_.stream_slots));
  char* at = static_cast<char*>(staging_);
  for (Slot& slot : slots_) {
    slot.exp_avg = at;
    at += moment;
    if (two) {
      slot.exp_avg_sq = at;
      at += moment;
    }
    EMSA_RETURN_IF_ERROR(slot.free.Create(cudaEventDisableTiming));
    EMSA_RETURN_IF_ERROR(slot.in_done.Create(cudaEventDefault));  // timed: the copies up
    EMSA_RETURN_IF_ERROR(slot.up_start.Create(cudaEventDefault));
    // The streamer waits on it: blocking sync, so it sleeps instead of taking a core.
    EMSA_RETURN_IF_ERROR(slot.updated.Create(cudaEventDisableTiming | cudaEventBlockingSync));
  }
  return Status::Ok();
}

// Runs stay within one tensor and one 2^32 block of its indices (the kernel's element index is
// 32 bits within a run's block).
void DeviceUpdatePath::CutRuns(TierBucket& b, Runs& runs) const {
  const int64_t piece = options_.stream_piece_elements;
  for (size_t k = 0; k < b.updates.size(); ++k) {
    for (int64_t first = 0; first < b.updates[k].numel;) {
      const int64_t block_end = (first / (int64_t{1} << 32) + 1) << 32;
      const int64_t last = std::min({first + piece, b.updates[k].numel, block_end});
      runs.spans.push_back({k, first, last - first});
      first = last;
    }
  }
}

// A slot's last copies up into the stats of their step, if not counted yet and done. Whoever
// enqueues runs (the streamer, or Submit without it), or the caller with the streamer idle.
void DeviceUpdatePath::TimeSlot(Slot& slot) {
  if (slot.timed) return;
  if (cudaEventQuery(slot.in_done.get()) != cudaSuccess) return;  // not done (or failed): later
  float ms = 0.0f;
  if (cudaEventElapsedTime(&ms, slot.up_start.get(), slot.in_done.get()) != cudaSuccess) return;
  slot.timed = true;
  std::lock_guard<std::mutex> lock(shared_.mu);
  if (shared_.stats.Holds(slot.step, shared_.step)) {
    shared_.stats.Of(slot.step).stream_up_s += ms * 1e-3;
  }
}

// Enqueues run r of bucket `index` (submitted in step s) through the next staging slot: moments
// up (after the slot's last write-back, and for the bucket's first run after its own last one),
// the kernel (the bucket's first after its gradients are final on the compute stream), moments
// down. Recording an event only moves what later waits on it refer to, and every wait below is
// enqueued after the record it is meant for, so the slots' events can be reused in turn.
Status DeviceUpdatePath::EnqueueRun(size_t index, size_t r, int64_t s, const RunVerdict& v) {
  TierBucket& b = buckets_[index];
  Runs& runs = runs_[index];
  const Span& run = runs.spans[r];
  const TensorUpdate& u = b.updates[run.tensor];
  Slot& slot = slots_[next_slot_];
  next_slot_ = (next_slot_ + 1) % slots_.size();
  const size_t state = DTypeSize(u.state_dtype);
  const size_t bytes = static_cast<size_t>(run.count) * state;
  const size_t at = static_cast<size_t>(run.first) * state;
  const bool first = !runs.started;
  runs.started = true;
  TimeSlot(slot);  // what it last carried, before its events move on
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(up_, slot.free.get(), 0));
  if (first && b.uploaded > 0) {  // written_back was recorded by its last update
    EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(up_, runs.written_back.get(), 0));
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.up_start.get(), up_));
  slot.step = s;
  slot.timed = false;
  EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.exp_avg, static_cast<char*>(u.exp_avg) + at, bytes,
                                            cudaMemcpyHostToDevice, up_));
  if (u.exp_avg_sq != nullptr) {
    EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.exp_avg_sq,
                                              static_cast<char*>(u.exp_avg_sq) + at, bytes,
                                              cudaMemcpyHostToDevice, up_));
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.in_done.get(), up_));
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(kernels_, slot.in_done.get(), 0));
  if (first) EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(kernels_, b.ready.get(), 0));
  cuda::StreamRun k;
  k.param = static_cast<float*>(b.device_params[run.tensor]) + run.first;
  k.grad = static_cast<const float*>(runs.grads[run.tensor]) + run.first;
  k.exp_avg = slot.exp_avg;
  k.exp_avg_sq = u.exp_avg_sq != nullptr ? slot.exp_avg_sq : nullptr;
  k.first = run.first;
  k.count = run.count;
  k.header = v.header;
  EMSA_RETURN_IF_ERROR(cuda::LaunchStreamUpdate(
      options_.optimizer, u.state_dtype, options_.rounding == Rounding::kStochastic, options_.seed,
      ToDeviceScalars(*u.hyper, u.step), v.grad_multiplier, k, kernels_));
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.updated.get(), kernels_));
  slot.used = true;
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(down_, slot.updated.get(), 0));
  EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(u.exp_avg) + at, slot.exp_avg, bytes,
                                            cudaMemcpyDeviceToHost, down_));
  if (u.exp_avg_sq != nullptr) {
    EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(u.exp_avg_sq) + at,
                                              slot.exp_avg_sq, bytes, cudaMemcpyDeviceToHost,
                                              down_));
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.free.get(), down_));
  return Status::Ok();
}

Status DeviceUpdatePath::FinishRuns(size_t index) {
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(buckets_[index].upload.done(), kernels_));
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(runs_[index].written_back.get(), down_));
  return Status::Ok();
}

size_t DeviceUpdatePath::NextPresent(size_t index, size_t r) const {
  const Runs& runs = runs_[index];
  const std::vector<uint8_t>& present = buckets_[index].present;
  while (r < runs.spans.size() && present[runs.spans[r].tensor] == 0) ++r;
  return r;
}

Status DeviceUpdatePath::EnqueueBucket(size_t index, int64_t s, const RunVerdict& v) {
  if (v.skip) return Status::Ok();
  const size_t n = runs_[index].spans.size();
  for (size_t r = NextPresent(index, 0); r < n; r = NextPresent(index, r + 1)) {
    EMSA_RETURN_IF_ERROR(EnqueueRun(index, r, s, v));
  }
  return FinishRuns(index);
}

void DeviceUpdatePath::MarkDone(size_t index, int64_t s) {
  TierBucket& b = buckets_[index];
  b.uploaded = b.copied = s;
  shared_.copies_total.fetch_add(1, std::memory_order_release);
}

DeviceUpdatePath::RunVerdict DeviceUpdatePath::VerdictLocked() const {
  const StepVerdict& v = shared_.verdict;
  if (!v.gated) return {nullptr, step_options_.grad_multiplier, false};
  if (v.from_device) return {header_, 1.0f, false};  // the kernel multiplies in the header's
  return {nullptr, v.grad_multiplier, v.found_inf};
}

Status DeviceUpdatePath::Submit(size_t index, const void* const* grads, size_t count) {
  TierBucket& b = buckets_[index];
  Runs& runs = runs_[index];
  std::copy(grads, grads + count, runs.grads.begin());
  // Under pacing the streamer enqueues its runs (the caller keeps the gradients until then);
  // else they are enqueued here, in submission order, or in a gated step not yet released by
  // the release (EnqueueDeferred).
  const bool streamed = streamer_.joinable() && !runs.spans.empty();
  const int64_t s = shared_.step;  // written by this thread only
  bool open = false;
  RunVerdict v;
  {
    std::lock_guard<std::mutex> lock(shared_.mu);
    open = shared_.verdict.open();
    v = VerdictLocked();
  }
  runs.started = false;
  Status st;
  if (!streamed && open) st = EnqueueBucket(index, s, v);
  {
    std::lock_guard<std::mutex> lock(shared_.mu);
    shared_.Fail(st);
    b.submitted = s;
    b.t_submit = shared_.Since();
    runs.next = 0;
    ++shared_.stats.Of(s).device_buckets;
    if (streamed) {
      waiting_.push_back(index);
      ++shared_.pending;
    } else if (open || !shared_.error.ok()) {
      MarkDone(index, s);
    } else {
      runs.deferred = true;
    }
  }
  shared_.cv.notify_all();
  return st;
}

Status DeviceUpdatePath::CopyHeader(const DeviceStepHeader* device_header, cudaStream_t stream) {
  // Every kernel of earlier steps is enqueued (the tier drained at BeginStep) and none of this
  // step's yet (they wait for this release): the mark orders the overwrite after their reads.
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(kernels_mark_.get(), kernels_));
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, kernels_mark_.get(), 0));
  EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(header_, device_header, sizeof(DeviceStepHeader),
                                            cudaMemcpyDeviceToDevice, stream));
  return Status::Ok();
}

Status DeviceUpdatePath::WaitRelease(cudaEvent_t released) {
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(kernels_, released, 0));
  return Status::Ok();
}

Status DeviceUpdatePath::EnqueueDeferred() {
  Status st;
  for (size_t i = buckets_.size(); i-- > 0;) {
    RunVerdict v;
    int64_t s = 0;
    {
      std::lock_guard<std::mutex> lock(shared_.mu);
      if (!runs_[i].deferred) continue;
      v = VerdictLocked();
      s = shared_.step;
    }
    if (st.ok()) st = EnqueueBucket(i, s, v);  // after a failure only marked done
    std::lock_guard<std::mutex> lock(shared_.mu);
    shared_.Fail(st);
    runs_[i].deferred = false;
    MarkDone(i, s);
  }
  shared_.cv.notify_all();
  return st;
}

Status DeviceUpdatePath::Synchronize() {
  if (down_ == nullptr) return Status::Ok();
  // Its last copies follow every device update enqueued.
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(down_));
  for (Slot& slot : slots_) TimeSlot(slot);
  return Status::Ok();
}

// Of the submitted buckets with runs left, the one the next forward needs first (the highest
// index) among those whose gradients are final, else the oldest (lowest index: final first).
// Streamer only; caller holds mu.
size_t DeviceUpdatePath::PickBucket() const {
  size_t oldest = kNone, ready = kNone;
  for (size_t c : waiting_) {
    if (oldest == kNone || c < oldest) oldest = c;
    if ((ready == kNone || c > ready) && cudaEventQuery(buckets_[c].ready.get()) == cudaSuccess) {
      ready = c;
    }
  }
  return ready != kNone ? ready : oldest;
}

// The streamer: enqueues the device-updated buckets' runs with at most one run per staging
// slot in flight, so that what comes next is chosen when a slot frees up: during backward the
// buckets as their gradients become final, after it what the next forward needs first (as the
// worker chooses for the CPU). In a gated step it takes nothing before the release. A failed
// bucket is marked done so no Wait blocks on it.
void DeviceUpdatePath::Stream() {
  Status set = CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice (host tier streamer)");
  std::unique_lock<std::mutex> lock(shared_.mu);
  shared_.Fail(set);
  for (;;) {
    shared_.cv.wait(lock, [&] {
      return shared_.stop || (!waiting_.empty() && (shared_.verdict.open() || !shared_.error.ok()));
    });
    if (waiting_.empty()) return;  // stop, and nothing left (the tier releases before stop)
    Status st = shared_.error;
    const Slot& slot = slots_[next_slot_];
    if (st.ok() && slot.used) {  // the slot's last kernel is done: choose now, not earlier
      lock.unlock();
      st = CudaStatus(cudaEventSynchronize(slot.updated.get()), "cudaEventSynchronize (slot)");
      lock.lock();
    }
    const size_t index = PickBucket();
    TierBucket& b = buckets_[index];
    Runs& runs = runs_[index];
    const RunVerdict v = VerdictLocked();
    const size_t n = runs.spans.size();
    const size_t r = v.skip ? n : NextPresent(index, runs.next);
    if (st.ok() && r < n) {
      lock.unlock();
      st = EnqueueRun(index, r, b.submitted, v);
      lock.lock();
    }
    const size_t after = r < n ? NextPresent(index, r + 1) : n;
    if (st.ok() && after == n && !v.skip) {  // the bucket's last run: its events
      lock.unlock();
      st = FinishRuns(index);
      lock.lock();
    }
    shared_.Fail(st);
    if (shared_.error.ok() && after < n) {
      runs.next = after;
      continue;
    }
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), index));
    MarkDone(index, b.submitted);
    --shared_.pending;
    shared_.cv.notify_all();
  }
}

}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
