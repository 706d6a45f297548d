// host_tier_gate.cc — the host tier's steps and their verdicts (HostTier::Impl,
// engine/host_tier_impl.h): BeginStep in both forms, the release of a gated step (from the
// device's step header or as values), and the per-tensor step counts, settled when a step ends.
//
// A gated step's verdict is read once: by the worker when it takes the step's first CPU-updated
// bucket, or by the caller's Synchronize / next BeginStep when the step had none (the worker is
// then idle). verdict_mu orders the two.
#include <cmath>
#include <string>

#include "emsa/cuda_update.h"
#include "engine/host_tier_impl.h"
#include "kernels/cpu/kernels.h"

namespace emsa {

Status HostTier::Impl::CheckReleased(const char* call) const {
  if (shared.verdict.open()) return Status::Ok();
  return Status::InvalidArgument(
      std::string(call) + " in gated step " + std::to_string(shared.step) +
      " before its release: call Release (emsa_host_tier_release) or ReleaseValues first");
}

Status HostTier::Impl::ReadVerdict() {
  std::lock_guard<std::mutex> once(verdict_mu);
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    if (shared.verdict.known || !shared.verdict.gated) return Status::Ok();
  }
  EMSA_RETURN_IF_ERROR(engine->Synchronize(released.get(), "the release of a gated step"));
  const float multiplier = pinned_header->grad_multiplier;
  const bool found_inf = pinned_header->found_inf != 0;
  std::lock_guard<std::mutex> lock(shared.mu);
  StepVerdict& v = shared.verdict;
  v.grad_multiplier = multiplier;
  v.found_inf = found_inf;
  v.known = true;
  shared.last_skipped = found_inf;
  shared.stats.Of(shared.step).skipped = found_inf;
  return Status::Ok();
}

Status HostTier::Impl::Settle(std::unique_lock<std::mutex>& lock) {
  const int64_t s = shared.step;
  if (s == 0) return Status::Ok();
  if (shared.verdict.gated && !shared.verdict.known) {
    lock.unlock();
    const Status st = ReadVerdict();
    lock.lock();
    shared.Fail(st);
    EMSA_RETURN_IF_ERROR(st);
  }
  const bool skipped = shared.verdict.gated && shared.verdict.found_inf;
  for (TierBucket& b : buckets) {
    if (b.submitted != s || b.settled == s) continue;
    b.settled = s;
    for (size_t k = 0; !skipped && k < b.updates.size(); ++k) {
      if (b.present[k] != 0) ++steps[b.tensors[k]];
    }
  }
  return Status::Ok();
}

Status HostTier::Impl::Begin(const HyperParams* new_hypers, size_t group_count, bool gated,
                             const int64_t* group_steps) {
  if (group_count != hypers.size() || new_hypers == nullptr) {
    return Status::InvalidArgument("BeginStep needs " + std::to_string(hypers.size()) +
                                   " groups' hyperparameters, got " + std::to_string(group_count));
  }
  std::unique_lock<std::mutex> lock(shared.mu);
  EMSA_RETURN_IF_ERROR(CheckReleased("BeginStep"));
  Drain(lock);
  EMSA_RETURN_IF_ERROR(shared.error);
  EMSA_RETURN_IF_ERROR(Settle(lock));
  for (size_t g = 0; g < group_count; ++g) {
    hypers[g] = new_hypers[g];
    TensorUpdate probe;  // the decay exactly as the CPU kernels round it (no step in it)
    probe.hyper = &hypers[g];
    decays[g] = cpu::MakeUpdateArgs(probe, step_options).decay;
  }
  if (group_steps != nullptr) {  // the group form: every tensor of group g at steps[g] - 1
    for (TierBucket& b : buckets) {
      for (size_t k = 0; k < b.updates.size(); ++k) {
        steps[b.tensors[k]] = group_steps[static_cast<size_t>(b.groups[k])] - 1;
      }
    }
  }
  ++shared.step;
  shared.step_start = std::chrono::steady_clock::now();
  shared.verdict = StepVerdict{};
  shared.verdict.gated = gated;
  for (TierBucket& b : buckets) b.t_submit = b.t_start = b.t_end = -1;
  shared.stats.Begin(shared.step);
  shared.stats.Of(shared.step).gated = gated;
  return Status::Ok();
}

namespace {

// Under mu: why the current step cannot be released, or Ok.
Status CheckReleasable(const TierShared& shared) {
  EMSA_RETURN_IF_ERROR(shared.error);
  if (!shared.verdict.gated) {
    return Status::InvalidArgument("Release: step " + std::to_string(shared.step) +
                                   " is not gated (start it with BeginStepGated(..., true))");
  }
  if (shared.verdict.released) {
    return Status::InvalidArgument("Release: step " + std::to_string(shared.step) +
                                   " was released already");
  }
  return Status::Ok();
}

}  // namespace

Status HostTier::Release(const DeviceStepHeader* device_header, cudaStream_t stream) {
  Impl& m = *impl_;
  if (device_header == nullptr) return Status::InvalidArgument("Release: device_header is null");
  {
    std::lock_guard<std::mutex> lock(m.shared.mu);
    EMSA_RETURN_IF_ERROR(CheckReleasable(m.shared));
  }
  // The device path's own copy first (its kernels read it), then the host's, then the event
  // both wait for.
  Status st;
  if (m.device != nullptr) st = m.device->CopyHeader(device_header, stream);
  if (st.ok()) {
    st = m.engine->CopyToHost(m.pinned_header, device_header, sizeof(DeviceStepHeader), stream);
  }
  if (st.ok()) st = m.engine->Record(m.released.get(), stream);
  if (st.ok() && m.device != nullptr) st = m.device->WaitRelease(m.released.get());
  {
    std::lock_guard<std::mutex> lock(m.shared.mu);
    m.shared.Fail(st);  // a half-enqueued release: the tier stops
    m.shared.verdict.released = true;
    m.shared.verdict.from_device = true;
  }
  m.shared.cv.notify_all();
  if (st.ok() && m.device != nullptr) st = m.device->EnqueueDeferred();
  return st;
}

Status HostTier::ReleaseValues(float grad_multiplier, bool found_inf) {
  Impl& m = *impl_;
  if (!std::isfinite(grad_multiplier)) {
    return Status::InvalidArgument("ReleaseValues: grad_multiplier is " +
                                   std::to_string(grad_multiplier) + "; it must be finite");
  }
  {
    std::lock_guard<std::mutex> lock(m.shared.mu);
    EMSA_RETURN_IF_ERROR(CheckReleasable(m.shared));
    StepVerdict& v = m.shared.verdict;
    v.released = v.known = true;
    v.grad_multiplier = grad_multiplier;
    v.found_inf = found_inf;
    m.shared.last_skipped = found_inf;
    m.shared.stats.Of(m.shared.step).skipped = found_inf;
  }
  m.shared.cv.notify_all();
  return m.device != nullptr ? m.device->EnqueueDeferred() : Status::Ok();
}

Status HostTier::ReadSteps(int64_t* out, size_t count) const {
  Impl& m = *impl_;
  if (count != m.steps.size() || (out == nullptr && count > 0)) {
    return Status::InvalidArgument("ReadSteps: the tier holds " + std::to_string(m.steps.size()) +
                                   " tensors; got room for " + std::to_string(count));
  }
  std::lock_guard<std::mutex> lock(m.shared.mu);
  for (size_t i = 0; i < count; ++i) out[i] = m.steps[i];
  return Status::Ok();
}

Status HostTier::SetSteps(const int64_t* steps, size_t count) {
  Impl& m = *impl_;
  if (count != m.steps.size() || (steps == nullptr && count > 0)) {
    return Status::InvalidArgument("SetSteps: the tier holds " + std::to_string(m.steps.size()) +
                                   " tensors; got " + std::to_string(count) + " steps");
  }
  for (size_t i = 0; i < count; ++i) {
    if (steps[i] < 0) {
      return Status::InvalidArgument("steps[" + std::to_string(i) + "] is " +
                                     std::to_string(steps[i]) + "; it must be >= 0");
    }
  }
  std::lock_guard<std::mutex> lock(m.shared.mu);
  EMSA_RETURN_IF_ERROR(m.shared.error);
  for (const TierBucket& b : m.buckets) {
    if (b.submitted == m.shared.step && m.shared.step > 0 && b.settled != m.shared.step) {
      return Status::InvalidArgument(
          "SetSteps during a step: call it after Synchronize, or after BeginStep before any "
          "Submit");
    }
  }
  for (size_t i = 0; i < count; ++i) m.steps[i] = steps[i];
  return Status::Ok();
}

bool HostTier::last_skipped() const {
  std::lock_guard<std::mutex> lock(impl_->shared.mu);
  return impl_->shared.last_skipped;
}

}  // namespace emsa
