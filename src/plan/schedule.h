// schedule.h — update buckets and the predicted step. Internal to the planner.
#pragma once

#include <cstdint>

#include "emsa/plan.h"
#include "emsa/probe_record.h"
#include "plan/costs.h"
#include "plan/layout.h"

namespace emsa::plan_internal {

// Walks trainable params in gradient-ready order and cuts a bucket when the tier changes or the
// bucket's parameter bytes would pass options.bucket_bytes (a larger tensor gets its own).
// Fills plan->buckets and each member's ParamPlan::bucket.
void MakeBuckets(const ProbeRecord& record, const LayoutOrder& order, Plan* plan);

// Fills plan->prediction except the arena sizes (LayoutArenas sets those): engine totals, then a
// timeline. Each bucket is ready at its ready_time; device buckets run back to back on the HBM
// engine; host buckets pass through three pipelined FIFO engines (D2H link, CPU pool, H2D link).
// The next forward needs param i at P + f_i; the stall is the worst lateness, floored at 0.
// base_device_bytes: the device memory in use without optimizer state (see planner.cc).
void Predict(const ProbeRecord& record, const Bandwidths& bw, uint64_t base_device_bytes,
             Plan* plan);

}  // namespace emsa::plan_internal
