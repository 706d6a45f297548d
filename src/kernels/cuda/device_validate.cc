// device_validate.cc — the checks DeviceScalars and DeviceUpdateTable run before touching the
// device (device_validate.h). The same with or without CUDA in the build.
#include "kernels/cuda/device_validate.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cuda/device_table.h"

namespace emsa {
namespace device_checks {
namespace {

bool IsDType(DType d) {
  return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16;
}

// A stats_only table's tensor: only numel, grad and grad_dtype are read.
Status ValidateStatsTensor(size_t i, const TensorUpdate& t) {
  if (!IsDType(t.grad_dtype)) {
    return Status::InvalidArgument(Name(i) + ".grad_dtype is not a DType value");
  }
  if (t.numel > 0 && t.grad == nullptr) return Status::InvalidArgument(Name(i) + ".grad is null");
  return Status::Ok();
}

Status ValidateTensor(size_t i, const TensorUpdate& t, int32_t group, const DeviceTableOptions& o) {
  const auto invalid = [&](const std::string& what) {
    return Status::InvalidArgument(Name(i) + "." + what);
  };
  if (t.numel < 0) return invalid("numel is " + std::to_string(t.numel) + "; it must be >= 0");
  if (group < 0) {
    return Status::InvalidArgument("groups[" + std::to_string(i) + "] is " + std::to_string(group) +
                                   "; group indices are >= 0");
  }
  if (o.stats_only) return ValidateStatsTensor(i, t);
  if (!IsDType(t.param_dtype) || !IsDType(t.grad_dtype) || !IsDType(t.state_dtype)) {
    return invalid("param_dtype, grad_dtype or state_dtype is not a DType value");
  }
  if (t.state_dtype == DType::kFloat16) {
    return Status::Unsupported(Name(i) +
                               ".state_dtype float16 is not supported; use float32 or bfloat16");
  }
  if (t.grad_dtype != DType::kFloat32 && t.grad_dtype != t.param_dtype) {
    return Status::Unsupported(Name(i) + ".grad_dtype is " + DTypeName(t.grad_dtype) + " with a " +
                               DTypeName(t.param_dtype) +
                               " param; on the device the grad is float32 or the param's dtype");
  }
  if (t.delta != nullptr) {
    return Status::Unsupported(Name(i) +
                               ".delta is set; the device kernels update the parameter in place "
                               "(delta is for the CPU updater): pass null");
  }
  const bool low_param = t.param_dtype != DType::kFloat32;
  if (!low_param && t.master != nullptr) {
    return invalid("master is set but param is float32, which is its own master; pass null");
  }
  if (low_param && t.master == nullptr && o.rounding != Rounding::kStochastic) {
    return invalid(std::string("param is ") + DTypeName(t.param_dtype) +
                   " without an fp32 master, which needs Rounding::kStochastic (round-to-nearest "
                   "would drop small updates); pass a master copy or stochastic rounding");
  }
  if (t.numel == 0) return Status::Ok();
  if (t.param == nullptr) return invalid("param is null");
  if (t.grad == nullptr) return invalid("grad is null");
  if (t.exp_avg == nullptr) return invalid("exp_avg is null");
  if (t.exp_avg_sq == nullptr && o.optimizer != OptimizerKind::kLion) {
    return invalid(std::string("exp_avg_sq is null; ") + OptimizerName(o.optimizer) +
                   " keeps two moments");
  }
  return Status::Ok();
}

}  // namespace

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string Name(size_t i) { return "tensors[" + std::to_string(i) + "]"; }

Status ValidateGroupHyper(const HyperParams& h, std::string_view where) {
  return ValidateHyperParams(h, OptimizerKind::kAdamW, where);
}

Status ValidateGroups(const HyperParams* hypers, size_t group_count) {
  if (group_count == 0) {
    return Status::InvalidArgument("group_count is 0; a DeviceScalars needs at least one group");
  }
  if (hypers == nullptr) return Status::InvalidArgument("hypers is null");
  if (group_count > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return Status::InvalidArgument("group_count " + std::to_string(group_count) +
                                   " exceeds 2^31 - 1 groups");
  }
  for (size_t i = 0; i < group_count; ++i) {
    EMSA_RETURN_IF_ERROR(ValidateGroupHyper(hypers[i], "hypers[" + std::to_string(i) + "]."));
  }
  return Status::Ok();
}

namespace {

// Each slot in [0, 2^31) and held by one tensor of the table only (its Update advances each
// present tensor's slot once: a second tensor would advance it twice).
Status ValidateSlots(const int64_t* slots, size_t count, const DeviceTableOptions& options,
                     int64_t* slots_needed) {
  *slots_needed = 0;
  if (slots == nullptr) return Status::Ok();
  if (options.stats_only) {
    return Status::InvalidArgument(
        "slots given for a stats_only table, which has no steps; pass null slots");
  }
  for (size_t i = 0; i < count; ++i) {
    if (slots[i] < 0 || slots[i] > std::numeric_limits<int32_t>::max()) {
      return Status::InvalidArgument("slots[" + std::to_string(i) + "] is " +
                                     std::to_string(slots[i]) + "; slots are in [0, 2^31)");
    }
    *slots_needed = std::max(*slots_needed, slots[i] + 1);
  }
  std::vector<int64_t> sorted(slots, slots + count);  // bind time: allocation is fine here
  std::sort(sorted.begin(), sorted.end());
  const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  if (twice != sorted.end()) {
    return Status::InvalidArgument("slot " + std::to_string(*twice) +
                                   " is given to two tensors of the table; each tensor needs its "
                                   "own slot (its own step count)");
  }
  return Status::Ok();
}

}  // namespace

Status ValidateTable(const TensorUpdate* tensors, const int32_t* groups, const int64_t* slots,
                     size_t count, const DeviceTableOptions& options, TableShape* shape) {
  EMSA_RETURN_IF_ERROR(ValidateOptimizer(options.optimizer, "options.optimizer"));
  if (options.rounding != Rounding::kNearest && options.rounding != Rounding::kStochastic) {
    return Status::InvalidArgument("options.rounding is " +
                                   std::to_string(static_cast<int>(options.rounding)) +
                                   "; use Rounding::kNearest or kStochastic");
  }
  if (tensors == nullptr && count > 0) {
    return Status::InvalidArgument("tensors is null but count is " + std::to_string(count));
  }
  if (count > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return Status::InvalidArgument("count " + std::to_string(count) +
                                   " exceeds 2^31 - 1 tensors in one table; split the bucket");
  }
  *shape = TableShape{};
  for (size_t i = 0; i < count; ++i) {
    const int32_t group = groups != nullptr ? groups[i] : 0;
    EMSA_RETURN_IF_ERROR(ValidateTensor(i, tensors[i], group, options));
    if (tensors[i].numel > std::numeric_limits<int64_t>::max() - shape->total) {
      return Status::InvalidArgument(Name(i) + ".numel makes the table's element count overflow");
    }
    shape->total += tensors[i].numel;
    shape->chunks += (tensors[i].numel + cuda::kChunkElems - 1) / cuda::kChunkElems;
    shape->max_group = std::max(shape->max_group, group);
  }
  return ValidateSlots(slots, count, options, &shape->slots_needed);
}

Status ValidateSlotCount(size_t slot_count) {
  if (slot_count > (size_t{1} << 31)) {
    return Status::InvalidArgument("slot_count " + std::to_string(slot_count) +
                                   " exceeds 2^31 slots");
  }
  return Status::Ok();
}

Status CheckSlotCount(size_t count, size_t slot_count, const char* what) {
  if (count != slot_count) {
    return Status::InvalidArgument(std::string(what) + ": count is " + std::to_string(count) +
                                   " but the scalars hold " + std::to_string(slot_count) +
                                   " slot steps; pass one per slot");
  }
  return Status::Ok();
}

Status CheckSlotSteps(const int64_t* steps, size_t count, size_t slot_count) {
  EMSA_RETURN_IF_ERROR(CheckSlotCount(count, slot_count, "SetSlotSteps"));
  if (count > 0 && steps == nullptr) {
    return Status::InvalidArgument("SetSlotSteps: steps is null");
  }
  for (size_t i = 0; i < count; ++i) {
    if (steps[i] < 0) {
      return Status::InvalidArgument("SetSlotSteps: steps[" + std::to_string(i) + "] is " +
                                     std::to_string(steps[i]) +
                                     "; steps are >= 0 (an update adds 1 before using it)");
    }
  }
  return Status::Ok();
}

Status CheckGroupIndex(size_t group, size_t group_count) {
  if (group >= group_count) {
    return Status::InvalidArgument("group " + std::to_string(group) + " is out of range; there " +
                                   "are " + std::to_string(group_count) + " groups");
  }
  return Status::Ok();
}

}  // namespace device_checks
}  // namespace emsa
