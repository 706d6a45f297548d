// Tests for src/common/thread_pool.h: every worker runs once per Run, many Runs in a row,
// oversubscribed pools, and SplitRange's exact, grain-aligned, balanced cover of [0, n).
#include "common/thread_pool.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <thread>
#include <vector>

namespace emsa {
namespace {

// Runs `runs` times and checks every index in [0, size) was called exactly once each time,
// with the right count, and that worker 0 is the calling thread.
void CheckEveryIndexOncePerRun(ThreadPool& pool, int runs) {
  const int n = pool.size();
  std::vector<std::atomic<int>> calls(static_cast<size_t>(n));
  std::atomic<int> bad_count{0};
  std::atomic<int> worker0_elsewhere{0};
  const std::thread::id caller = std::this_thread::get_id();
  for (int run = 0; run < runs; ++run) {
    pool.Run([&](int index, int count) {
      if (count != n) bad_count.fetch_add(1);
      if (index == 0 && std::this_thread::get_id() != caller) worker0_elsewhere.fetch_add(1);
      calls[static_cast<size_t>(index)].fetch_add(1, std::memory_order_relaxed);
    });
    // Run returned: every worker has finished, so all increments are visible now.
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(calls[static_cast<size_t>(i)].load(), run + 1) << "index " << i << " run " << run;
    }
  }
  EXPECT_EQ(bad_count.load(), 0);
  EXPECT_EQ(worker0_elsewhere.load(), 0);
}

TEST(ThreadPool, EveryIndexOncePerRunManyRuns) {
  for (int threads : {1, 2, 3, 4}) {
    ThreadPool pool(threads);
    ASSERT_EQ(pool.size(), threads);
    CheckEveryIndexOncePerRun(pool, 2000);
  }
}

TEST(ThreadPool, OversubscribedPoolStillCompletes) {
  // More threads than CPUs: spinning is off, so this exercises the sleeping path.
  ThreadPool pool(ThreadPool::AvailableCpus() * 3 + 1);
  CheckEveryIndexOncePerRun(pool, 300);
}

TEST(ThreadPool, DefaultSizeIsAvailableCpus) {
  ThreadPool pool;
  EXPECT_EQ(pool.size(), ThreadPool::AvailableCpus());
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_EQ(ThreadPool::AvailableCpus(), CPU_COUNT(&set));
}

TEST(ThreadPool, WorkersSeeCallerWritesAndCallerSeesWorkerWrites) {
  ThreadPool pool(3);
  std::vector<int64_t> data(3000);
  for (int round = 1; round <= 50; ++round) {
    for (size_t i = 0; i < data.size(); ++i) data[i] = round;  // plain writes before Run
    pool.ParallelFor(static_cast<int64_t>(data.size()), 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) data[static_cast<size_t>(i)] *= 2;
    });
    for (size_t i = 0; i < data.size(); ++i) ASSERT_EQ(data[i], 2 * round) << i;
  }
}

TEST(ThreadPool, ParallelForCoversEachElementOnce) {
  ThreadPool pool(3);
  for (int64_t n : {0, 1, 5, 63, 64, 65, 1000, 4097}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    pool.ParallelFor(n, 64, [&](int64_t b, int64_t e) {
      EXPECT_EQ(b % 64, 0);
      for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)].fetch_add(1);
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << n;
  }
}

// Checks SplitRange's contract for one (n, grain, count).
void CheckSplit(int64_t n, int64_t grain, int count) {
  SCOPED_TRACE(testing::Message() << "n=" << n << " grain=" << grain << " count=" << count);
  const int64_t g = grain <= 0 ? 1 : grain;
  int64_t expect_begin = 0;
  int64_t min_blocks = INT64_MAX, max_blocks = 0;
  for (int i = 0; i < count; ++i) {
    int64_t b = -1, e = -1;
    ThreadPool::SplitRange(n, grain, i, count, &b, &e);
    if (n <= 0) {
      EXPECT_EQ(b, e);
      continue;
    }
    ASSERT_EQ(b, expect_begin) << "range " << i << " does not start where " << i - 1 << " ended";
    ASSERT_LE(b, e);
    ASSERT_LE(e, n);
    if (e != n) EXPECT_EQ(e % g, 0) << "inner boundary not a multiple of grain";
    const int64_t blocks = (e - b + g - 1) / g;
    min_blocks = std::min(min_blocks, blocks);
    max_blocks = std::max(max_blocks, blocks);
    expect_begin = e;
  }
  if (n > 0) {
    EXPECT_EQ(expect_begin, n) << "ranges do not reach n";
    EXPECT_LE(max_blocks - min_blocks, 1) << "unbalanced";
  }
}

TEST(ThreadPool, SplitRangeCoversExactlyWithGrainAlignment) {
  for (int64_t n : {-5, 0, 1, 2, 7, 63, 64, 65, 127, 1000, 4097, 1 << 20})
    for (int64_t grain : {-1, 0, 1, 3, 16, 64, 1000})
      for (int count : {1, 2, 3, 7, 16}) CheckSplit(n, grain, count);
}

TEST(ThreadPool, SplitRangeHugeNDoesNotOverflow) {
  CheckSplit(INT64_MAX, 64, 16);
  CheckSplit(INT64_MAX - 5, 1, 3);
  CheckSplit(INT64_MAX, INT64_MAX / 2, 5);
}

TEST(ThreadPool, SplitRangeOutOfRangeIndexIsEmpty) {
  int64_t b = 7, e = 9;
  ThreadPool::SplitRange(100, 1, 3, 3, &b, &e);
  EXPECT_EQ(b, e);
  ThreadPool::SplitRange(100, 1, -1, 3, &b, &e);
  EXPECT_EQ(b, e);
}

}  // namespace
}  // namespace emsa
