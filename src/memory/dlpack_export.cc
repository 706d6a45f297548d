// dlpack_export.cc — DLManagedTensor descriptors whose deleter drops a reference on the memory.
#include "memory/dlpack_export.h"

#include <limits>
#include <new>
#include <string>
#include <utility>

#include "emsa/device_arena.h"
#include "emsa/host_arena.h"

namespace emsa {
namespace {

// manager_ctx points here; the DLManagedTensor is the first member so one allocation serves.
struct ExportedView {
  DLManagedTensor tensor;
  std::unique_ptr<int64_t[]> dims;  // shape, then strides
  std::shared_ptr<void> owner;
};

void DeleteExportedView(DLManagedTensor* self) {
  delete static_cast<ExportedView*>(self->manager_ctx);
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

}  // namespace

DLDataType ToDLDataType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return {kDLFloat, 32, 1};
    case DType::kBFloat16:
      return {kDLBfloat, 16, 1};
    case DType::kFloat16:
      return {kDLFloat, 16, 1};
  }
  return {kDLOpaqueHandle, 0, 0};  // unreachable for valid enum values
}

Result<DLManagedTensor*> ExportDLPack(const DLPackSource& source, uint64_t offset,
                                      const std::vector<int64_t>& shape, DType dtype) {
  const std::string what = "DLPack export of a " + std::string(DTypeName(dtype)) + " view " +
                           ShapeText(shape) + " at byte offset " + std::to_string(offset);
  if (source.owner == nullptr) {
    return Status::InvalidArgument(what +
                                   ": the owner is null; pass the object that keeps the "
                                   "memory allocated, so the view cannot outlive it");
  }
  if (source.base == nullptr) return Status::InvalidArgument(what + ": the base pointer is null");
  if (shape.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return Status::InvalidArgument(what + ": too many dimensions");
  }
  const uint64_t element = DTypeSize(dtype);
  // The product with zero dimensions counted as 1 bounds every stride; it must fit int64.
  const uint64_t limit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / element;
  uint64_t extent = 1;
  bool empty = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return Status::InvalidArgument(what + ": dimension " + std::to_string(i) + " is negative");
    }
    const uint64_t dim = shape[i] > 0 ? static_cast<uint64_t>(shape[i]) : 1;
    if (extent > limit / dim) {
      return Status::InvalidArgument(what + ": the element count overflows");
    }
    extent *= dim;
    empty = empty || shape[i] == 0;
  }
  const uint64_t bytes = empty ? 0 : extent * element;
  if (offset > source.bytes || bytes > source.bytes - offset) {
    return Status::InvalidArgument(what + ": needs " + std::to_string(bytes) +
                                   " bytes there, but the range holds " +
                                   std::to_string(source.bytes) + " bytes");
  }
  char* data = static_cast<char*>(source.base) + offset;
  if (reinterpret_cast<uintptr_t>(data) % element != 0) {
    return Status::InvalidArgument(what + ": the address is not aligned to the " +
                                   std::to_string(element) + "-byte element size");
  }

  std::unique_ptr<ExportedView> view(new (std::nothrow) ExportedView());
  const size_t ndim = shape.size();
  if (view != nullptr && ndim > 0) view->dims.reset(new (std::nothrow) int64_t[2 * ndim]);
  if (view == nullptr || (ndim > 0 && view->dims == nullptr)) {
    return Status::OutOfMemory(what + ": cannot allocate the descriptor");
  }
  int64_t* dims = view->dims.get();
  int64_t stride = 1;
  for (size_t i = ndim; i-- > 0;) {
    dims[i] = shape[i];
    dims[ndim + i] = stride;
    // Cannot overflow: bounded by `extent` (checked above).
    stride *= shape[i] > 0 ? shape[i] : 1;
  }
  view->owner = source.owner;

  DLTensor& tensor = view->tensor.dl_tensor;
  tensor.data = data;
  tensor.device = source.device;
  if (tensor.device.device_type == kDLCPU) tensor.device.device_id = 0;
  tensor.ndim = static_cast<int32_t>(ndim);
  tensor.dtype = ToDLDataType(dtype);
  tensor.shape = ndim > 0 ? dims : nullptr;
  tensor.strides = ndim > 0 ? dims + ndim : nullptr;
  tensor.byte_offset = 0;
  view->tensor.manager_ctx = view.get();
  view->tensor.deleter = DeleteExportedView;
  return &view.release()->tensor;
}

Result<DLManagedTensor*> ExportView(const std::shared_ptr<DeviceArena>& arena, uint64_t offset,
                                    const std::vector<int64_t>& shape, DType dtype) {
  if (arena == nullptr) return Status::InvalidArgument("DLPack export: the device arena is null");
  DLPackSource source;
  source.base = arena->data();
  source.bytes = arena->size();
  source.device = {kDLCUDA, arena->device()};
  source.owner = arena;
  return ExportDLPack(source, offset, shape, dtype);
}

Result<DLManagedTensor*> ExportView(const std::shared_ptr<HostArena>& arena, uint64_t offset,
                                    const std::vector<int64_t>& shape, DType dtype) {
  if (arena == nullptr) return Status::InvalidArgument("DLPack export: the host arena is null");
  DLPackSource source;
  source.base = arena->data();
  source.bytes = arena->size();
  source.device = {kDLCPU, 0};
  source.owner = arena;
  return ExportDLPack(source, offset, shape, dtype);
}

}  // namespace emsa
