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

// Marks which host-tier buckets the GPU updates (Bucket::device_update, and each member's
// ParamPlan::device_update): of the buckets whose parameters are all DeviceUpdatable (and only
// where options allow it, DeviceUpdatesAllowed), a share `asked` of their elements, spread over
// the gradient-ready order (each bucket goes where the running share stays nearest it, so both
// paths have work throughout); with `asked` at -1, the balanced share s at which the host's
// memory and the PCIe links would be busy equally long: over the host tier, host memory
// (1-s) x HostMemoryTraffic + s x 2 x the moments at host_update bandwidth, each link (1-s) x
// the gradient (or update) + s x the moments at its bandwidth. No GPU in the profile: none.
// Call after MakeBuckets.
void ChooseDeviceUpdates(const ProbeRecord& record, const Bandwidths& bw, bool gpu_present,
                         double asked, Plan* plan);

// Fills plan->prediction except the arena sizes (LayoutArenas sets those): engine totals, then a
// timeline. Each bucket is ready at its ready_time; device buckets run back to back on the HBM
// engine; host buckets pass through three pipelined FIFO engines (D2H link, CPU pool, H2D link);
// GPU-updated host buckets, in submission order, wait for their moments to come up, then update.
// Both host paths run at once and share the links and the host's memory: each path gets a share
// of every bandwidth in proportion to the bytes it moves through it over the step.
// The next forward needs param i at P + f_i; the stall is the worst lateness, floored at 0.
// base_device_bytes: the device memory in use without optimizer state (see planner.cc).
void Predict(const ProbeRecord& record, const Bandwidths& bw, uint64_t base_device_bytes,
             Plan* plan);

// ChooseDeviceUpdates with options.device_update_share, then Predict. With the share at -1
// (the planner's choice), the shares 0, 0.05, ..., 1 are predicted too, and the one with the
// shortest step of those that predict no stall (at most 1% of the period) is kept where it beats
// the balanced share's by more than 1%. Gated steps (options.gated_steps) keep the share chosen
// for ungated ones and are predicted as gated.
void PlanHostPaths(const ProbeRecord& record, const Bandwidths& bw, bool gpu_present,
                   uint64_t base_device_bytes, Plan* plan);

}  // namespace emsa::plan_internal
