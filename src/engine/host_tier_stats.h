// host_tier_stats.h — the host tier's measurements of its last steps (HostTierStepStats), a
// ring of `history` steps indexed by step number.
//
// Not thread-safe: the host tier calls it under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "emsa/host_tier.h"

namespace emsa {

class StatsRing {
 public:
  void Reset(size_t history) {
    stats_.assign(history, HostTierStepStats{});
    uploads_timed_.assign(history, 0);
  }

  // Step s's entry (whether it is still held or not: see Holds).
  HostTierStepStats& Of(int64_t s) { return stats_[Index(s)]; }
  const HostTierStepStats& Of(int64_t s) const { return stats_[Index(s)]; }
  // Whether step s is still in the ring while step `current` runs.
  bool Holds(int64_t s, int64_t current) const {
    return s > current - static_cast<int64_t>(stats_.size());
  }

  // Step s starts: its entry is cleared.
  void Begin(int64_t s) {
    Of(s) = HostTierStepStats{};
    Of(s).step = s;
    uploads_timed_[Index(s)] = 0;
  }

  // An upload's time for step s (dropped once s fell out of the ring); the step's stats are
  // complete once every bucket submitted in it has been timed.
  void AddUpload(int64_t s, int64_t current, double seconds) {
    if (!Holds(s, current)) return;
    HostTierStepStats& st = Of(s);
    st.h2d_s += seconds;
    st.complete = ++uploads_timed_[Index(s)] == st.buckets;
  }

  // Steps [first, current], the ones still held, oldest first, at most `capacity`.
  size_t Copy(int64_t first, int64_t current, HostTierStepStats* out, size_t capacity) const {
    const int64_t oldest = current - static_cast<int64_t>(stats_.size()) + 1;
    if (first < oldest) first = oldest;
    if (first < 1) first = 1;
    size_t n = 0;
    for (int64_t s = first; s <= current && n < capacity; ++s) out[n++] = Of(s);
    return n;
  }

 private:
  size_t Index(int64_t s) const { return static_cast<size_t>(s) % stats_.size(); }

  std::vector<HostTierStepStats> stats_;
  std::vector<int64_t> uploads_timed_;  // per entry: buckets whose upload has been timed
};

}  // namespace emsa
