// host_tier.cc — HostTier: the coordinator of the host tier's D2H -> CPU -> H2D pipeline
// (emsa/host_tier.h). It owns the bucket queue and the worker that takes buckets from it and
// updates them on the CPU (host_tier_worker.cc); the copies (engine/host_tier_copies.h) and the
// GPU-updated path (engine/host_tier_device.h) are parts of their own. This file: Create, in
// named steps, and the caller's side.
//
// Threads: the caller's thread (Submit, Wait, BeginStep, ...), one worker and, for GPU-updated
// buckets under pacing, the device path's streamer. What they share is in TierShared, under its
// mutex (engine/host_tier_state.h).
#include "emsa/host_tier.h"

#include <algorithm>
#include <new>
#include <string>

#include "emsa/cuda_update.h"
#include "engine/copy_engine.h"
#include "engine/host_tier_impl.h"
#include "kernels/cpu/kernels.h"

namespace emsa {

int64_t HostTier::StreamStagingBytes(const HostTierOptions& options, DType state_dtype,
                                     int64_t largest) {
  return HostTierStreamStagingBytes(options.optimizer, state_dtype, options.stream_piece_elements,
                                    options.stream_slots, largest);
}

namespace {

// The options' own checks, before any tensor is looked at.
Status ValidateOptions(const HostTierOptions& options) {
  if (options.history == 0) return Status::InvalidArgument("options.history must be >= 1");
  if (options.paced_copies < 0) {
    return Status::InvalidArgument("options.paced_copies is " +
                                   std::to_string(options.paced_copies) +
                                   "; use 0 (copies enqueued at Submit) or a piece count >= 1");
  }
  if (options.paced_copies > 0 && options.pace_piece_elements < 64) {
    return Status::InvalidArgument("options.pace_piece_elements is " +
                                   std::to_string(options.pace_piece_elements) +
                                   "; use at least 64 (default 4 Mi), or paced_copies 0");
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
  return Status::Ok();
}

// What a GPU-updated tensor must be (HostTierTensor::device_update); `summary` holds the ones
// seen before it.
Status CheckDeviceUpdated(const std::string& where, const TensorUpdate& u,
                          const TensorSummary& summary) {
  if (u.param_dtype != DType::kFloat32 || u.grad_dtype != DType::kFloat32 || u.master != nullptr ||
      (u.state_dtype != DType::kFloat32 && u.state_dtype != DType::kBFloat16)) {
    return Status::InvalidArgument(where +
                                   ".device_update needs an fp32 parameter without a master, an "
                                   "fp32 gradient and fp32 or bf16 moments; update this tensor "
                                   "on the CPU instead");
  }
  if (summary.any_device_update && u.state_dtype != summary.state_dtype) {
    return Status::InvalidArgument(
        "device-updated tensors must all have moments of one dtype (their staging is shared)");
  }
  return Status::Ok();
}

}  // namespace

HostTier::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    StepVerdict& v = shared.verdict;
    if (!v.open()) {  // never released: released as skipped, so that nothing waits forever
      v.released = v.known = v.found_inf = true;
      v.grad_multiplier = 1.0f;
      shared.stats.Of(shared.step).skipped = true;
    }
  }
  shared.cv.notify_all();
  if (device != nullptr) (void)device->EnqueueDeferred();  // skipped: only marked done
  {
    std::unique_lock<std::mutex> lock(shared.mu);
    shared.cv.wait(lock, [&] { return shared.pending == 0; });
    shared.stop = true;
  }
  shared.cv.notify_all();
  if (worker.joinable()) worker.join();
  device.reset();  // joins the streamer, waits for its last copies
  if (delta_staging != nullptr) engine->FreeDevice(delta_staging);
  if (pinned_header != nullptr) engine->FreePinned(pinned_header);
}

// ---- Create's steps -----------------------------------------------------------------------------

// Tensor i: checked, and added to its bucket with step 1 and its group's hyperparameters (set
// per step by BeginStep) and, where the device applies its update, the delta written over its
// gradient.
Status HostTier::Impl::AddTensor(size_t i, const HostTierTensor& t, TensorSummary* summary) {
  const std::string where = "tensors[" + std::to_string(i) + "]";
  const size_t bucket_count = buckets.size(), group_count = hypers.size();
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
  u.hyper = &hypers[static_cast<size_t>(t.group)];
  u.delta = nullptr;
  TierBucket& into = buckets[static_cast<size_t>(t.bucket)];
  if (!into.updates.empty() && into.device_update != t.device_update) {
    return Status::InvalidArgument(where + ".device_update differs from the rest of bucket " +
                                   std::to_string(t.bucket) +
                                   "; a bucket is updated on the device or on the CPU, whole");
  }
  into.device_update = t.device_update;
  if (t.device_update) {
    EMSA_RETURN_IF_ERROR(CheckDeviceUpdated(where, u, *summary));
    summary->any_device_update = true;
    summary->state_dtype = u.state_dtype;
    summary->largest = std::max(summary->largest, u.numel);
  }
  if (options.device_delta && !t.device_update && u.numel > 0 &&
      HostTierAppliesDelta(options.optimizer, u.param_dtype, u.grad_dtype, u.master != nullptr)) {
    u.delta = static_cast<float*>(const_cast<void*>(u.grad));  // in place of the gradient
    summary->any_delta = true;
  }
  Status valid = updater->Validate(&u, 1, step_options);
  if (!valid.ok()) return valid.Annotate(where);
  into.updates.push_back(u);
  into.device_params.push_back(t.device_param);
  into.groups.push_back(t.group);
  into.tensors.push_back(i);
  into.present.push_back(1);
  return Status::Ok();
}

Status HostTier::Impl::AddTensors(const HostTierTensor* tensors, size_t count,
                                  TensorSummary* summary) {
  for (size_t i = 0; i < count; ++i) EMSA_RETURN_IF_ERROR(AddTensor(i, tensors[i], summary));
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (buckets[i].updates.empty()) {
      return Status::InvalidArgument("bucket " + std::to_string(i) + " has no tensors");
    }
  }
  return Status::Ok();
}

Status HostTier::Impl::MakeDeltaStaging() {
  void* staging = nullptr;
  const size_t bytes = static_cast<size_t>(options.delta_staging_elements) * sizeof(float);
  const Status st = engine->AllocateDevice(bytes, &staging);
  if (!st.ok()) {
    return Status::OutOfMemory("the host tier's device staging buffer for deltas (" +
                               std::to_string(bytes) + " bytes): " + st.message() +
                               "; lower options.delta_staging_elements or turn device_delta off");
  }
  delta_staging = static_cast<float*>(staging);
  return Status::Ok();
}

// A bucket's events and copies: gradients down in pieces of the pacing (whole without it), and
// its upload (for a GPU-updated bucket only the event its kernels record).
Status HostTier::Impl::InitBucket(TierBucket& b) {
  // Blocking sync: under pacing the worker may wait on it.
  EMSA_RETURN_IF_ERROR(b.ready.Create(engine, /*timed=*/false, /*blocking=*/true));
  for (const TensorUpdate& u : b.updates) {
    b.grad_bytes += u.numel * static_cast<int64_t>(DTypeSize(u.grad_dtype));
  }
  const bool paced = options.paced();
  if (!b.device_update) {
    EMSA_RETURN_IF_ERROR(
        b.grads.Init(engine, b.updates, paced ? options.pace_piece_elements : 0, paced));
  }
  return b.upload.Init(engine, b.updates, b.device_params, b.groups, delta_staging,
                       options.delta_staging_elements, !b.device_update);
}

// ---- the caller's side --------------------------------------------------------------------------

// Submit's checks; *after_upload: the bucket's last upload read the gradient staging buffer (its
// deltas, or its 16-bit parameters rounded there) that its copies are about to overwrite.
Status HostTier::Impl::CheckSubmit(size_t bucket, const void* const* grads, size_t count,
                                   bool* after_upload, bool* gated) {
  if (bucket >= buckets.size()) {
    return Status::InvalidArgument("bucket " + std::to_string(bucket) + " does not exist (" +
                                   std::to_string(buckets.size()) + " buckets)");
  }
  const TierBucket& b = buckets[bucket];
  if (count != b.updates.size() || (grads == nullptr && count > 0)) {
    return Status::InvalidArgument("bucket " + std::to_string(bucket) + " holds " +
                                   std::to_string(b.updates.size()) + " tensors; got " +
                                   std::to_string(count) + " gradients");
  }
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    EMSA_RETURN_IF_ERROR(shared.error);
    if (shared.step == 0) return Status::InvalidArgument("Submit before the first BeginStep");
    *after_upload = b.upload.reads_grads() && b.uploaded > 0;
    *gated = shared.verdict.gated;
    if (b.submitted == shared.step) {
      return Status::InvalidArgument("bucket " + std::to_string(bucket) +
                                     " was submitted already in this step");
    }
    MarkPresent(buckets[bucket], grads);
  }
  return Status::Ok();
}

void HostTier::Impl::MarkPresent(TierBucket& b, const void* const* grads) {
  b.all_present = true;
  for (size_t k = 0; k < b.updates.size(); ++k) {
    const bool present = grads[k] != nullptr || b.updates[k].numel == 0;
    b.present[k] = present ? 1 : 0;
    b.all_present = b.all_present && present;
    if (present) b.updates[k].step = steps[b.tensors[k]] + 1;
  }
}

// Pacing: whether bucket b's gradients may wait on the device for the worker's copies without
// passing paced_hold_bytes; if not, they are copied at Submit.
bool HostTier::Impl::HoldForPacing(TierBucket& b) {
  std::lock_guard<std::mutex> lock(shared.mu);
  const int64_t limit = options.paced_hold_bytes;
  if (limit >= 0 && held_bytes + b.grad_bytes > limit) {
    b.grads.SetAllEnqueued();
    return false;
  }
  held_bytes += b.grad_bytes;
  return true;
}

// Enqueues bucket `index`'s gradient copies on the D2H stream, after the compute stream's event
// and, where the upload reads the staging buffer they overwrite, after its last upload (the
// forward's wait on it usually orders them already).
Status HostTier::Impl::CopyAtSubmit(size_t index, const void* const* grads, bool after_upload) {
  TierBucket& b = buckets[index];
  EMSA_RETURN_IF_ERROR(engine->StreamWait(d2h, b.ready.get()));
  if (after_upload) EMSA_RETURN_IF_ERROR(engine->StreamWait(d2h, b.upload.done()));
  EMSA_RETURN_IF_ERROR(b.grads.EnqueueAll(grads, d2h));
  b.grads.SetAllEnqueued();  // for the worker's reading under pacing
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    b.copied = shared.step;  // before the count moves: a caller that sees it sees this too
    shared.copies_total.fetch_add(1, std::memory_order_release);
    JoinQueue(index);
  }
  shared.cv.notify_all();
  return Status::Ok();
}

void HostTier::Impl::JoinQueue(size_t index) {
  TierBucket& b = buckets[index];
  b.submitted = shared.step;
  b.t_submit = shared.Since();
  waiting.push_back(index);
  ++shared.pending;
  HostTierStepStats& st = shared.stats.Of(shared.step);
  ++st.buckets;
  st.complete = false;
}

// ---- HostTier -----------------------------------------------------------------------------------

Result<std::unique_ptr<HostTier>> HostTier::Create(CpuUpdater* updater,
                                                   const HostTierTensor* tensors, size_t count,
                                                   size_t bucket_count, size_t group_count,
                                                   cudaStream_t d2h_stream, cudaStream_t h2d_stream,
                                                   const HostTierOptions& options) {
  return CreateWithEngine(CudaCopyEngine(), updater, tensors, count, bucket_count, group_count,
                          d2h_stream, h2d_stream, options);
}

Result<std::unique_ptr<HostTier>> HostTier::CreateWithEngine(
    CopyEngine* engine, CpuUpdater* updater, const HostTierTensor* tensors, size_t count,
    size_t bucket_count, size_t group_count, cudaStream_t d2h_stream, cudaStream_t h2d_stream,
    const HostTierOptions& options) {
  if (engine == nullptr) return Status::InvalidArgument("engine is null");
  if (updater == nullptr) return Status::InvalidArgument("updater is null");
  if (tensors == nullptr && count > 0) return Status::InvalidArgument("tensors is null");
  if (bucket_count == 0 || group_count == 0) {
    return Status::InvalidArgument("bucket_count and group_count must be at least 1");
  }
  EMSA_RETURN_IF_ERROR(ValidateOptions(options));
  auto impl = std::make_unique<Impl>(bucket_count);
  impl->updater = updater;
  impl->engine = engine;
  impl->options = options;
  impl->step_options.optimizer = options.optimizer;
  impl->step_options.rounding = options.rounding;
  impl->step_options.seed = options.seed;
  impl->d2h = d2h_stream;
  impl->h2d = h2d_stream;
  impl->hypers.assign(group_count, HyperParams{});
  impl->decays.assign(group_count, 1.0f);
  TensorSummary summary;
  EMSA_RETURN_IF_ERROR(impl->AddTensors(tensors, count, &summary));
  if (summary.any_device_update && engine != CudaCopyEngine()) {
    return Status::Unsupported("device-updated tensors (HostTierTensor::device_update) need CUDA");
  }
  EMSA_RETURN_IF_ERROR(engine->SetDevice(options.device));
  impl->steps.assign(count, 0);
  void* pinned = nullptr;
  EMSA_RETURN_IF_ERROR(engine->AllocatePinned(sizeof(DeviceStepHeader), &pinned));
  impl->pinned_header = new (pinned) DeviceStepHeader();
  // The worker waits on it: blocking sync, so it sleeps.
  EMSA_RETURN_IF_ERROR(impl->released.Create(engine, /*timed=*/false, /*blocking=*/true));
  if (summary.any_delta) EMSA_RETURN_IF_ERROR(impl->MakeDeltaStaging());
  for (TierBucket& b : impl->buckets) EMSA_RETURN_IF_ERROR(impl->InitBucket(b));
  impl->waiting.reserve(bucket_count);
  impl->candidates.reserve(bucket_count);
  impl->shared.stats.Reset(options.history);
  if (summary.any_device_update) {
    impl->device = std::make_unique<DeviceUpdatePath>(options, impl->step_options, &impl->buckets,
                                                      &impl->shared);
    EMSA_RETURN_IF_ERROR(impl->device->Init(summary.state_dtype, summary.largest));
  }
  Impl* raw = impl.get();
  impl->worker = std::thread([raw] { raw->Run(); });
  return std::unique_ptr<HostTier>(new HostTier(std::move(impl)));
}

HostTier::HostTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostTier::~HostTier() = default;

size_t HostTier::bucket_count() const { return impl_->buckets.size(); }
size_t HostTier::tensor_count() const { return impl_->steps.size(); }
size_t HostTier::bucket_size(size_t bucket) const {
  return bucket < impl_->buckets.size() ? impl_->buckets[bucket].updates.size() : 0;
}

Status HostTier::BeginStep(const HyperParams* hypers, const int64_t* steps, size_t group_count) {
  Impl& m = *impl_;
  if (group_count != m.hypers.size()) {  // Begin's message names the count
    return m.Begin(hypers, group_count, false, nullptr);
  }
  if (steps == nullptr) return Status::InvalidArgument("BeginStep: steps is null");
  for (size_t g = 0; g < group_count; ++g) {
    if (steps[g] < 1) {
      return Status::InvalidArgument("steps[" + std::to_string(g) + "] is " +
                                     std::to_string(steps[g]) + "; it must be >= 1");
    }
  }
  return m.Begin(hypers, group_count, m.options.gated, steps);
}

Status HostTier::BeginStepGated(const HyperParams* hypers, size_t group_count, bool gated) {
  return impl_->Begin(hypers, group_count, gated, nullptr);
}

Status HostTier::Submit(size_t bucket, const void* const* grads, size_t count,
                        cudaStream_t compute) {
  Impl& m = *impl_;
  bool after_upload = false, gated = false;
  EMSA_RETURN_IF_ERROR(m.CheckSubmit(bucket, grads, count, &after_upload, &gated));
  TierBucket& b = m.buckets[bucket];
  EMSA_RETURN_IF_ERROR(m.engine->Record(b.ready.get(), compute));
  if (b.device_update) return m.device->Submit(bucket, grads, count);
  // Paced, the worker copies them, a few pieces ahead. Gated, not: the CPU cannot consume them
  // before the release anyway, and the device gradients are freed once copied.
  if (m.options.paced() && !gated && m.HoldForPacing(b)) {
    b.grads.Hold(grads, count);
    {
      std::lock_guard<std::mutex> lock(m.shared.mu);
      m.JoinQueue(bucket);
    }
    m.shared.cv.notify_all();
    return Status::Ok();
  }
  return m.CopyAtSubmit(bucket, grads, after_upload);
}

Status HostTier::Wait(size_t bucket, cudaStream_t stream) {
  Impl& m = *impl_;
  if (bucket >= m.buckets.size()) {
    return Status::InvalidArgument("bucket " + std::to_string(bucket) + " does not exist");
  }
  TierBucket& b = m.buckets[bucket];
  {
    std::unique_lock<std::mutex> lock(m.shared.mu);
    if (b.submitted == m.shared.step) EMSA_RETURN_IF_ERROR(m.CheckReleased("Wait"));
    auto ready = [&] { return !m.shared.error.ok() || b.uploaded >= b.submitted; };
    if (!ready()) {
      auto t0 = std::chrono::steady_clock::now();
      m.shared.cv.wait(lock, ready);
      m.shared.stats.Of(m.shared.step).wait_s += Seconds(std::chrono::steady_clock::now() - t0);
    }
    EMSA_RETURN_IF_ERROR(m.shared.error);
    if (b.uploaded == 0) return Status::Ok();
  }
  return m.engine->StreamWait(stream, b.upload.done());
}

Status HostTier::WaitGradsCopied(cudaStream_t stream) {
  Impl& m = *impl_;
  int64_t s;
  {
    std::unique_lock<std::mutex> lock(m.shared.mu);
    s = m.shared.step;
    for (const TierBucket& b : m.buckets) {
      if (b.device_update && b.submitted == s) {
        EMSA_RETURN_IF_ERROR(m.CheckReleased("WaitGradsCopied"));
      }
    }
    // Under pacing the worker enqueues the copies: wait until it has (their events are
    // recorded), or failed.
    m.shared.cv.wait(lock, [&] {
      if (!m.shared.error.ok()) return true;
      for (const TierBucket& b : m.buckets) {
        if (b.submitted == s && b.copied != s) return false;
      }
      return true;
    });
    EMSA_RETURN_IF_ERROR(m.shared.error);
  }
  for (TierBucket& b : m.buckets) {
    if (b.submitted == s && s > 0) {  // device_update: the kernels are what read them
      EMSA_RETURN_IF_ERROR(
          m.engine->StreamWait(stream, b.device_update ? b.upload.done() : b.grads.all_landed()));
    }
  }
  return Status::Ok();
}

Status HostTier::Synchronize() {
  Impl& m = *impl_;
  {
    std::unique_lock<std::mutex> lock(m.shared.mu);
    EMSA_RETURN_IF_ERROR(m.CheckReleased("Synchronize"));
    m.Drain(lock);
    EMSA_RETURN_IF_ERROR(m.shared.error);
    EMSA_RETURN_IF_ERROR(m.Settle(lock));
  }
  for (TierBucket& b : m.buckets) EMSA_RETURN_IF_ERROR(m.TimeUpload(b));
  if (m.device != nullptr) EMSA_RETURN_IF_ERROR(m.device->Synchronize());
  return Status::Ok();
}

cudaStream_t HostTier::update_stream() const {
  return impl_->device != nullptr ? impl_->device->kernels() : nullptr;
}

bool HostTier::BucketCopiesEnqueued(size_t bucket) const {
  Impl& m = *impl_;
  if (bucket >= m.buckets.size()) return false;
  std::lock_guard<std::mutex> lock(m.shared.mu);
  const TierBucket& b = m.buckets[bucket];
  return b.copied == b.submitted || !m.shared.error.ok();  // a failed tier enqueues no more
}

int64_t HostTier::copies_enqueued() const {
  return impl_->shared.copies_total.load(std::memory_order_acquire);
}

size_t HostTier::Trace(double* submit, double* start, double* end, size_t count) const {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.shared.mu);
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
  std::lock_guard<std::mutex> lock(m.shared.mu);
  return m.shared.stats.Copy(first, m.shared.step, out, capacity);
}

}  // namespace emsa
