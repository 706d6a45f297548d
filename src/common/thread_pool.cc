// thread_pool.cc — persistent fork-join workers: spin briefly, then sleep on a condition variable.
#include "common/thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace emsa {
namespace {

// Long enough to bridge the gap between the engine's back-to-back Runs (a few microseconds),
// short enough that an idle pool gives its cores back quickly.
constexpr std::chrono::microseconds kSpinTime{50};

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Spins until done() or kSpinTime has passed; reading the clock only every 64 rounds keeps the
// loop cheap. Returns whether done() became true.
template <typename Pred>
bool SpinUntil(Pred done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpinTime;
  for (int round = 1;; ++round) {
    if (done()) return true;
    CpuRelax();
    if ((round & 63) == 0 && std::chrono::steady_clock::now() >= deadline) return false;
  }
}

}  // namespace

ThreadPool::ThreadPool(int threads) {
  const int cpus = AvailableCpus();
  const int count = threads > 0 ? threads : cpus;
  spin_ = count <= cpus;
  try {
    workers_.reserve(static_cast<size_t>(count - 1));
    for (int i = 1; i < count; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
  } catch (...) {
    // Out of threads or memory: stop the ones already running (a joinable std::thread must not
    // be destroyed), then let the caller turn the exception into a Status.
    Shutdown();
    throw;
  }
}

ThreadPool::~ThreadPool() { Shutdown(); }

void ThreadPool::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

int ThreadPool::AvailableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  // More CPUs than cpu_set_t holds (> 1024), or no affinity support: every online CPU.
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

void ThreadPool::SplitRange(int64_t n, int64_t grain, int index, int count, int64_t* begin,
                            int64_t* end) {
  *begin = *end = 0;
  if (n <= 0 || count <= 0 || index < 0 || index >= count) return;
  if (grain <= 0) grain = 1;
  const int64_t blocks = n / grain + (n % grain != 0);
  // The first `extra` ranges get one block more; index * per <= blocks, so nothing overflows.
  const int64_t per = blocks / count;
  const int64_t extra = blocks % count;
  const int64_t first = per * index + std::min<int64_t>(index, extra);
  const int64_t last = first + per + (index < extra ? 1 : 0);
  *begin = first >= blocks ? n : first * grain;
  *end = last >= blocks ? n : last * grain;
}

void ThreadPool::RunImpl(Thunk thunk, void* fn) {
  if (workers_.empty()) {
    thunk(fn, 0, 1);
    return;
  }
  thunk_ = thunk;
  fn_ = fn;
  pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  {
    // Under the lock so a worker between checking its predicate and sleeping cannot miss it.
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  thunk(fn, 0, size());
  WaitForWorkers();
}

void ThreadPool::WaitForWorkers() {
  auto all_done = [this] { return pending_.load(std::memory_order_acquire) == 0; };
  if (spin_ && SpinUntil(all_done)) return;
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, all_done);
}

uint64_t ThreadPool::WaitForWork(uint64_t seen) {
  auto changed = [&] { return generation_.load(std::memory_order_acquire) != seen; };
  if (!(spin_ && SpinUntil(changed))) {
    std::unique_lock<std::mutex> lock(mu_);
    wake_.wait(lock, changed);
  }
  return generation_.load(std::memory_order_acquire);
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    seen = WaitForWork(seen);
    // stop_ is written before the generation bump that woke us (release/acquire): no lock.
    if (stop_) return;
    thunk_(fn_, index, size());
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // The lock orders this notify after Run's predicate check, so the wake cannot be lost.
      std::lock_guard<std::mutex> lock(mu_);
      done_.notify_one();
    }
  }
}

}  // namespace emsa
