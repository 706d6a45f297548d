// thread_pool.h — a persistent pool of worker threads for the host tier.
//
// Threads are created once. Run(fn) wakes every worker, runs fn(worker_index, worker_count) on
// each (the calling thread is worker 0), and returns when all have finished: a fork-join with no
// allocation and no thread creation per call. Not reentrant; one Run at a time per pool, from
// one thread at a time.
//
// Wake-up: an idle worker first spins for a few tens of microseconds (back-to-back Runs, as the
// engine issues per gradient bucket, then cost no futex round trip), then sleeps on a condition
// variable. Spinning is off when the pool has more threads than the CPUs it may run on, where
// it would only steal time from the threads doing the work.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace emsa {

class ThreadPool {
 public:
  // threads <= 0: the number of CPUs this process may run on (sched_getaffinity). Throws
  // std::system_error when the OS refuses a thread (callers in the library catch it).
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // fn is called once per worker with (index, count). A function_ref-like pointer pair is used
  // so no std::function is allocated per call. fn must not throw.
  template <typename Fn>
  void Run(Fn&& fn) {
    RunImpl(&CallThunk<std::remove_reference_t<Fn>>,
            const_cast<void*>(static_cast<const void*>(&fn)));
  }

  // Splits [0, n) into size() near-equal contiguous ranges and calls fn(begin, end) for each
  // non-empty one (see SplitRange).
  template <typename Fn>
  void ParallelFor(int64_t n, int64_t grain, Fn&& fn) {
    Run([&](int index, int count) {
      int64_t begin = 0, end = 0;
      SplitRange(n, grain, index, count, &begin, &end);
      if (begin < end) fn(begin, end);
    });
  }

  // Range `index` of `count` over [0, n): the ranges are contiguous, in index order, and cover
  // [0, n) exactly. Work is cut in blocks of `grain` elements (grain <= 0 counts as 1), so every
  // boundary between ranges is a multiple of grain; blocks are dealt as evenly as possible (sizes
  // differ by at most one block), and only the range that ends at n may hold a partial block.
  // Ranges may be empty (begin == end) when there are fewer blocks than ranges; n <= 0 gives
  // empty ranges. No overflow for any n up to INT64_MAX.
  static void SplitRange(int64_t n, int64_t grain, int index, int count, int64_t* begin,
                         int64_t* end);
  // CPUs in this process's affinity mask (at least 1).
  static int AvailableCpus();

 private:
  using Thunk = void (*)(void*, int, int);
  template <typename Fn>
  static void CallThunk(void* fn, int index, int count) {
    (*static_cast<Fn*>(fn))(index, count);
  }
  void RunImpl(Thunk thunk, void* fn);
  void WorkerLoop(int index);
  void Shutdown();
  uint64_t WaitForWork(uint64_t seen);
  void WaitForWorkers();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  // Written by Run before generation_ is published (release) and read by workers after they
  // observe it (acquire), so they need no lock.
  Thunk thunk_ = nullptr;
  void* fn_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  bool stop_ = false;  // set under mu_ together with a generation bump
  bool spin_ = true;
};

}  // namespace emsa
