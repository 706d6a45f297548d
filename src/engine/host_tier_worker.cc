// host_tier_worker.cc — the host tier's worker (HostTier::Impl, engine/host_tier_impl.h): it
// takes, of the submitted buckets whose gradients have landed, the one the next forward needs
// first, updates it on the CPU pool as its gradients land (under pacing copying them down a few
// pieces ahead), and enqueues its upload.
#include <algorithm>
#include <functional>

#include "engine/host_tier_impl.h"

namespace emsa {

// Times bucket b's last upload once it has finished (waits for it). Caller holds no lock.
Status HostTier::Impl::TimeUpload(TierBucket& b) {
  int64_t s;
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    if (b.h2d_timed || b.uploaded == 0) return Status::Ok();
    s = b.uploaded;
  }
  EMSA_RETURN_IF_ERROR(engine->Synchronize(b.upload.done(), "the last upload"));
  double seconds = 0.0;
  EMSA_RETURN_IF_ERROR(b.upload.Seconds(&seconds));
  std::lock_guard<std::mutex> lock(shared.mu);
  if (!b.h2d_timed) {
    b.h2d_timed = true;
    shared.stats.AddUpload(s, shared.step, seconds);
  }
  return Status::Ok();
}

// Pacing: enqueues bucket b's next gradient piece on the D2H stream (the first after the
// compute stream's event and, where the upload reads the gradient staging (a delta, a 16-bit
// parameter), after the last upload, which read the buffer the copy overwrites).
Status HostTier::Impl::EnqueuePiece(TierBucket& b, int64_t s) {
  if (b.grads.enqueued() == 0) {
    EMSA_RETURN_IF_ERROR(engine->StreamWait(d2h, b.ready.get()));
    if (b.upload.reads_grads() && b.uploaded > 0) {
      EMSA_RETURN_IF_ERROR(engine->StreamWait(d2h, b.upload.done()));
    }
  }
  EMSA_RETURN_IF_ERROR(b.grads.EnqueueNext(d2h));
  if (b.grads.all_enqueued()) {
    {
      std::lock_guard<std::mutex> lock(shared.mu);
      b.copied = s;
      held_bytes -= b.grad_bytes;
      shared.copies_total.fetch_add(1, std::memory_order_release);
    }
    shared.cv.notify_all();
  }
  return Status::Ok();
}

// Pacing: bucket b's first `consumed` pieces are updated; keeps paced_copies pieces enqueued
// beyond them, from b and then from the bucket taken next.
Status HostTier::Impl::Feed(TierBucket& b, size_t consumed, int64_t s) {
  const size_t window = static_cast<size_t>(options.paced_copies);
  size_t ahead = b.grads.enqueued() - consumed;
  if (next != kNoBucket) ahead += buckets[next].grads.enqueued();
  while (ahead < window) {
    if (!b.grads.all_enqueued()) {
      EMSA_RETURN_IF_ERROR(EnqueuePiece(b, s));
    } else {
      if (next == kNoBucket) {  // take the next bucket early (never blocks)
        EMSA_ASSIGN_OR_RETURN(next, TakeReady(nullptr));
        if (next == kNoBucket) break;
      }
      TierBucket& n = buckets[next];
      if (n.grads.all_enqueued()) break;
      EMSA_RETURN_IF_ERROR(EnqueuePiece(n, s));
    }
    ++ahead;
  }
  return Status::Ok();
}

// Updates bucket b on the CPU. When its gradients have all landed, in one pass; when some are
// still on their way (the CPU caught up with the D2H stream, as at the start of a step, or the
// copies are paced) it follows them piece by piece instead of idling until the last has landed,
// and under pacing copies more as each piece is updated.
Status HostTier::Impl::UpdateAsLanded(TierBucket& b, bool landed, int64_t s,
                                      const StepOptions& step, double* cpu_seconds,
                                      double* wait_seconds) {
  const bool paced = options.paced();
  const int64_t total = b.grads.elements();
  size_t g = 0;  // the gradient piece holding `first`
  for (int64_t first = 0; first < total;) {
    int64_t last = total;
    if (!landed) {
      while (b.grads.last(g) <= first) ++g;
      const auto w0 = std::chrono::steady_clock::now();
      EMSA_RETURN_IF_ERROR(engine->Synchronize(b.grads.landed(g), "a gradient piece"));
      *wait_seconds += Seconds(std::chrono::steady_clock::now() - w0);
      last = std::min(last, b.grads.last(g));
    }
    const auto t0 = std::chrono::steady_clock::now();
    EMSA_RETURN_IF_ERROR(StepPresent(b, step, first, last));
    *cpu_seconds += Seconds(std::chrono::steady_clock::now() - t0);
    if (paced && last == b.grads.last(g)) EMSA_RETURN_IF_ERROR(Feed(b, g + 1, s));
    first = last;
  }
  return Status::Ok();
}

Status HostTier::Impl::StepPresent(const TierBucket& b, const StepOptions& step, int64_t first,
                                   int64_t last) {
  const size_t n = b.updates.size();
  if (b.all_present) return updater->StepRange(b.updates.data(), n, step, first, last);
  int64_t start = 0;  // the bucket's element where tensor k starts
  for (size_t k = 0; k < n;) {
    if (b.present[k] == 0) {
      start += b.updates[k++].numel;
      continue;
    }
    const int64_t run_first = start;  // a run of present tensors, [k, j)
    for (; k < n && b.present[k] != 0; ++k) start += b.updates[k].numel;
    const int64_t lo = std::max(first, run_first), hi = std::min(last, start);
    if (lo < hi) EMSA_RETURN_IF_ERROR(updater->StepRange(b.updates.data(), n, step, lo, hi));
  }
  return Status::Ok();
}

// A skipped step's bucket `index` (submitted in step s): nothing is updated or uploaded; its
// copies are timed and it is marked done (Wait then has nothing to wait for).
Status HostTier::Impl::Skip(size_t index, int64_t s) {
  TierBucket& b = buckets[index];
  EMSA_RETURN_IF_ERROR(TimeUpload(b));  // the last upload's time goes to its own step
  EMSA_RETURN_IF_ERROR(engine->Synchronize(b.grads.all_landed(), "the gradient copy"));
  double d2h_seconds = 0.0;
  EMSA_RETURN_IF_ERROR(b.grads.Seconds(&d2h_seconds));
  std::lock_guard<std::mutex> lock(shared.mu);
  shared.stats.Of(s).d2h_s += d2h_seconds;
  shared.stats.AddUpload(s, shared.step, 0.0);
  b.uploaded = s;  // h2d_timed stays: no upload of this step to time
  return Status::Ok();
}

// The worker's part for bucket `index`, submitted in step s: its update, then its upload.
Status HostTier::Impl::Process(size_t index, int64_t s, const StepOptions& step) {
  TierBucket& b = buckets[index];
  const bool paced = options.paced();
  bool landed = false;  // paced: follow the pieces, copying more as each is updated
  if (!paced) {
    EMSA_RETURN_IF_ERROR(engine->Query(b.grads.all_landed(), "the gradient copy", &landed));
  }
  // The previous upload reads what the update is about to write: it must be done.
  EMSA_RETURN_IF_ERROR(TimeUpload(b));
  if (paced) EMSA_RETURN_IF_ERROR(Feed(b, 0, s));
  b.t_start = shared.Since();
  const auto started = std::chrono::steady_clock::now();
  double cpu_seconds = 0.0;
  double wait_seconds = 0.0;  // blocked until a gradient piece had landed
  EMSA_RETURN_IF_ERROR(UpdateAsLanded(b, landed, s, step, &cpu_seconds, &wait_seconds));
  EMSA_RETURN_IF_ERROR(b.upload.Enqueue(decays, b.present, h2d));
  b.t_end = shared.Since();
  // Done long since (the update read every piece).
  EMSA_RETURN_IF_ERROR(engine->Synchronize(b.grads.all_landed(), "the gradient copy"));
  double d2h_seconds = 0.0;
  EMSA_RETURN_IF_ERROR(b.grads.Seconds(&d2h_seconds));
  std::lock_guard<std::mutex> lock(shared.mu);
  HostTierStepStats& st = shared.stats.Of(s);
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
// or, under pacing (the worker copies them itself), its gradients final on the device.
cudaEvent_t HostTier::Impl::Gate(const TierBucket& b) const {
  return options.paced() ? b.ready.get() : b.grads.first_landed();
}

// Of the waiting buckets whose Gate has passed, the one the next forward needs first (the
// highest index: buckets are in gradient-ready order, the reverse of the forward's), taken out
// of `waiting`; kNoBucket when none has. *oldest (if given): the oldest waiting bucket, kNoBucket
// when none waits. Caller holds no lock; only the worker takes buckets out, so what it saw stays.
Result<size_t> HostTier::Impl::TakeReady(size_t* oldest) {
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    candidates.assign(waiting.begin(), waiting.end());
  }
  if (oldest != nullptr) *oldest = candidates.empty() ? kNoBucket : candidates.front();
  std::sort(candidates.begin(), candidates.end(), std::greater<size_t>());
  for (size_t c : candidates) {
    bool passed = false;
    EMSA_RETURN_IF_ERROR(engine->Query(Gate(buckets[c]), "cudaEventQuery (bucket gate)", &passed));
    if (!passed) continue;
    std::lock_guard<std::mutex> lock(shared.mu);
    waiting.erase(std::find(waiting.begin(), waiting.end(), c));
    return c;
  }
  return kNoBucket;
}

// Which waiting bucket to update next (waiting is not empty): TakeReady's, else wait for the
// oldest's gate (copies finish in submission order) and choose again. Updating in arrival
// order instead would leave the embedding, which the next forward needs first, for last, and
// forbid any overlap of CPU updates with the next forward.
Result<size_t> HostTier::Impl::Choose(std::unique_lock<std::mutex>& lock) {
  lock.unlock();
  for (;;) {
    size_t oldest = kNoBucket;
    Result<size_t> taken = TakeReady(&oldest);
    if (!taken.ok() || *taken != kNoBucket) {
      lock.lock();
      return taken;
    }
    const auto w0 = std::chrono::steady_clock::now();
    const Status st =
        engine->Synchronize(Gate(buckets[oldest]), "cudaEventSynchronize (bucket gate)");
    choose_wait_seconds += Seconds(std::chrono::steady_clock::now() - w0);
    if (!st.ok()) {
      lock.lock();
      return st;
    }
  }
}

// A gated step's verdict, waited for before the worker takes any bucket of it (the tier's
// destructor releases a step never released, so this wait ends). Under mu, unlocked meanwhile.
Status HostTier::Impl::Verdict(std::unique_lock<std::mutex>& lock, StepOptions* step, bool* skip) {
  const StepVerdict& v = shared.verdict;
  if (!v.gated) return Status::Ok();
  if (!v.released) {
    const auto w0 = std::chrono::steady_clock::now();
    shared.cv.wait(lock, [&] { return v.released || !shared.error.ok(); });
    choose_wait_seconds += Seconds(std::chrono::steady_clock::now() - w0);
    EMSA_RETURN_IF_ERROR(shared.error);
  }
  if (!v.known) {
    lock.unlock();
    const Status st = ReadVerdict();
    lock.lock();
    EMSA_RETURN_IF_ERROR(st);
  }
  step->grad_multiplier = v.grad_multiplier;
  *skip = v.found_inf;
  return Status::Ok();
}

// The worker: takes buckets as Choose says until the tier stops (in a gated step, once its
// verdict is known); after a failure it only marks the buckets it takes done, so that no Wait
// blocks on them forever.
void HostTier::Impl::Run() {
  Status set = engine->SetDevice(options.device);
  std::unique_lock<std::mutex> lock(shared.mu);
  shared.Fail(set);
  for (;;) {
    shared.cv.wait(lock, [&] { return shared.stop || !waiting.empty() || next != kNoBucket; });
    if (waiting.empty() && next == kNoBucket) return;  // stop, and nothing left
    int64_t s = shared.step;
    StepOptions step = step_options;  // ungated: multiplier 1, as ever
    bool skip = false;
    if (shared.error.ok()) shared.Fail(Verdict(lock, &step, &skip));
    size_t index = waiting.empty() ? next : waiting.front();
    bool failed = !shared.error.ok();
    if (next != kNoBucket) {  // taken already (its first pieces are on their way)
      index = next;
      next = kNoBucket;
    } else if (!failed) {
      Result<size_t> chosen = Choose(lock);
      if (chosen.ok()) {
        index = *chosen;
      } else {
        shared.error = chosen.status();
        failed = true;
      }
    }
    if (failed) {
      auto it = std::find(waiting.begin(), waiting.end(), index);
      if (it != waiting.end()) waiting.erase(it);
    }
    lock.unlock();
    Status st = failed ? Status::Ok() : skip ? Skip(index, s) : Process(index, s, step);
    lock.lock();
    shared.Fail(st);
    if (!shared.error.ok()) buckets[index].uploaded = s;  // so no Wait() blocks on it forever
    --shared.pending;
    shared.cv.notify_all();
  }
}

}  // namespace emsa
