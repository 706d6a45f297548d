// fake_copy_engine.h — a CopyEngine (engine/copy_engine.h) without a GPU, for the host tier's
// CPU tests: "device" memory is host memory, each stream a thread that runs its work in order
// (copies are memcpy, optionally after a random delay, so streams interleave as they may on a
// GPU), and events are kept honestly (a record completes when its stream reaches it; a wait or
// a query sees the last record as of its call). Ordering bugs in the tier then show as wrong
// bits, not as luck. Test hooks: work of the test's own on a stream, a stream held shut until
// released, a failing call, and how far the D2H copies ran ahead of the host's waits.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/copy_engine.h"

namespace emsa {

class FakeCopyEngine final : public CopyEngine {
 public:
  enum Call { kCopyToHost, kCopyToDevice, kQuery, kSynchronize, kCalls };

  // Each copy waits a random 0..max_delay_us before it runs (in its stream's order).
  explicit FakeCopyEngine(int max_delay_us = 0, uint32_t seed = 1)
      : max_delay_us_(max_delay_us), rng_(seed) {}
  ~FakeCopyEngine() override {
    for (auto& s : streams_) {
      {
        std::lock_guard<std::mutex> lock(s->mu);
        s->stop = true;
      }
      s->cv.notify_all();
      s->thread.join();
    }
    for (void* p : allocations_) std::free(p);
  }

  cudaStream_t NewStream() {
    streams_.push_back(std::make_unique<Stream>());
    Stream* s = streams_.back().get();
    s->thread = std::thread([s] { s->Run(); });
    return reinterpret_cast<cudaStream_t>(s);
  }
  // The test's own work (a "kernel"), in the stream's order.
  void Enqueue(cudaStream_t stream, std::function<void()> op) { Of(stream)->Push(std::move(op)); }
  // Work enqueued on `stream` after this waits until the Release() that opens it (holds open
  // in the order they were made).
  void Hold(cudaStream_t stream) {
    int64_t id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      id = ++holds_;
    }
    Enqueue(stream, [this, id] {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return released_ >= id; });
    });
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++released_;
    }
    cv_.notify_all();
  }
  // The n-th call (1-based, counted from now) of `call` fails with kCudaError.
  void FailNth(Call call, int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_at_[call] = calls_[call] + n;
  }
  int64_t copies_to_host() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_[kCopyToHost];
  }
  // The most D2H copies ever enqueued beyond the one a Synchronize on an event recorded after
  // it (on `stream`) waited for: how far the copies ran ahead of the host.
  int64_t max_copies_ahead(cudaStream_t stream) const {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t most = 0;
    for (const auto& w : waits_) {
      if (w.stream == stream) most = std::max(most, w.enqueued - w.copies_before);
    }
    return most;
  }

  // Blocks until some thread waits in Synchronize on an event last recorded on `stream`.
  void AwaitBlockedOn(cudaStream_t stream) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return std::count(blocked_.begin(), blocked_.end(), stream) > 0; });
  }

  Status SetDevice(int) override { return Status::Ok(); }
  Status CreateEvent(bool timed, bool, cudaEvent_t* out) override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::make_unique<Event>());
    events_.back()->timed = timed;
    *out = reinterpret_cast<cudaEvent_t>(events_.back().get());
    return Status::Ok();
  }
  // Kept until the engine goes: work still queued may complete a record of it.
  void DestroyEvent(cudaEvent_t) override {}
  Status Record(cudaEvent_t event, cudaStream_t stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    Event* e = Of(event);
    const int64_t g = ++e->recorded;
    e->stream = stream;
    e->copies_before = calls_[kCopyToHost];
    Of(stream)->Push([this, e, g] {
      std::lock_guard<std::mutex> inner(mu_);
      e->completed = std::max(e->completed, g);
      e->at = std::chrono::steady_clock::now();
      cv_.notify_all();
    });
    return Status::Ok();
  }
  Status StreamWait(cudaStream_t stream, cudaEvent_t event) override {
    std::lock_guard<std::mutex> lock(mu_);
    Event* e = Of(event);
    const int64_t g = e->recorded;
    Of(stream)->Push([this, e, g] {
      std::unique_lock<std::mutex> inner(mu_);
      cv_.wait(inner, [&] { return e->completed >= g; });
    });
    return Status::Ok();
  }
  Status Query(cudaEvent_t event, const char* what, bool* done) override {
    std::lock_guard<std::mutex> lock(mu_);
    EMSA_RETURN_IF_ERROR(Count(kQuery, what));
    const Event* e = Of(event);
    *done = e->completed >= e->recorded;
    return Status::Ok();
  }
  Status Synchronize(cudaEvent_t event, const char* what) override {
    std::unique_lock<std::mutex> lock(mu_);
    EMSA_RETURN_IF_ERROR(Count(kSynchronize, what));
    Event* e = Of(event);
    const int64_t g = e->recorded;
    waits_.push_back({e->stream, e->copies_before, calls_[kCopyToHost]});
    if (e->completed >= g) return Status::Ok();
    blocked_.push_back(e->stream);
    cv_.notify_all();
    cv_.wait(lock, [&] { return e->completed >= g; });
    blocked_.erase(std::find(blocked_.begin(), blocked_.end(), e->stream));
    return Status::Ok();
  }
  Status ElapsedSeconds(cudaEvent_t start, cudaEvent_t end, double* out) override {
    std::lock_guard<std::mutex> lock(mu_);
    const Event *a = Of(start), *b = Of(end);
    if (!a->timed || !b->timed) return Status::CudaError("elapsed time of an untimed event");
    if (a->completed < a->recorded || b->completed < b->recorded || a->recorded == 0 ||
        b->recorded == 0) {
      return Status::CudaError("elapsed time of an event not completed: cudaErrorNotReady");
    }
    *out = std::chrono::duration<double>(b->at - a->at).count();
    return Status::Ok();
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes, cudaStream_t stream) override {
    return Copy(kCopyToHost, dst, src, bytes, stream);
  }
  Status CopyToDevice(void* dst, const void* src, size_t bytes, cudaStream_t stream) override {
    return Copy(kCopyToDevice, dst, src, bytes, stream);
  }
  Status ApplyDelta(float* param, const float* delta, int64_t n, float decay,
                    cudaStream_t stream) override {
    Of(stream)->Push([=] {
      for (int64_t i = 0; i < n; ++i) {
        volatile float scaled = param[i] * decay;  // no contraction into an FMA, as the kernel
        param[i] = scaled + delta[i];
      }
    });
    return Status::Ok();
  }
  Status AllocateDevice(size_t bytes, void** out) override {
    *out = std::malloc(bytes);
    return *out != nullptr ? Status::Ok() : Status::OutOfMemory("malloc failed");
  }
  // As cudaFree, after every stream's work (which may still read it): here, with the engine.
  void FreeDevice(void* ptr) override {
    std::lock_guard<std::mutex> lock(mu_);
    allocations_.push_back(ptr);
  }
  Status AllocatePinned(size_t bytes, void** out) override { return AllocateDevice(bytes, out); }
  void FreePinned(void* ptr) override { FreeDevice(ptr); }

 private:
  struct Stream {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> work;
    bool stop = false;
    std::thread thread;

    void Push(std::function<void()> op) {
      {
        std::lock_guard<std::mutex> lock(mu);
        work.push_back(std::move(op));
      }
      cv.notify_all();
    }
    // Runs the work in order; at stop, what is queued first.
    void Run() {
      std::unique_lock<std::mutex> lock(mu);
      for (;;) {
        cv.wait(lock, [&] { return stop || !work.empty(); });
        if (work.empty()) return;
        std::function<void()> op = std::move(work.front());
        work.pop_front();
        lock.unlock();
        op();
        lock.lock();
      }
    }
  };
  struct Event {
    bool timed = false;
    int64_t recorded = 0, completed = 0;
    cudaStream_t stream = nullptr;  // of the last record
    int64_t copies_before = 0;      // D2H copies enqueued before the last record
    std::chrono::steady_clock::time_point at;
  };
  struct Waited {
    cudaStream_t stream;
    int64_t copies_before, enqueued;
  };

  static Stream* Of(cudaStream_t s) { return reinterpret_cast<Stream*>(s); }
  static Event* Of(cudaEvent_t e) { return reinterpret_cast<Event*>(e); }

  // Under mu_: counts a call; the one FailNth named fails.
  Status Count(Call call, const char* what) {
    if (++calls_[call] != fail_at_[call]) return Status::Ok();
    return Status::CudaError(std::string(what) + ": cudaErrorLaunchFailure (injected by the test)");
  }
  Status Copy(Call call, void* dst, const void* src, size_t bytes, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    EMSA_RETURN_IF_ERROR(Count(call, call == kCopyToHost ? "cudaMemcpyAsync D2H" : "H2D"));
    const int delay = max_delay_us_ > 0 ? static_cast<int>(rng_() % (max_delay_us_ + 1)) : 0;
    Of(stream)->Push([=] {
      if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
      std::memcpy(dst, src, bytes);
    });
    return Status::Ok();
  }

  const int max_delay_us_;
  mutable std::mutex mu_;  // events, counters, the holds
  std::condition_variable cv_;
  std::mt19937 rng_;
  int64_t holds_ = 0, released_ = 0;
  int64_t calls_[kCalls] = {};
  int64_t fail_at_[kCalls] = {};
  std::vector<Waited> waits_;
  std::vector<cudaStream_t> blocked_;  // of the threads in Synchronize, the event's stream
  std::vector<std::unique_ptr<Event>> events_;
  std::vector<void*> allocations_;  // freed by the tier, released with the engine
  std::vector<std::unique_ptr<Stream>> streams_;
};

}  // namespace emsa
