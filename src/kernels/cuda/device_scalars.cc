// device_scalars.cc — DeviceScalars: the header, the groups and the slot steps in device memory,
// and the tiny launches that keep them (host side; the kernels are in step_scalars.cu).
// Validation runs first (device_validate.h); a build without CUDA has device_update_nocuda.cc.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_util.h"
#include "emsa/cuda_update.h"
#include "kernels/cuda/device_table.h"
#include "kernels/cuda/device_validate.h"

#if EMSA_HAVE_CUDA

#include "kernels/cuda/device_host.h"

namespace emsa {
namespace {

using device_checks::CheckGroupIndex;
using device_checks::CheckSlotCount;
using device_checks::CheckSlotSteps;
using device_checks::Num;
using device_checks::ValidateGroupHyper;
using device_checks::ValidateGroups;
using device_checks::ValidateSlotCount;
using device_host::Allocate;
using device_host::CheckPinned;
using device_host::CurrentDevice;
using device_host::DeviceMemory;
using device_host::FinishUploads;
using device_host::NoDevice;
using device_host::RoundUp;
using device_host::Upload;

}  // namespace

// ---- DeviceScalars -----------------------------------------------------------------------------

Result<std::unique_ptr<DeviceScalars>> DeviceScalars::Create(const HyperParams* hypers,
                                                             size_t group_count,
                                                             size_t slot_count) {
  EMSA_RETURN_IF_ERROR(ValidateGroups(hypers, group_count));
  EMSA_RETURN_IF_ERROR(ValidateSlotCount(slot_count));
  std::vector<DeviceGroupScalars> groups(group_count);
  for (size_t i = 0; i < group_count; ++i) groups[i] = ToDeviceScalars(hypers[i], 0);
  if (!CudaDeviceUsable()) return NoDevice("DeviceScalars::Create");

  std::unique_ptr<DeviceScalars> s(new DeviceScalars());
  EMSA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&s->device_));
  // The groups start 64 bytes in: each record in one 32-byte sector; the slot steps (zeros)
  // after them.
  const size_t groups_at = RoundUp(sizeof(DeviceStepHeader), 64);
  const size_t slots_at = RoundUp(groups_at + group_count * sizeof(DeviceGroupScalars), 64);
  const size_t bytes = slots_at + slot_count * sizeof(int64_t);
  DeviceMemory mem;
  EMSA_RETURN_IF_ERROR(Allocate(&mem, bytes, "DeviceScalars::Create"));
  std::vector<unsigned char> host(bytes);
  const DeviceStepHeader header;
  std::memcpy(host.data(), &header, sizeof header);
  std::memcpy(host.data() + groups_at, groups.data(), group_count * sizeof(DeviceGroupScalars));
  EMSA_RETURN_IF_ERROR(Upload(mem.ptr, host.data(), bytes, "DeviceScalars::Create: upload"));
  EMSA_RETURN_IF_ERROR(FinishUploads("DeviceScalars::Create: upload"));

  s->group_count_ = group_count;
  s->slot_count_ = slot_count;
  s->memory_ = mem.release();
  s->header_ = static_cast<DeviceStepHeader*>(s->memory_);
  s->groups_ = reinterpret_cast<DeviceGroupScalars*>(static_cast<char*>(s->memory_) + groups_at);
  if (slot_count > 0) {
    s->slot_steps_ = reinterpret_cast<int64_t*>(static_cast<char*>(s->memory_) + slots_at);
  }
  return s;
}

DeviceScalars::~DeviceScalars() {
  if (memory_ != nullptr) (void)cudaFree(memory_);
}

Status DeviceScalars::SetGroup(size_t group, const HyperParams& hyper, int64_t step,
                               cudaStream_t stream) {
  EMSA_RETURN_IF_ERROR(CheckGroupIndex(group, group_count_));
  EMSA_RETURN_IF_ERROR(ValidateGroupHyper(hyper, "hyper."));
  if (step < 0) {
    return Status::InvalidArgument("step is " + std::to_string(step) +
                                   "; it must be >= 0 (AdvanceSteps adds 1 before each update)");
  }
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::SetGroup"));
  return cuda::LaunchSetGroup(groups_, static_cast<int64_t>(group), ToDeviceScalars(hyper, step),
                              stream);
}

Status DeviceScalars::SetGroupHyper(size_t group, const HyperParams& hyper, cudaStream_t stream) {
  EMSA_RETURN_IF_ERROR(CheckGroupIndex(group, group_count_));
  EMSA_RETURN_IF_ERROR(ValidateGroupHyper(hyper, "hyper."));
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::SetGroupHyper"));
  return cuda::LaunchSetGroupHyper(groups_, static_cast<int64_t>(group), ToDeviceScalars(hyper, 0),
                                   stream);
}

Status DeviceScalars::CopyHeader(DeviceStepHeader* dst, cudaStream_t stream) const {
  if (dst == nullptr) return Status::InvalidArgument("DeviceScalars::CopyHeader: dst is null");
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::CopyHeader"));
  EMSA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, header_, sizeof(DeviceStepHeader), cudaMemcpyDefault, stream));
  return Status::Ok();
}

Status DeviceScalars::SetInputs(float grad_unscale, float max_norm, uint64_t seed,
                                cudaStream_t stream) {
  if (!std::isfinite(grad_unscale)) {
    return Status::InvalidArgument("grad_unscale is " + Num(grad_unscale) +
                                   "; it must be finite (1 / loss_scale)");
  }
  if (std::isnan(max_norm)) {
    return Status::InvalidArgument("max_norm is nan; use a positive number, or 0 for no clipping");
  }
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::SetInputs"));
  return cuda::LaunchSetInputs(header_, grad_unscale, max_norm, seed, stream);
}

Status DeviceScalars::UploadHeader(const DeviceStepHeader* pinned, cudaStream_t stream) {
  EMSA_RETURN_IF_ERROR(CheckPinned(pinned, "DeviceScalars::UploadHeader"));
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::UploadHeader"));
  EMSA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(header_, pinned, sizeof(DeviceStepHeader), cudaMemcpyHostToDevice, stream));
  return Status::Ok();
}

Status DeviceScalars::UploadGroups(const DeviceGroupScalars* pinned, cudaStream_t stream) {
  EMSA_RETURN_IF_ERROR(CheckPinned(pinned, "DeviceScalars::UploadGroups"));
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::UploadGroups"));
  EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      groups_, pinned, group_count_ * sizeof(DeviceGroupScalars), cudaMemcpyHostToDevice, stream));
  return Status::Ok();
}

Status DeviceScalars::BeginStep(cudaStream_t stream) {
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::BeginStep"));
  return cuda::LaunchBeginStep(header_, stream);
}

Status DeviceScalars::FinishGradStats(cudaStream_t stream) {
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::FinishGradStats"));
  return cuda::LaunchFinishGradStats(header_, stream);
}

Status DeviceScalars::AdvanceSteps(cudaStream_t stream) {
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::AdvanceSteps"));
  return cuda::LaunchAdvanceSteps(header_, groups_, static_cast<int64_t>(group_count_), stream);
}

Status DeviceScalars::Read(DeviceStepHeader* header, DeviceGroupScalars* groups,
                           cudaStream_t stream) const {
  if (header == nullptr) return Status::InvalidArgument("DeviceScalars::Read: header is null");
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::Read"));
  EMSA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(header, header_, sizeof(DeviceStepHeader), cudaMemcpyDeviceToHost, stream));
  if (groups != nullptr) {
    EMSA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(groups, groups_,
                                              group_count_ * sizeof(DeviceGroupScalars),
                                              cudaMemcpyDeviceToHost, stream));
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return Status::Ok();
}

Status DeviceScalars::ReadSlotSteps(int64_t* steps, size_t count, cudaStream_t stream) const {
  EMSA_RETURN_IF_ERROR(CheckSlotCount(count, slot_count_, "ReadSlotSteps"));
  if (count == 0) return Status::Ok();
  if (steps == nullptr) return Status::InvalidArgument("ReadSlotSteps: steps is null");
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::ReadSlotSteps"));
  EMSA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(steps, slot_steps_, count * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return Status::Ok();
}

Status DeviceScalars::SetSlotSteps(const int64_t* steps, size_t count, cudaStream_t stream) {
  EMSA_RETURN_IF_ERROR(CheckSlotSteps(steps, count, slot_count_));
  if (count == 0) return Status::Ok();
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::SetSlotSteps"));
  // Ordered after the stream's earlier work; the wait makes `steps` free to reuse at return
  // (a copy from pageable memory may otherwise still read it).
  EMSA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(slot_steps_, steps, count * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return Status::Ok();
}

Status DeviceScalars::SetUnscaleFrom(const float* device_scale, cudaStream_t stream) {
  if (device_scale == nullptr) {
    return Status::InvalidArgument("SetUnscaleFrom: device_scale is null");
  }
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::SetUnscaleFrom"));
  return cuda::LaunchSetUnscaleFrom(header_, device_scale, stream);
}

Status DeviceScalars::WriteFoundInf(float* device_dst, cudaStream_t stream) const {
  if (device_dst == nullptr) return Status::InvalidArgument("WriteFoundInf: device_dst is null");
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceScalars::WriteFoundInf"));
  return cuda::LaunchWriteFoundInf(header_, device_dst, stream);
}

}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
