// step_scalars.cu — the one-thread kernels that keep DeviceScalars' per-step numbers on the
// device, so that no step waits on the host (and a captured graph replays them).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/cuda_util.h"
#include "kernels/cuda/device_table.h"
#include "kernels/step_verdict.h"

namespace emsa {
namespace cuda {
namespace {

constexpr int kAdvanceThreads = 128;

__global__ void SetGroupKernel(DeviceGroupScalars* groups, int64_t index,
                               DeviceGroupScalars value) {
  groups[index] = value;
}

// The hyperparameters only: the step is the device's own count (AdvanceSteps), which the host
// does not know without a synchronization.
__global__ void SetGroupHyperKernel(DeviceGroupScalars* groups, int64_t index,
                                    DeviceGroupScalars value) {
  value.step = groups[index].step;
  groups[index] = value;
}

__global__ void SetInputsKernel(DeviceStepHeader* h, float grad_unscale, float max_norm,
                                uint64_t seed) {
  h->grad_unscale = grad_unscale;
  h->max_norm = max_norm;
  h->seed = seed;
}

// A grad_unscale that is not finite (SetUnscaleFrom's mark of an unusable loss scale) skips the
// step from the start: nothing may be multiplied by it.
__global__ void BeginStepKernel(DeviceStepHeader* h) {
  h->grad_multiplier = h->grad_unscale;
  h->found_inf = isfinite(h->grad_unscale) ? 0 : 1;
  h->sum_sq = 0.0;
  h->nonfinite_count = 0;
  h->grad_norm = 0.0;
  h->clip_coef = 1.0f;
}

// The gated step's verdict from its gradient statistics: kernels/step_verdict.h, the rule the
// CPU updater applies too. A skipped step sets found_inf; the update kernels then write
// nothing.
__global__ void FinishGradStatsKernel(DeviceStepHeader* h) {
  const verdict::Decision d =
      verdict::Decide(h->sum_sq, h->nonfinite_count, h->grad_unscale, h->max_norm);
  if (d.skip) h->found_inf = 1;
  h->grad_norm = d.grad_norm;
  h->clip_coef = d.clip_coef;
  h->grad_multiplier = d.grad_multiplier;
}

// torch adds 1 to every step before the update and, under a GradScaler that found an inf,
// subtracts it again: the step only counts updates that happened.
__global__ void AdvanceStepsKernel(const DeviceStepHeader* h, DeviceGroupScalars* groups,
                                   int64_t count) {
  if (h->found_inf != 0) return;
  for (int64_t i = blockIdx.x * int64_t{kAdvanceThreads} + threadIdx.x; i < count;
       i += int64_t{kAdvanceThreads} * gridDim.x) {
    groups[i].step += 1;
  }
}

// Tables with slots: each present tensor's own step, advanced before its update (one thread per
// tensor; a table holds each slot at most once, so no two threads write one slot).
__global__ void AdvanceSlotsKernel(const DeviceStepHeader* h, const DeviceTensor* tensors,
                                   int64_t count, int64_t* slot_steps) {
  if (h->found_inf != 0) return;
  for (int64_t i = blockIdx.x * int64_t{kAdvanceThreads} + threadIdx.x; i < count;
       i += int64_t{kAdvanceThreads} * gridDim.x) {
    const DeviceTensor& t = tensors[i];
    if ((t.flags & kTensorAbsent) == 0) slot_steps[t.step_index] += 1;
  }
}

// torch's GradScaler unscales by scale.double().reciprocal().float() (verdict::UnscaleOf); a
// scale it would never hold becomes NaN, which BeginStep turns into a skipped step.
__global__ void SetUnscaleFromKernel(DeviceStepHeader* h, const float* scale) {
  h->grad_unscale = verdict::UnscaleOf(*scale);
}

__global__ void WriteFoundInfKernel(const DeviceStepHeader* h, float* dst) {
  *dst = h->found_inf != 0 ? 1.0f : 0.0f;
}

// A <<<>>> launch reports its errors through cudaGetLastError, which also clears them.
Status Checked(const char* what) { return CudaStatus(cudaGetLastError(), what); }

}  // namespace

Status LaunchSetGroup(DeviceGroupScalars* groups, int64_t index, const DeviceGroupScalars& value,
                      cudaStream_t stream) {
  SetGroupKernel<<<1, 1, 0, stream>>>(groups, index, value);
  return Checked("SetGroup kernel launch");
}

Status LaunchSetGroupHyper(DeviceGroupScalars* groups, int64_t index,
                           const DeviceGroupScalars& value, cudaStream_t stream) {
  SetGroupHyperKernel<<<1, 1, 0, stream>>>(groups, index, value);
  return Checked("SetGroupHyper kernel launch");
}

Status LaunchSetInputs(DeviceStepHeader* header, float grad_unscale, float max_norm, uint64_t seed,
                       cudaStream_t stream) {
  SetInputsKernel<<<1, 1, 0, stream>>>(header, grad_unscale, max_norm, seed);
  return Checked("SetInputs kernel launch");
}

Status LaunchBeginStep(DeviceStepHeader* header, cudaStream_t stream) {
  BeginStepKernel<<<1, 1, 0, stream>>>(header);
  return Checked("BeginStep kernel launch");
}

Status LaunchFinishGradStats(DeviceStepHeader* header, cudaStream_t stream) {
  FinishGradStatsKernel<<<1, 1, 0, stream>>>(header);
  return Checked("FinishGradStats kernel launch");
}

Status LaunchAdvanceSteps(const DeviceStepHeader* header, DeviceGroupScalars* groups,
                          int64_t group_count, cudaStream_t stream) {
  if (group_count <= 0) return Status::Ok();
  const int64_t blocks64 = (group_count + kAdvanceThreads - 1) / kAdvanceThreads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < 1024 ? blocks64 : 1024);
  AdvanceStepsKernel<<<blocks, kAdvanceThreads, 0, stream>>>(header, groups, group_count);
  return Checked("AdvanceSteps kernel launch");
}

Status LaunchAdvanceSlots(const DeviceStepHeader* header, const DeviceTensor* tensors,
                          int64_t count, int64_t* slot_steps, cudaStream_t stream) {
  if (count <= 0) return Status::Ok();
  const int64_t blocks64 = (count + kAdvanceThreads - 1) / kAdvanceThreads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < 1024 ? blocks64 : 1024);
  AdvanceSlotsKernel<<<blocks, kAdvanceThreads, 0, stream>>>(header, tensors, count, slot_steps);
  return Checked("AdvanceSlots kernel launch");
}

Status LaunchSetUnscaleFrom(DeviceStepHeader* header, const float* scale, cudaStream_t stream) {
  SetUnscaleFromKernel<<<1, 1, 0, stream>>>(header, scale);
  return Checked("SetUnscaleFrom kernel launch");
}

Status LaunchWriteFoundInf(const DeviceStepHeader* header, float* dst, cudaStream_t stream) {
  WriteFoundInfKernel<<<1, 1, 0, stream>>>(header, dst);
  return Checked("WriteFoundInf kernel launch");
}

}  // namespace cuda
}  // namespace emsa
