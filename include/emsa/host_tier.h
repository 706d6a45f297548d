// emsa/host_tier.h — the host tier's step for CUDA parameters: gradients down, CPU update,
// parameters up, each stage overlapped with the others and with the GPU's own work.
//
// The state of a host-tier parameter lives in the host arena (moments, an fp32 master and a
// staging buffer for its gradient, over which a bf16/fp16 parameter's update may write the
// rounded parameter for the upload). What a copy reads or writes must be pinned (the staging
// buffers, the parameter the upload reads, a device-updated bucket's moments); what only the CPU
// touches may be pageable, resident before the tier's first step. Per step and per bucket (the
// plan's unit, in gradient-ready order):
//
//   Submit(b, grads, compute)   an event on the compute stream; the D2H stream waits on it and
//                               copies the bucket's gradients into their staging buffers, then
//                               records that they have landed; b joins the worker's queue.
//                               (When buckets are submitted from backward and pacing is on,
//                               the worker enqueues those copies itself, a few pieces ahead of
//                               the CPU.)
//   worker thread               takes, of the submitted buckets whose gradients have landed
//                               (their first piece), the one with the highest index (buckets
//                               are numbered in gradient-ready order, so that is what the next
//                               forward needs first), waits for the previous step's upload of
//                               it (no DMA may still read what it is about to write), runs its
//                               CPU update on the CpuUpdater's pool, enqueues the upload of its
//                               parameters (or their deltas) on the H2D stream and records
//                               params_copied[b].
//   Wait(b, stream)             the next forward's module pre-hook: waits on the host until b's
//                               upload is enqueued (usually already), then makes `stream` wait
//                               on params_copied[b]; the compute stream never waits for the
//                               whole step, only for what it is about to read.
//
// Nothing is allocated after Create() (queue, events, per-bucket update tables are made there);
// copies are pinned-to-device only; the compute stream is never synchronized with the host.
// The worker is the only caller of the CpuUpdater while the tier exists (it is not thread-safe).
//
// Failures in the worker (a CUDA error) are kept and returned by the next call that would
// depend on them (Wait, BeginStep, Synchronize); the buckets after it are not updated.
//
// Gated steps (BeginStepGated(..., gated = true), or every BeginStep under options.gated): the
// updates need a verdict known only once every gradient of the step exists (the clip
// coefficient, the non-finite check, a loss scale). Submit then enqueues each bucket's gradient
// copies whole (no pacing: the CPU cannot consume them before the verdict, and the device
// gradients are freed sooner), the worker updates nothing until Release (or ReleaseValues) has
// given the verdict, and then proceeds in its usual order. The verdict: found_inf != 0 skips
// every bucket of the step (no update, no upload, moments, masters, parameters and step counts
// untouched; Wait(b) then has nothing to wait for); else every update multiplies the gradients
// by grad_multiplier. Device-updated buckets of a gated step are enqueued only after the
// release (their kernels wait for it on the GPU and read the verdict from device memory), so
// their Submit returns at once and their gradients must stay alive until
// BucketCopiesEnqueued(b) says so. Ungated steps run exactly as before (multiplier 1).
//
// Step counts are per tensor and kept by the tier (tensor order of creation, all 0 at Create):
// a tensor's update in a step uses its count + 1 (bias correction, per parameter as torch
// keeps it), and its count advances by one when the step ends (settled by the next BeginStep or
// by Synchronize) if the tensor was present (its gradient pointer non-null at Submit, or numel
// 0) and the step was not skipped. Absent tensors (a null gradient, numel > 0) are not copied,
// updated or uploaded, and their counts stay.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "emsa/host_tier_costs.h"
#include "emsa/status.h"
#include "emsa/types.h"
#include "emsa/update.h"

typedef struct CUstream_st* cudaStream_t;

namespace emsa {

class CopyEngine;
class CpuUpdater;
struct DeviceStepHeader;  // emsa/cuda_update.h

struct HostTierTensor {
  // Host pointers for the CPU update: param is what the update writes in place (the fp32 master
  // for fp32 parameters, with master null; a bf16/fp16 staging buffer otherwise, with master
  // the fp32 master, and that buffer may be grad itself: the update reads each gradient element
  // before it writes the rounded parameter there, and the tier orders the next step's gradient
  // copy after the upload that reads it); grad is the staging buffer the D2H copy fills. step
  // and hyper are set per step by BeginStep.
  TensorUpdate update;
  int32_t group = 0;             // param group: whose hyperparameters and step count apply
  int64_t bucket = 0;            // 0 <= bucket < bucket_count; tensors of a bucket update together
  void* device_param = nullptr;  // where the updated parameter goes (device memory)
  // The GPU updates this tensor instead of the CPU (the same for every tensor of its bucket; an
  // fp32 parameter without a master and an fp32 gradient, fp32 or bf16 moments): at Submit its
  // moments are copied from the host arena into device staging, a kernel updates the parameter
  // and the moments where they are (the CPU's bits), and the moments go back to the host arena.
  // The state stays in the host arena; per parameter the host's memory carries only the DMA's
  // moments both ways (16 bytes with fp32 moments against the CPU path's 24 + 8), PCIe the
  // moments each way (8 + 8 against 4 + 4). See HostTierOptions::stream_*.
  bool device_update = false;
};

struct HostTierOptions {
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  Rounding rounding = Rounding::kStochastic;
  uint64_t seed = 0;
  int device = 0;         // CUDA device of the parameters and streams
  size_t history = 4096;  // steps whose measurements are kept (ring)
  // How the caller submits buckets, a fact about the caller, not a tuning choice. false: after
  // backward, all at once (an optimizer's step()). true: from backward, each as its gradients
  // become final (gradient hooks). Only then are the copies paced (paced_copies): after
  // backward a step would wait for every copy, and there is no backward left to overlap them
  // with.
  bool submit_in_backward = false;
  // true: for fp32 parameters with fp32 gradients under AdamW or Lion (HostTierAppliesDelta; the
  // rest as with false), the CPU writes only the update's change, over the gradient in its
  // staging buffer (TensorUpdate::delta); that is uploaded into a device staging buffer of
  // delta_staging_elements floats and a kernel on the H2D stream sets p = p * (1 - lr*wd) + delta
  // on the device: the same bits. The host's copy of those parameters is then neither read nor
  // written (it goes stale), so the CPU moves 24 bytes of host memory per parameter instead of
  // 28, the DMA the same 8; the update is bound by host memory. false: the CPU updates the
  // host's copy of every parameter, which is then uploaded.
  bool device_delta = kHostTierDeviceDelta;
  int64_t delta_staging_elements = int64_t{4} << 20;
  // With submit_in_backward, N >= 1: the worker enqueues the gradient copies itself,
  // pace_piece_elements at a time, keeping N pieces copied ahead of the piece it is updating
  // (into the next bucket it will take when the current one runs out), so each piece lands just
  // before the CPU reads it: where the host's PCIe writes allocate in its last-level cache (Intel
  // DDIO) the CPU then reads gradients from there, not from DRAM, and the host memory the update
  // is bound by carries less traffic. Copies enqueued at Submit instead run at PCIe speed, well
  // ahead of the CPU, so the CPU reads them back from DRAM. The worker reads Submit's device
  // pointers when it copies: the caller must keep those gradients alive (and unwritten) until
  // BucketCopiesEnqueued(b) says so; WaitGradsCopied then blocks the host until the copies are
  // enqueued. 0, or without submit_in_backward: Submit enqueues each bucket's copies whole.
  // Results are identical either way. bench/host_dma_bench.cu measures what pacing gains on a
  // host.
  int paced_copies = 2;
  int64_t pace_piece_elements = int64_t{4} << 20;  // >= 64; cut as CpuUpdater::Aligned allows
  // Under pacing, the device memory it may hold: gradients submitted whose copies are not yet
  // enqueued, at most this many bytes (-1: no limit). A Submit that would pass it enqueues that
  // bucket's copies at once, as without pacing. The planner's peak counts about two buckets of
  // gradients in flight; the caller passes what its budget has beyond that.
  int64_t paced_hold_bytes = -1;
  // Device-updated tensors (HostTierTensor::device_update): their moments go through stream_slots
  // device staging slots of stream_piece_elements elements per moment (allocated at Create when
  // any tensor is device-updated), a tensor stream_piece_elements at a time. With more than one
  // slot, one run's moments come up while another's go down. Without pacing, Submit enqueues a
  // bucket's copies and kernels (update_stream() runs the kernels, which read Submit's
  // gradients: keep them alive in that stream's order). Under pacing, a streamer thread enqueues
  // them run by run as slots free up, choosing as the worker does (in backward the buckets as
  // their gradients become final, after it what the next forward needs first); the caller then
  // keeps each bucket's gradients until BucketCopiesEnqueued, as for paced copies.
  int64_t stream_piece_elements = kHostTierStreamPieceElements;
  int stream_slots = kHostTierStreamSlots;
  // The stream the device-updated buckets' kernels run on (they read Submit's gradients): the
  // caller's, which must outlive the tier, or null for one the tier makes and destroys with
  // itself. A framework that keeps gradients alive by recording their use on a stream (torch's
  // record_stream) must pass its own: memory recorded on a destroyed stream is never freed
  // cleanly.
  cudaStream_t device_update_stream = nullptr;
  // true: every step BeginStep(hypers, steps, ...) starts is gated (waits for Release; see the
  // top of this file). BeginStepGated chooses per step instead, whatever this says.
  bool gated = false;

  // Whether the worker paces the gradient copies: submitted from backward, with pieces ahead.
  bool paced() const { return submit_in_backward && paced_copies > 0; }
};

// What one step took on each engine, measured (CUDA events for copies, a steady clock for the
// CPU and for waits). Busy times are sums over buckets, not spans.
struct HostTierStepStats {
  int64_t step = 0;       // BeginStep count, 1-based
  double d2h_s = 0.0;     // gradient copies
  double cpu_s = 0.0;     // CPU updates
  double h2d_s = 0.0;     // parameter copies
  double wait_s = 0.0;    // host time Wait() blocked because an upload was not yet enqueued
  int64_t buckets = 0;    // buckets submitted
  bool complete = false;  // every submitted bucket's copies have finished and been timed
  // The worker's own time: blocked until gradients were final or had landed (grad_wait_s), and
  // in all from taking each bucket to having enqueued its upload (worker_s: cpu_s, grad_wait_s
  // and the rest, which is enqueueing copies and reading events).
  double grad_wait_s = 0.0;
  double worker_s = 0.0;
  // Device-updated buckets submitted, and their moments' copies up, summed (CUDA events): the
  // link time the GPU path took. Under pacing each run is timed when the streamer next
  // takes its staging slot (the step's last ones in the next step, or at Synchronize); Submit's
  // own enqueues time only runs whose copies are done when their slot comes round again.
  int64_t device_buckets = 0;
  double stream_up_s = 0.0;
  bool gated = false;    // the step waited for a release
  bool skipped = false;  // its release said found_inf: nothing was updated
};

class HostTier {
 public:
  // Validates the tensors (CpuUpdater::Validate with step 1 and default hyperparameters),
  // creates the events and starts the worker. The streams belong to the caller and must outlive
  // the tier. Errors: kInvalidArgument naming the tensor; kUnsupported without CUDA.
  static Result<std::unique_ptr<HostTier>> Create(CpuUpdater* updater,
                                                  const HostTierTensor* tensors, size_t count,
                                                  size_t bucket_count, size_t group_count,
                                                  cudaStream_t d2h_stream, cudaStream_t h2d_stream,
                                                  const HostTierOptions& options);
  // Create with another copy engine than CUDA's (engine/copy_engine.h, private to the engine):
  // tests run the tier on the CPU with a fake one. The engine must outlive the tier; without
  // CUDA's, no tensor may be device-updated (kUnsupported).
  static Result<std::unique_ptr<HostTier>> CreateWithEngine(
      CopyEngine* engine, CpuUpdater* updater, const HostTierTensor* tensors, size_t count,
      size_t bucket_count, size_t group_count, cudaStream_t d2h_stream, cudaStream_t h2d_stream,
      const HostTierOptions& options);
  // Waits for the worker's queue, then stops it; a gated step never released is released as
  // skipped first (so destruction never hangs, and changes nothing of that step).
  ~HostTier();
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // Starts a step: waits until the worker has finished the previous one (whose step counts it
  // then settles), then takes each group's hyperparameters (group_count of them). gated: the
  // step's updates wait for Release / ReleaseValues. The tensors' updates use their own counts
  // + 1. Errors (nothing changed): kInvalidArgument when the previous step was gated and never
  // released, or for a wrong group count; the worker's failure.
  Status BeginStepGated(const HyperParams* hypers, size_t group_count, bool gated);
  // The group-step form, as before per-tensor counts: sets the count of every tensor of group g
  // to steps[g] - 1 (steps[g] >= 1), so that its update in this step uses steps[g], then
  // BeginStepGated(hypers, group_count, options.gated). The same bits as ever for callers that
  // count steps per group; ReadSteps then gives steps[g] for the tensors present in the step.
  Status BeginStep(const HyperParams* hypers, const int64_t* steps, size_t group_count);
  // The verdict of the current gated step, from device memory: on `stream`, after the caller's
  // work there (the statistics that finish the header), copies *device_header (a
  // DeviceScalars::device_header()) into the tier's pinned memory (and, with device-updated
  // buckets, into the tier's own device copy their kernels read) and records an event; the
  // worker waits for it and reads found_inf and grad_multiplier. Device-updated buckets already
  // submitted are enqueued now (or by the streamer under pacing). Buckets may still be submitted
  // after it (they use the same verdict). Asynchronous: returns without waiting for the GPU.
  // kInvalidArgument (nothing changed) when the step is not gated or was released already, or
  // device_header is null.
  Status Release(const DeviceStepHeader* device_header, cudaStream_t stream);
  // The same verdict given as values (no device scalars; the fake engine's tests, a framework
  // whose verdict is on the host). grad_multiplier must be finite.
  Status ReleaseValues(float grad_multiplier, bool found_inf);
  // Per-tensor step counts (count = tensor_count(), creation order). ReadSteps: the counts as
  // settled (call after Synchronize for the last step's). SetSteps (load_state_dict): each >= 0,
  // between steps (after Synchronize, or after BeginStep before any Submit); kInvalidArgument
  // otherwise, nothing changed.
  Status ReadSteps(int64_t* out, size_t count) const;
  Status SetSteps(const int64_t* steps, size_t count);
  // Whether the last step whose verdict is known was skipped (found_inf); false before any.
  bool last_skipped() const;
  // Bucket b's gradients are final on `compute` (device pointers, one per tensor of b in
  // creation order, dtype as given at Create; null for a tensor with numel > 0: absent this
  // step). Once per bucket per step; a bucket whose tensors are all absent need not be
  // submitted.
  Status Submit(size_t bucket, const void* const* grads, size_t count, cudaStream_t compute);
  // Makes `stream` wait for bucket b's new parameters (nothing when b was not submitted since
  // its last upload began, or its step was skipped: the stream then sees the values it would
  // see anyway). kInvalidArgument for a bucket of a gated step not yet released (it would
  // never return).
  Status Wait(size_t bucket, cudaStream_t stream);
  // Makes `stream` wait until every gradient submitted this step has been copied down (before
  // anything on it may overwrite those gradients in place). kInvalidArgument in a gated step
  // not yet released that has device-updated buckets submitted (their kernels read the
  // gradients after the release).
  Status WaitGradsCopied(cudaStream_t stream);
  // Waits on the host until every submitted bucket is updated and uploaded, and settles the
  // step's counts. kInvalidArgument (without waiting) in a gated step not yet released.
  Status Synchronize();
  // Under pacing (HostTierOptions::paced()): whether every gradient copy of bucket b's last
  // Submit is enqueued (its device gradients may then be freed in the D2H stream's order), and
  // how many buckets' copies have been enqueued in all since Create (a caller polls this,
  // cheaply, for a change). Without pacing Submit enqueues them itself: true once Submit has
  // returned.
  bool BucketCopiesEnqueued(size_t bucket) const;
  int64_t copies_enqueued() const;
  // Measurements of steps [first, BeginStep count], oldest first, at most `capacity`; steps
  // older than the history are gone. Call Synchronize() first for the last step to be complete.
  size_t Stats(int64_t first, HostTierStepStats* out, size_t capacity) const;

  // The current step's host timeline per bucket, seconds since its BeginStep (-1: not yet):
  // submitted, CPU update started, CPU update ended. For reports and for finding stalls.
  size_t Trace(double* submit, double* start, double* end, size_t count) const;

  size_t bucket_count() const;
  size_t tensor_count() const;
  size_t bucket_size(size_t bucket) const;
  // The stream the device-updated buckets' kernels run on (null when there are none).
  cudaStream_t update_stream() const;
  // Device memory the tier holds for device-updated tensors (their staging) under `options`,
  // moments of `state_dtype`, the largest device-updated tensor `largest` elements (a slot holds
  // no more than one tensor's run: min(stream_piece_elements, largest) per moment).
  static int64_t StreamStagingBytes(const HostTierOptions& options, DType state_dtype,
                                    int64_t largest);

 private:
  struct Impl;
  explicit HostTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace emsa
