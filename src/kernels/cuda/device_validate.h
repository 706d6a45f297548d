// device_validate.h — the checks DeviceScalars and DeviceUpdateTable (emsa/cuda_update.h) run
// before touching the device, so bad input always gets the error that names it, with or
// without CUDA in the build. Internal to src/kernels/cuda.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "emsa/cuda_update.h"
#include "emsa/update.h"

namespace emsa {
namespace device_checks {

std::string Num(double v);   // "%g"
std::string Name(size_t i);  // "tensors[i]"

// A group does not know which optimizer's table will read it: the strictest rule (Adam's).
Status ValidateGroupHyper(const HyperParams& h, std::string_view where);
Status ValidateGroups(const HyperParams* hypers, size_t group_count);
Status CheckGroupIndex(size_t group, size_t group_count);

// What validation learns about a table on the way.
struct TableShape {
  int64_t total = 0;   // elements
  int64_t chunks = 0;  // kChunkElems pieces
  int32_t max_group = 0;
};

Status ValidateTable(const TensorUpdate* tensors, const int32_t* groups, size_t count,
                     const DeviceTableOptions& options, TableShape* shape);

}  // namespace device_checks
}  // namespace emsa
