// emsa/plan.h — where every byte of optimizer state lives and when every update runs.
//
// MakePlan() is pure C++ (no CUDA, no clocks): the same ProbeRecord, DeviceProfile and
// PlanOptions always give a byte-identical Plan and PlanToJson() text.
//
// The model (DESIGN.md, "Hotness is slack"): parameter i's gradient is ready at r_i in backward,
// its next use is f_i in the next forward, the step period is P. Its update may run anywhere in
// the window s_i = P + f_i - r_i (floored at 1 µs). Sending its update to the host costs c_i
// (gradient down over PCIe, CPU update at host bandwidth, parameter back up). hotness_i =
// c_i / s_i, scaled by (1 + centrality_i) when the record has a graph, where centrality_i is the
// share of graph ops downstream of (and including) the ops that read the parameter. A parameter
// never used in forward has f_i = forward_time; one whose gradient never became ready has
// r_i = P. Profile bandwidths that are 0 (not measured) default to HBM 2e12, PCIe 25e9 each way
// and host update 50e9 B/s (host update falls back to host_mem_bandwidth first).
//
// Tiers: L1 (device arena) and L2 (pinned host arena; an L2 parameter is updated by the CPU or,
// see PlanOptions::device_update_share, by the GPU with its moments streamed through). L0 (a
// persisting-L2 window, which DeviceUpdateTable::SetAccessWindow can apply) is not assigned: it
// gave an update no measurable gain (docs/decisions.md).
// Frozen parameters get no state (tier L1, no views, bucket -1). State leaves the device coldest
// first, where "coldest" is the least hotness per byte of device state freed (a cost that scales
// with bytes makes this the longest window first: the output head, then the late layers; never the
// embedding), until the budget is met: peak device bytes = max(record.peak_device_bytes, bytes
// of all parameters + gradients of the trainable ones) + the device arena (its 2 MiB padding
// included). With release_grads, gradients do not accumulate: from each memory sample of the
// record, and from its peak (placed at the largest sample), the gradients final by then are
// taken out, and two buckets' worth in flight added back. When nothing fits, MakePlan fails with
// the smallest budget that works: with every state on the host (or, without the host tier, every
// state on the device).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emsa/probe_record.h"
#include "emsa/profile.h"
#include "emsa/status.h"
#include "emsa/types.h"

namespace emsa {

struct PlanOptions {
  // Device memory the whole training process may use at its peak (parameters, gradients,
  // activations, optimizer state, emsa's workspace). 0 = the profile's free memory minus
  // safety_margin_bytes; with no GPU in the profile, 0 means "no device limit".
  uint64_t budget_bytes = 0;
  uint64_t safety_margin_bytes = 1ull << 30;  // kept free when the budget is defaulted
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  DType state_dtype = DType::kFloat32;  // exp_avg / exp_avg_sq precision (bf16: CUDA issue)
  bool allow_host_tier = true;          // false: everything on the device or infeasible
  bool force_all_host = false;          // put every state on the host (benchmarks, tests)
  uint64_t bucket_bytes = 32ull << 20;  // target parameter bytes per update bucket
  // Gradients are freed during backward as their bucket is updated or copied to the host (the
  // optimizer's step_in_backward): the peak then holds only those in flight, about two buckets.
  bool release_grads = false;
  // Every step's updates wait for a verdict that needs all of its gradients: clipping by the
  // global norm, the non-finite check, a loss scale (HostTierOptions::gated). With release_grads
  // the host tier's gradient copies still go down during backward, but no update starts before
  // backward ends: the prediction counts that wait (the GPU path's share, device_update_share
  // -1, is chosen as for ungated steps).
  bool gated_steps = false;
  uint64_t device_module_alignment = 2ull << 20;  // modules with >= this much state start here
  uint64_t device_tensor_alignment = 256;         // every device view starts at a multiple
  uint64_t host_tensor_alignment = 64;            // every host view starts at a multiple
  // Of the host tier's parameters the GPU can update (fp32 ones), the share (by elements) it
  // does update, their moments streamed from the host arena and back (HostTierTensor::
  // device_update): the host's memory then carries 2 x the moments' bytes per parameter instead
  // of the CPU path's update and DMA traffic, PCIe the moments each way instead of the gradient
  // down and the update up. Chosen by whole buckets, spread over the gradient-ready order so
  // that both paths have work from the first gradients of backward to the last.
  // -1: with release_grads, the share at which the CPU path and the PCIe links finish together
  // (the bandwidths of the profile), or the share of 0, 0.05, ..., 1 whose predicted step is
  // shortest, where it is more than 1% shorter than that one's and predicts no stall (the
  // framework's period under the host tier's load counted), else none (a step() after backward
  // waits for every gradient to be read, the GPU path's only after its moments came up); 0: none
  // (the CPU updates every host-tier parameter); up to 1.
  double device_update_share = -1.0;
};

// One parameter's plan. Offsets are bytes from the start of the owning arena; -1 = absent.
struct ParamPlan {
  int64_t index = 0;  // position in ProbeRecord::params
  std::string name;
  std::string module;
  int64_t numel = 0;
  DType param_dtype = DType::kFloat32;
  bool trainable = true;
  Tier tier = Tier::kL1;
  DType state_dtype = DType::kFloat32;
  bool master_weights = false;  // fp32 master copy kept in state (param is bf16/fp16, or L2)
  double slack = 0.0;           // s, s_i
  double cost = 0.0;            // s, c_i
  double centrality = 0.0;      // [0,1], share of graph ops downstream of this param's ops
  double hotness = 0.0;         // c_i / s_i * (1 + centrality): share of its window a host
                                // round trip would take
  // Position in the order state leaves the device (0 = first: the lowest hotness per byte of
  // device state freed). -1 for frozen parameters. With k params on L2, they are exactly the
  // ones with offload_rank < k.
  int64_t offload_rank = -1;
  int64_t bucket = -1;         // index into Plan::buckets
  bool device_update = false;  // host tier, updated by the GPU (PlanOptions::device_update_share)
  // Views. Device tier: exp_avg, exp_avg_sq, master in the device arena. Host tier: exp_avg,
  // exp_avg_sq, master and grad (staging for the device->host copy; a 16-bit param's update
  // writes the rounded param over it for the host->device copy) in the host arena.
  int64_t exp_avg_offset = -1;
  int64_t exp_avg_sq_offset = -1;  // -1 for Lion
  int64_t master_offset = -1;
  int64_t grad_offset = -1;  // host tier only
  uint64_t state_bytes = 0;  // bytes this parameter occupies in its arena, padding included
};

// A contiguous range of one module's state in one tier's arena. In the host arena a module's
// views lie in two ranges: those a copy to or from the device touches in the arena's page-locked
// prefix (locked_offset, locked_bytes), the rest after it, in memory no DMA reads (offset, bytes).
struct ModuleRange {
  std::string module;
  Tier tier = Tier::kL1;
  uint64_t offset = 0;  // in the arena of that tier
  uint64_t bytes = 0;
  uint64_t locked_offset = 0;  // host tier only
  uint64_t locked_bytes = 0;   // host tier only; 0 on the device tier
};

// Parameters whose updates launch together, in grad-ready order, all of one tier.
struct Bucket {
  Tier tier = Tier::kL1;
  bool device_update = false;   // host tier: its members are updated by the GPU
  std::vector<int64_t> params;  // indices into Plan::params
  double ready_time = 0.0;      // s, the last member's grad-ready time
  uint64_t param_bytes = 0;
};

struct Prediction {
  double period = 0.0;  // s, P = forward + backward from the probe, times
                        // load_slowdown
  // How much longer forward and backward take while the host tier loads the host's memory and
  // PCIe (ProbeRecord::period_under_load over the probe's P), in the share of the period the
  // host tier's host-memory traffic would keep the probe's load (emsa::HostLoad) busy: 1
  // without a host tier or that measurement.
  double load_slowdown = 1.0;
  double hbm_time = 0.0;              // s, device-tier update traffic / HBM bandwidth
  double d2h_time = 0.0;              // s, host-tier gradients down / d2h bandwidth (lower
                                      // while the CPU path updates: duplex_under_update)
  double h2d_time = 0.0;              // s, host-tier parameters up / h2d bandwidth (likewise)
  double cpu_time = 0.0;              // s, host-tier update traffic plus the DMA's gradient and
                                      // parameter bytes (they share DRAM) / host update bandwidth
  double stall_time = 0.0;            // s, how long the next forward waits (timeline simulation)
  double step_time = 0.0;             // s, period + stall
  uint64_t device_state_bytes = 0;    // device arena size
  uint64_t host_state_bytes = 0;      // host arena size
  uint64_t peak_device_bytes = 0;     // predicted peak, optimizer state included
  double device_update_share = 0.0;   // of the host tier's parameters (elements), GPU-updated
  uint64_t stream_staging_bytes = 0;  // device staging of the GPU-updated ones (in the peak)
  // The host arena's prefix that holds every view a copy to or from the device touches (the
  // gradient staging, the rounded parameters, fp32 masters, GPU-updated moments): what must be
  // page-locked. The rest, from here to host_state_bytes, only CPU threads touch. A multiple of
  // kHostArenaPageBytes where anything follows it.
  uint64_t host_locked_bytes = 0;
};

struct Plan {
  static constexpr int kVersion = 1;
  PlanOptions options;
  uint64_t budget_bytes = 0;         // the budget actually applied (resolved); 0 = no device limit
  uint64_t min_budget_bytes = 0;     // the smallest budget this model could be planned under with
                                     // these options
  bool host_only = false;            // planned for a machine without a GPU: the device tier's
                                     // state, like everything else, lives in host memory
  std::vector<ParamPlan> params;     // same order as ProbeRecord::params
  std::vector<ModuleRange> modules;  // arena order
  std::vector<Bucket> buckets;       // grad-ready order
  Prediction prediction;
};

// kInfeasible when the budget cannot be met, with the smallest budget that works in the message.
// *min_budget_out (when given) receives that smallest budget whenever the inputs are valid, on
// success too. kInvalidArgument for bad options or a record ValidateProbeRecord() rejects; then
// nothing is written.
Result<Plan> MakePlan(const ProbeRecord& record, const DeviceProfile& profile,
                      const PlanOptions& options, uint64_t* min_budget_out = nullptr);

// What the advice for a budget that cannot be met may suggest changing about a model known by its
// config (ModelProbeOptions), whose shape the user chooses.
struct ModelChoices {
  bool activation_checkpointing = false;
  DType param_dtype = DType::kBFloat16;
};

// The message for a person when MakePlan(record, profile, options) failed with `infeasible`
// (kInfeasible) and the smallest budget that works, `min_budget`, as the emsa command prints it
// after "emsa: " (both CLIs and the C ABI's emsa_plan_infeasible_message use this one text):
// lines joined by '\n', no newline at the end. For a record from a training run (`model` null):
// MakePlan's message, then "smallest feasible budget: SIZE (--budget BYTES)". For a model known
// by its config: what it needs with the options given and with the host tier switched, against
// the budget applied; what would shrink the need, in the command's flags; MakePlan's message;
// then "smallest feasible budget: SIZE (--gpu-mem BYTES)".
std::string InfeasibleBudgetMessage(const ProbeRecord& record, const DeviceProfile& profile,
                                    const PlanOptions& options, const Status& infeasible,
                                    uint64_t min_budget, const ModelChoices* model = nullptr);

std::string PlanToJson(const Plan& plan);
// A table a person can read: one row per parameter (tier, state bytes, slack, hotness, bucket),
// module ranges, and the prediction.
std::string PlanToTable(const Plan& plan);
// The same table without the per-parameter rows and module ranges: totals and prediction only.
std::string PlanSummaryToTable(const Plan& plan);

// The host memory the plan needs: the host tier's arena, and on a machine without a GPU the whole
// predicted peak as well.
uint64_t HostMemoryNeeded(const Plan& plan);
// Whether HostMemoryNeeded fits in the host's RAM (profile.cpu.host_memory; true when unknown).
bool PlanFitsHost(const Plan& plan, const DeviceProfile& profile);
// The plan's answer first, for a person, in four lines ending in '\n': whether it fits (the
// peak against the budget and the card's memory, host memory against the host's RAM), the
// predicted step time and tokens/s, the host memory needed, and the tier split.
// `tokens_per_step` 0: no tokens/s (a probe record does not say how many tokens a step trains).
std::string PlanVerdict(const Plan& plan, const DeviceProfile& profile, int64_t tokens_per_step);

}  // namespace emsa
