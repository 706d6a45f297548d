// emsa/cuda_update.h — the device tier's optimizer step: fused multi-tensor CUDA updates.
//
// Two objects, made once at bind time and kept for the run; neither allocates after Create():
//
//  - DeviceScalars: the numbers a step reads, in device memory — per param group the
//    hyperparameters and the step count, and per step the gradient multiplier (1 / loss_scale,
//    times the clip coefficient), a found_inf flag, the seed of stochastic rounding and the
//    gradient statistics. Kernels read them from memory, never from launch arguments, so a step
//    can be captured in a CUDA graph once and replayed while lr, steps and loss scale change.
//  - DeviceUpdateTable: one bucket's tensors (any number of them), cut into chunks of a fixed
//    number of elements; uploaded once, so a step is one kernel launch per bucket (one per
//    distinct dtype combination in the bucket: usually one).
//
// One step, every call asynchronous on the caller's stream, no host synchronization:
//
//   scalars.BeginStep(s);              // multiplier = grad_unscale, found_inf = 0, stats zeroed
//   table.AccumulateGradStats(scalars, s);    // per table, only when clipping or checking:
//   ...                                       // sum of squares and non-finite count of grads
//   scalars.FinishGradStats(s);        // found_inf, global norm, clip coefficient -> multiplier
//   scalars.AdvanceSteps(s);           // ++step of every group, unless found_inf (as torch)
//   table.Update(scalars, s);          // per table; does nothing when found_inf is set
//
// Per-tensor steps (torch keeps one step per parameter): DeviceScalars made with slot_count > 0
// hold that many int64 slot steps; a table made with slots reads its tensors' slot steps instead
// of their groups' and its Update advances them itself (present tensors only, unless found_inf).
//
// Absent tensors: SetGradPointers with a null gradient for a tensor of numel > 0 marks it absent
// (its parameter got no gradient this step): Update and AccumulateGradStats skip it, its state and
// slot step stay, until a later SetGradPointers gives it a gradient again.
//
// The arithmetic is the CPU kernels' (src/kernels/cpu/update_math.h, torch.optim's order, no
// FMA contraction, per-step constants computed in double and rounded once to float), so for the
// same inputs the device and host tiers produce the same bits, stochastic rounding included
// (the same counter-based hash of seed, step and element index).
//
// Pointers in TensorUpdate are device pointers on the device current at Create(); they are
// recorded, not copied: the memory must stay allocated at those addresses for the table's life
// (gradients: until SetGradPointers replaces them).
// Element counts are int64 throughout: tensors and buckets may exceed 2^31 elements.
//
// Threads and streams: an object is not shared between host threads without locking. Launches
// that write the same DeviceScalars (BeginStep, AccumulateGradStats, FinishGradStats,
// AdvanceSteps, SetGroup, SetInputs, SetUnscaleFrom, SetSlotSteps) must be ordered (one stream,
// or events); Update() only reads the scalars (a slot table also writes its own slots' steps), so
// tables may update concurrently on different streams when no slot is in two of them. Destroy an
// object only when no work using it is in flight.
//
// Without a CUDA build, or without a usable device, Create() returns kUnsupported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "emsa/status.h"
#include "emsa/types.h"
#include "emsa/update.h"

// The runtime's stream handle, declared as cuda_runtime.h declares it, so that this header
// does not need the CUDA toolkit.
typedef struct CUstream_st* cudaStream_t;

namespace emsa {

// ---- what lives in device memory ---------------------------------------------------------------

// One param group. The layout is part of the API: graph users may write these fields directly
// (cudaMemcpyAsync from pinned memory, or from a framework's device tensor) instead of SetGroup.
struct DeviceGroupScalars {
  int64_t step = 0;  // the step number Update() uses; AdvanceSteps() adds 1 before each update,
                     // as torch does. Update() treats a step below 1 as 1.
  double lr = 1e-3;  // doubles, as HyperParams (emsa/update.h) says why
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  int32_t maximize = 0;  // nonzero: ascend
  int32_t reserved = 0;
};
static_assert(sizeof(DeviceGroupScalars) == 56, "DeviceGroupScalars is a device-memory layout");

// A group's hyperparameters and step number in the device layout.
inline DeviceGroupScalars ToDeviceScalars(const HyperParams& h, int64_t step) {
  DeviceGroupScalars g;
  g.step = step;
  g.lr = h.lr;
  g.beta1 = h.beta1;
  g.beta2 = h.beta2;
  g.eps = h.eps;
  g.weight_decay = h.weight_decay;
  g.maximize = h.maximize ? 1 : 0;
  return g;
}

// The per-step header. Inputs are set by the caller (SetInputs, or a direct copy); outputs are
// written by BeginStep / AccumulateGradStats / FinishGradStats and may be read back with Read().
struct DeviceStepHeader {
  // What Update() multiplies every gradient element by. BeginStep sets it to grad_unscale;
  // FinishGradStats multiplies in the clip coefficient.
  float grad_multiplier = 1.0f;
  // Nonzero (any bits: a float 1.0 copied in from torch's found_inf works): Update() writes
  // nothing and AdvanceSteps() leaves the steps (slot steps too). BeginStep clears it (sets it
  // when grad_unscale is not finite); FinishGradStats sets it when a gradient element is inf or
  // nan.
  int32_t found_inf = 0;
  float grad_unscale = 1.0f;    // input: 1 / loss_scale (1 without AMP; NaN: an unusable scale)
  float max_norm = 0.0f;        // input: clip the global norm to this; <= 0 or inf: no clipping
  uint64_t seed = 0;            // input: the stochastic-rounding stream
  double sum_sq = 0.0;          // output: sum of squares of the raw (still scaled) gradients
  int64_t nonfinite_count = 0;  // output: gradient elements that are inf or nan
  double grad_norm = 0.0;       // output: global L2 norm of the unscaled gradients
  float clip_coef = 1.0f;       // output: min(1, max_norm / (grad_norm + 1e-6)), as clip_grad_norm_
  int32_t reserved = 0;
};
static_assert(sizeof(DeviceStepHeader) == 56, "DeviceStepHeader is a device-memory layout");

// ---- DeviceScalars -----------------------------------------------------------------------------

class DeviceScalars {
 public:
  // One group per hyperparameter set, initialized from hypers[i] with step 0, slot_count slot
  // steps (0 each; for tables made with slots), and the header at its defaults. Validates every
  // group first (finite lr >= 0, betas in [0, 1), finite weight_decay >= 0, eps > 0).
  // Synchronous (bind time).
  static Result<std::unique_ptr<DeviceScalars>> Create(const HyperParams* hypers,
                                                       size_t group_count, size_t slot_count = 0);
  ~DeviceScalars();
  DeviceScalars(const DeviceScalars&) = delete;
  DeviceScalars& operator=(const DeviceScalars&) = delete;

  int device() const { return device_; }
  size_t group_count() const { return group_count_; }
  size_t slot_count() const { return slot_count_; }
  // Device pointers, for callers that write fields with their own copies or kernels.
  DeviceStepHeader* device_header() const { return header_; }
  DeviceGroupScalars* device_groups() const { return groups_; }
  int64_t* device_slot_steps() const { return slot_steps_; }  // null without slots

  // Asynchronous on `stream`; each is one tiny kernel whose values travel as launch arguments
  // (captured into a graph as constants). Values are validated first; a bad one changes nothing.
  Status SetGroup(size_t group, const HyperParams& hyper, int64_t step, cudaStream_t stream);
  // The hyperparameters of a group, leaving its step as the device counts it: what a framework
  // calls each step (a scheduler changes lr) without knowing whether earlier steps were skipped.
  Status SetGroupHyper(size_t group, const HyperParams& hyper, cudaStream_t stream);
  Status SetInputs(float grad_unscale, float max_norm, uint64_t seed, cudaStream_t stream);

  // Enqueues a copy of the header into `dst` (pinned host memory, or device memory) after the
  // stream's earlier work, and returns without waiting: a framework reads found_inf and
  // nonfinite_count once an event recorded after it has completed, so no step waits on the host.
  // Pageable host memory also works, but then the runtime may wait for the copy.
  Status CopyHeader(DeviceStepHeader* dst, cudaStream_t stream) const;

  // Asynchronous copies of the whole header / all groups from caller-owned pinned host memory
  // (cudaHostAlloc or cudaHostRegister), which must not change until the stream has passed the
  // copy. In a graph the copy reads the host memory at each replay: the way to feed per-step
  // values (lr from a scheduler, loss scale) to a captured step.
  Status UploadHeader(const DeviceStepHeader* pinned, cudaStream_t stream);
  Status UploadGroups(const DeviceGroupScalars* pinned, cudaStream_t stream);

  // The per-step sequence (see the top of this file). Each is one tiny kernel.
  Status BeginStep(cudaStream_t stream);
  Status FinishGradStats(cudaStream_t stream);
  Status AdvanceSteps(cudaStream_t stream);

  // Copies the header (and the groups, when `groups` is not null: group_count() of them) to the
  // host after the stream's earlier work. Synchronizes the stream: for reports and tests.
  Status Read(DeviceStepHeader* header, DeviceGroupScalars* groups, cudaStream_t stream) const;

  // The slot steps (count must be slot_count()) after the stream's earlier work; synchronizes.
  Status ReadSlotSteps(int64_t* steps, size_t count, cudaStream_t stream) const;
  // Sets every slot step (each >= 0), ordered on the stream; synchronizes the stream before
  // returning, so `steps` may be reused at once (a load_state_dict-time call).
  Status SetSlotSteps(const int64_t* steps, size_t count, cudaStream_t stream);

  // grad_unscale = (float)(1.0 / (double)*device_scale), read on the device when the stream gets
  // there (torch's GradScaler unscales by that value). A scale that is not finite or <= 0, or
  // whose reciprocal is not finite, writes NaN instead; BeginStep then sets found_inf, so the
  // step is skipped instead of multiplying gradients by garbage. One tiny kernel.
  Status SetUnscaleFrom(const float* device_scale, cudaStream_t stream);
  // Writes 1.0f when found_inf is set, else 0.0f, into a float in device memory (torch's
  // found_inf tensor), after the stream's earlier work. One tiny kernel.
  Status WriteFoundInf(float* device_dst, cudaStream_t stream) const;

 private:
  DeviceScalars() = default;
  int device_ = -1;
  size_t group_count_ = 0;
  size_t slot_count_ = 0;
  // One allocation: header, groups, then slot steps (CUDA only).
  [[maybe_unused]] void* memory_ = nullptr;
  DeviceStepHeader* header_ = nullptr;
  DeviceGroupScalars* groups_ = nullptr;
  int64_t* slot_steps_ = nullptr;
};

// ---- DeviceUpdateTable -------------------------------------------------------------------------

struct DeviceTableOptions {
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  // Rounding of bf16 state stores. Parameters stored in bf16/fp16 without a master copy always
  // round stochastically (round-to-nearest would drop small updates), as on the CPU.
  Rounding rounding = Rounding::kStochastic;
  // fp32 params, grads and states on sm_90 and later: tiles moved by Hopper bulk copies
  // (cp.async.bulk through shared memory) instead of per-thread 16-byte loads and stores. Same
  // bits, and faster where available. Elsewhere, and for other dtypes, the per-thread
  // kernel runs whatever this says (bulk_copy_launches() tells which).
  bool bulk_copy = true;
  // A table for gradient statistics only: each tensor needs grad, numel and grad_dtype (param,
  // state, master and the other dtypes are not read or checked). AccumulateGradStats, ReadStats
  // and SetGradPointers work; Update returns kInvalidArgument. For gradients updated elsewhere
  // (the host tier) that count in the same global norm.
  bool stats_only = false;
};

// Tier L0: an L2 access-policy window for a table's update launches (the cudaLaunchKernelEx
// attribute: lines in [base, base + bytes) persist in the L2 set-aside with probability
// hit_ratio, the rest stream). The set-aside itself is device-wide and reserved by the caller
// (src/memory/l2_window.h sizes and applies it). bytes 0: no window (the default).
struct DeviceAccessWindow {
  const void* base = nullptr;
  uint64_t bytes = 0;
  float hit_ratio = 0.0f;  // in [0, 1]
};

// Per-table gradient statistics of the last AccumulateGradStats, for reports.
struct DeviceTableStats {
  double sum_sq = 0.0;
  int64_t nonfinite_count = 0;
  int64_t first_nonfinite_tensor = -1;  // index in the table, or -1
};

class DeviceUpdateTable {
 public:
  // tensors[i]: device pointers, numel and dtypes (TensorUpdate's meaning). Supported: param
  // float32, bfloat16 or float16; grad float32 or the param's dtype; state float32 or bfloat16;
  // master (fp32) only with a 16-bit param. tensors[i].hyper and .step are not read: the values
  // come from DeviceScalars group groups[i] (groups == null: every tensor in group 0).
  // Validates everything before allocating (the error names the tensor); pointers must be device
  // (or managed) memory of the current device. Synchronous (bind time).
  //
  // slots (null: group steps): slots[i] is tensor i's slot step in the DeviceScalars (>= 0, no
  // two tensors of the table in one slot). Then each Update, unless found_inf, first advances
  // every present tensor's slot step by one (one small kernel on the update's stream), and the
  // update uses that step for the tensor (bias correction and rounding keys, per-step constants
  // computed in double and rounded once, as for group steps: a table whose tensors all share a
  // step gives the bits of a table without slots). Absent tensors keep their step.
  static Result<std::unique_ptr<DeviceUpdateTable>> Create(const TensorUpdate* tensors,
                                                           const int32_t* groups, size_t count,
                                                           const DeviceTableOptions& options,
                                                           const int64_t* slots = nullptr);
  ~DeviceUpdateTable();
  DeviceUpdateTable(const DeviceUpdateTable&) = delete;
  DeviceUpdateTable& operator=(const DeviceUpdateTable&) = delete;

  // One fused launch per dtype combination present; reads grad_multiplier, found_inf, seed and
  // the groups from `scalars` (a slot table: one more small launch first, advancing its slots).
  // Returns kCudaError if a launch fails; asynchronous otherwise. kInvalidArgument for a
  // stats_only table, or scalars with too few groups or slots.
  Status Update(const DeviceScalars& scalars, cudaStream_t stream);

  // Every later Update launches with this access-policy window (bytes 0: without one). Results
  // are bitwise the same either way; only where the lines live in L2 changes. kInvalidArgument
  // for a null base with bytes > 0 or a hit_ratio outside [0, 1].
  Status SetAccessWindow(const DeviceAccessWindow& window);

  // Adds this table's sum of squares and non-finite count into the scalars' header (one launch;
  // deterministic: the same inputs and device give the same bits). Absent tensors count nothing.
  Status AccumulateGradStats(DeviceScalars& scalars, cudaStream_t stream);
  // The last AccumulateGradStats's figures for this table. Synchronizes the stream.
  Status ReadStats(DeviceTableStats* stats, cudaStream_t stream) const;

  // Points the table at new gradients: grads[i] replaces tensors[i].grad of Create (same dtype
  // and numel), for frameworks that allocate gradients anew each backward (torch's
  // zero_grad(set_to_none=True)). count must be tensor_count(). A null grads[i] for a tensor of
  // numel > 0 marks it absent (no gradient this step: see the top of this file) until a later
  // call gives it one; a tensor of numel 0 is never absent.
  //
  // Asynchronous on `stream` and allocation-free: the pointers are written into a pinned host
  // slot made at Create, copied to the device and scattered into the table by one small kernel,
  // which also re-derives each tensor's vector-path flag from the new alignment (a gradient off
  // a 16-byte boundary takes the scalar path: same bits, slower). The slots form a ring of
  // kGradStagingSlots, each reused only after an event says its copy is done: the host waits
  // only when that many calls are still queued on the device. Pointers equal to the current ones
  // enqueue nothing. A call must be ordered with this table's Update and AccumulateGradStats
  // (same stream, or events), as the launches writing DeviceScalars are.
  //
  // Checked here: count, alignment to the grad's element size. Not checked: that
  // each pointer is device memory of the table's device holding numel elements (a driver query
  // per pointer per step would cost more than a small model's update): pass what Create would
  // accept. Not capturable into a CUDA graph (it may wait on an event); a graph that needs new
  // gradients each replay should copy them into fixed buffers instead.
  static constexpr int kGradStagingSlots = 4;
  Status SetGradPointers(const void* const* grads, size_t count, cudaStream_t stream);

  int device() const { return device_; }
  OptimizerKind optimizer() const { return options_.optimizer; }
  size_t tensor_count() const { return tensor_count_; }
  int64_t total_numel() const { return total_numel_; }
  int64_t chunk_count() const { return chunk_count_; }
  int launches_per_update() const { return static_cast<int>(launch_count_); }
  // Of those, the launches of the bulk-copy kernel (DeviceTableOptions::bulk_copy).
  int bulk_copy_launches() const { return bulk_launch_count_; }
  // Bytes the update reads plus writes per step (each stream once): the floor of its time.
  uint64_t bytes_per_update() const { return bytes_per_update_; }
  // The smallest DeviceScalars::group_count() this table can be used with.
  size_t groups_needed() const { return groups_needed_; }
  // The smallest DeviceScalars::slot_count() it can be used with (0: a table without slots).
  size_t slots_needed() const { return slots_needed_; }
  bool has_slots() const { return has_slots_; }
  bool stats_only() const { return options_.stats_only; }

 private:
  struct Impl;  // launch records and device arrays (src/kernels/cuda/device_update.cc)
  DeviceUpdateTable() = default;
  int device_ = -1;
  DeviceTableOptions options_;
  DeviceAccessWindow window_;
  size_t tensor_count_ = 0;
  int64_t total_numel_ = 0;
  int64_t chunk_count_ = 0;
  size_t launch_count_ = 0;
  int bulk_launch_count_ = 0;
  uint64_t bytes_per_update_ = 0;
  size_t groups_needed_ = 0;
  size_t slots_needed_ = 0;
  bool has_slots_ = false;
  std::unique_ptr<Impl> impl_;
};

}  // namespace emsa
