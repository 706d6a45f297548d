// hotness.h — slack, cost, graph centrality and hotness per parameter, and the order in which
// state leaves the device. Internal to the planner.
#pragma once

#include <cstdint>
#include <vector>

#include "emsa/plan.h"
#include "emsa/probe_record.h"
#include "plan/costs.h"

namespace emsa::plan_internal {

// Below this a window counts as empty: 1 µs, far under any real step, so it only guards the
// division (the embedding's window is ~0 by construction).
constexpr double kMinSlack = 1e-6;

// c_i / numel_i: seconds per element for the gradient down, the host update and the parameter up.
double ElementCost(DType param_dtype, const PlanOptions& options, const Bandwidths& bw);

// P = forward_time + backward_time.
double Period(const ProbeRecord& record);
// f_i: first use in forward; a parameter never used in forward is needed, at the latest, by the
// end of the next forward.
double ForwardNeed(const ProbeRecord& record, const ParamRecord& param);
// r_i: grad-ready time; a parameter whose grad never became ready is assumed ready at the end of
// backward (the latest a gradient can appear), which makes it look hot rather than cold.
double GradReady(const ProbeRecord& record, const ParamRecord& param);

// Per parameter, in record order: the share of graph ops reachable from (downstream of, and
// including) the ops that read it. All zero when the record has no graph. O((ops + edges) *
// ops / 64 + params * ops / 64): exact, and fast enough for 10k params on a 50k-op graph.
std::vector<double> GraphCentrality(const ProbeRecord& record);

// Fills slack, cost, centrality and hotness of every trainable entry of `params` (record order).
void ComputeHeat(const ProbeRecord& record, const Bandwidths& bw, const PlanOptions& options,
                 std::vector<ParamPlan>* params);

// Trainable indices, coldest first, and sets offload_rank. Coldest = least hotness per byte of
// device state freed: moving state to the host is a knapsack (free enough bytes, add the least
// host load), and a cost that scales with bytes makes this the order of longest windows first:
// the output head and the late layers, never the embedding. Ties: the lower hotness, then the lower
// index first. Zero-byte parameters free nothing and come last.
std::vector<int64_t> OffloadOrder(const PlanOptions& options, const Bandwidths& bw,
                                  std::vector<ParamPlan>* params);

}  // namespace emsa::plan_internal
