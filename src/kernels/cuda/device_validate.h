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
// DeviceScalars' slot_count: at most 2^31 (slots are int32 in the device table).
Status ValidateSlotCount(size_t slot_count);
// `count` must be the scalars' slot_count (what: the method, for the message).
Status CheckSlotCount(size_t count, size_t slot_count, const char* what);
// SetSlotSteps' input: count = slot_count, steps non-null when count > 0, every step >= 0.
Status CheckSlotSteps(const int64_t* steps, size_t count, size_t slot_count);

// What validation learns about a table on the way.
struct TableShape {
  int64_t total = 0;   // elements
  int64_t chunks = 0;  // kChunkElems pieces
  int32_t max_group = 0;
  int64_t slots_needed = 0;  // largest slot + 1 (0 without slots or tensors)
};

// slots: null for group steps; else each >= 0 and below 2^31, no slot twice, and not with
// options.stats_only.
Status ValidateTable(const TensorUpdate* tensors, const int32_t* groups, const int64_t* slots,
                     size_t count, const DeviceTableOptions& options, TableShape* shape);

}  // namespace device_checks
}  // namespace emsa
