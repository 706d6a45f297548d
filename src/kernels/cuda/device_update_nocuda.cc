// device_update_nocuda.cc — DeviceScalars and DeviceUpdateTable in a build without CUDA: the
// API exists, validates (device_validate.h, so bad input gets the error that names it), and
// then says why it cannot work.
#if !EMSA_HAVE_CUDA

#include <string>

#include "emsa/cuda_update.h"
#include "kernels/cuda/device_validate.h"

namespace emsa {
namespace {

using device_checks::CheckSlotCount;
using device_checks::CheckSlotSteps;
using device_checks::TableShape;
using device_checks::ValidateGroups;
using device_checks::ValidateSlotCount;
using device_checks::ValidateTable;

Status NoCuda(const char* what) {
  return Status::Unsupported(std::string(what) +
                             ": this build of emsa has no CUDA (nvcc was not found at configure "
                             "time); rebuild with the CUDA toolkit for the device tier");
}
}  // namespace

struct DeviceUpdateTable::Impl {};

Result<std::unique_ptr<DeviceScalars>> DeviceScalars::Create(const HyperParams* hypers,
                                                             size_t group_count,
                                                             size_t slot_count) {
  EMSA_RETURN_IF_ERROR(ValidateGroups(hypers, group_count));
  EMSA_RETURN_IF_ERROR(ValidateSlotCount(slot_count));
  return NoCuda("DeviceScalars::Create");
}
DeviceScalars::~DeviceScalars() = default;
Status DeviceScalars::SetGroup(size_t, const HyperParams&, int64_t, cudaStream_t) {
  return NoCuda("DeviceScalars::SetGroup");
}
Status DeviceScalars::SetGroupHyper(size_t, const HyperParams&, cudaStream_t) {
  return NoCuda("DeviceScalars::SetGroupHyper");
}
Status DeviceScalars::CopyHeader(DeviceStepHeader*, cudaStream_t) const {
  return NoCuda("DeviceScalars::CopyHeader");
}
Status DeviceScalars::SetInputs(float, float, uint64_t, cudaStream_t) {
  return NoCuda("DeviceScalars::SetInputs");
}
Status DeviceScalars::UploadHeader(const DeviceStepHeader*, cudaStream_t) {
  return NoCuda("DeviceScalars::UploadHeader");
}
Status DeviceScalars::UploadGroups(const DeviceGroupScalars*, cudaStream_t) {
  return NoCuda("DeviceScalars::UploadGroups");
}
Status DeviceScalars::BeginStep(cudaStream_t) { return NoCuda("DeviceScalars::BeginStep"); }
Status DeviceScalars::FinishGradStats(cudaStream_t) {
  return NoCuda("DeviceScalars::FinishGradStats");
}
Status DeviceScalars::AdvanceSteps(cudaStream_t) { return NoCuda("DeviceScalars::AdvanceSteps"); }
Status DeviceScalars::Read(DeviceStepHeader*, DeviceGroupScalars*, cudaStream_t) const {
  return NoCuda("DeviceScalars::Read");
}
Status DeviceScalars::ReadSlotSteps(int64_t*, size_t count, cudaStream_t) const {
  EMSA_RETURN_IF_ERROR(CheckSlotCount(count, slot_count_, "ReadSlotSteps"));
  return NoCuda("DeviceScalars::ReadSlotSteps");
}
Status DeviceScalars::SetSlotSteps(const int64_t* steps, size_t count, cudaStream_t) {
  EMSA_RETURN_IF_ERROR(CheckSlotSteps(steps, count, slot_count_));
  return NoCuda("DeviceScalars::SetSlotSteps");
}
Status DeviceScalars::SetUnscaleFrom(const float*, cudaStream_t) {
  return NoCuda("DeviceScalars::SetUnscaleFrom");
}
Status DeviceScalars::WriteFoundInf(float*, cudaStream_t) const {
  return NoCuda("DeviceScalars::WriteFoundInf");
}

Result<std::unique_ptr<DeviceUpdateTable>> DeviceUpdateTable::Create(
    const TensorUpdate* tensors, const int32_t* groups, size_t count,
    const DeviceTableOptions& options, const int64_t* slots) {
  TableShape shape;
  EMSA_RETURN_IF_ERROR(ValidateTable(tensors, groups, slots, count, options, &shape));
  return NoCuda("DeviceUpdateTable::Create");
}
DeviceUpdateTable::~DeviceUpdateTable() = default;
Status DeviceUpdateTable::Update(const DeviceScalars&, cudaStream_t) {
  return NoCuda("DeviceUpdateTable::Update");
}
Status DeviceUpdateTable::SetAccessWindow(const DeviceAccessWindow&) {
  return NoCuda("DeviceUpdateTable::SetAccessWindow");
}
Status DeviceUpdateTable::AccumulateGradStats(DeviceScalars&, cudaStream_t) {
  return NoCuda("DeviceUpdateTable::AccumulateGradStats");
}
Status DeviceUpdateTable::ReadStats(DeviceTableStats*, cudaStream_t) const {
  return NoCuda("DeviceUpdateTable::ReadStats");
}
Status DeviceUpdateTable::SetGradPointers(const void* const*, size_t, cudaStream_t) {
  return NoCuda("DeviceUpdateTable::SetGradPointers");
}

}  // namespace emsa

#endif  // !EMSA_HAVE_CUDA
