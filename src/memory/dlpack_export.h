// dlpack_export.h — arena views handed to frameworks as DLPack tensors, without a copy.
//
// Each export returns a new DLManagedTensor (DLPack 0.x, unversioned) describing a contiguous
// row-major view: data points at the view's first element, byte_offset is 0 (as torch's own
// exports do, since older consumers ignore byte_offset), strides are always filled in
// (elements, row-major), dtype float32 = (kDLFloat, 32, 1), bfloat16 = (kDLBfloat, 16, 1),
// float16 = (kDLFloat, 16, 1). The shape and strides live in memory the export owns.
//
// Ownership, the whole contract:
//  - The export holds one reference to the memory's owner (a shared_ptr: the DeviceArena, the
//    HostArena, or any owner of a byte range). The memory stays allocated until every export's
//    deleter has run and emsa has dropped its own reference, whichever comes last.
//  - deleter(self) must run exactly once. It frees the shape/strides and the DLManagedTensor and
//    drops the owner reference; it may run on any thread. Afterwards self is gone.
//  - Who calls it: torch.from_dlpack(capsule) takes over the tensor, renames the capsule
//    "used_dltensor", and calls the deleter when the last torch tensor aliasing the memory dies.
//    The C ABI hands the pointer to Python, which wraps it in a PyCapsule named "dltensor"; that
//    capsule's destructor must call the deleter if, and only if, the name is still "dltensor"
//    when the capsule dies (never consumed). Until it is wrapped, the caller owns the pointer
//    and must call the deleter itself on every path that does not hand it over.
//  - Writes through a framework tensor are writes to the arena: the engine and the framework
//    must order them with streams/events like any other shared memory.
//
// torch.from_dlpack rejects kDLCUDAHost: host arena views are exported as kDLCPU, pinned or not
// (torch sees pinned memory as CPU memory anyway). Other consumers may be given kDLCUDAHost
// through ExportDLPack().
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "emsa/status.h"
#include "emsa/types.h"
#include "memory/dlpack.h"

namespace emsa {

class DeviceArena;
class HostArena;

DLDataType ToDLDataType(DType dtype);

// A byte range and whoever keeps it allocated.
struct DLPackSource {
  void* base = nullptr;           // first byte of the range
  uint64_t bytes = 0;             // length of the range
  DLDevice device = {kDLCPU, 0};  // kDLCPU uses device_id 0
  std::shared_ptr<void> owner;    // required: held until the deleter runs
};

// A view of `shape` elements of `dtype` starting `offset` bytes into the source. Errors
// (kInvalidArgument, nothing is exported and no reference is taken): a null owner or base, a
// negative dimension, an element count that overflows, a view that does not fit inside the
// range, an offset misaligned for the dtype, more than 2^31 - 1 dimensions.
// kOutOfMemory when the descriptor itself cannot be allocated.
Result<DLManagedTensor*> ExportDLPack(const DLPackSource& source, uint64_t offset,
                                      const std::vector<int64_t>& shape, DType dtype);

// Views of the arenas; the export keeps the arena alive (see above). Device arena views are
// kDLCUDA on the arena's device; host arena views are kDLCPU.
Result<DLManagedTensor*> ExportView(const std::shared_ptr<DeviceArena>& arena, uint64_t offset,
                                    const std::vector<int64_t>& shape, DType dtype);
Result<DLManagedTensor*> ExportView(const std::shared_ptr<HostArena>& arena, uint64_t offset,
                                    const std::vector<int64_t>& shape, DType dtype);

}  // namespace emsa
