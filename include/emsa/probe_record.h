// emsa/probe_record.h — what one probe (a dry-run forward+backward on a real batch) observed.
//
// Produced by the Python front end's emsa.probe() (hooks on the real model), or synthesized
// analytically from a model config (emsa/analytic_probe.h). Consumed by the planner.
// Times are seconds from the start of the probed step (forward begins at 0); memory in bytes.
// JSON form: {"format":"emsa.probe","version":1, ...}; see ProbeRecordToJson for the layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "emsa/profile.h"
#include "emsa/status.h"
#include "emsa/types.h"

namespace emsa {

struct ParamRecord {
  std::string name;    // e.g. "model.layers.0.self_attn.q_proj.weight"
  std::string module;  // owning module, e.g. "model.layers.0.self_attn.q_proj"
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  int64_t numel = 0;                    // product of shape; must match it
  uint64_t bytes = 0;                   // numel * DTypeSize(dtype); must match it
  bool trainable = true;                // false: frozen, holds memory but no optimizer state
  std::vector<std::string> tied_names;  // other names of this same tensor (tied/shared)
  int use_count = 1;                    // times used in forward (shared modules: > 1)
  int64_t forward_order = -1;           // rank of first use in forward (0 = first); -1 never used
  double forward_time = 0.0;            // s, first use in forward
  int64_t grad_ready_order = -1;        // rank of grad becoming final in backward; -1 no grad
  double grad_ready_time = 0.0;         // s, when .grad is final (post-accumulate-grad hook)
};

// Device memory in use at a module boundary.
struct MemorySample {
  std::string module;
  std::string event;          // "forward_pre", "forward_post", "backward_post"
  double time = 0.0;          // s
  uint64_t device_bytes = 0;  // memory allocated on the device at that moment
};

// Optional structure from torch.fx: ops in topological order, each naming the parameters it
// reads and the earlier ops whose outputs it consumes.
struct GraphOp {
  std::string name;
  std::vector<std::string> params;
  std::vector<int64_t> inputs;  // indices of earlier ops
};

struct ProbeRecord {
  static constexpr int kVersion = 1;
  // Limits that ValidateProbeRecord holds a record to, far above any model trained today, so
  // that every size the planner derives from a record (state bytes, alignments, prefix sums)
  // fits in uint64 and every loop over it ends in moments.
  static constexpr size_t kMaxParams = size_t{1} << 18;
  static constexpr size_t kMaxMemorySamples = size_t{1} << 20;
  static constexpr size_t kMaxGraphOps = size_t{1} << 18;
  // 1 PiB: the most in the peak, in any memory sample, and in the parameters together.
  static constexpr uint64_t kMaxBytes = uint64_t{1} << 50;

  std::string model;           // free text, e.g. "LlamaForCausalLM"
  std::string device;          // where the probe ran: "cuda:0", "cpu"
  double forward_time = 0.0;   // s, forward duration
  double backward_time = 0.0;  // s, backward duration (forward_time + backward_time = P)
  // s, forward + backward again while emsa::HostLoad ran (the host tier's CPU update and PCIe
  // copies): the threads that launch the GPU's work slow down when the host's memory and link
  // are saturated, which stretches a launch-bound step. 0: not measured (no GPU, or an older
  // record); the planner then assumes no slowdown.
  double period_under_load = 0.0;
  uint64_t peak_device_bytes = 0;      // peak device memory during forward+backward, no optimizer
  uint64_t activation_peak_bytes = 0;  // peak minus memory in use before forward
  std::vector<ParamRecord> params;     // trainable and frozen, tied tensors listed once
  std::vector<MemorySample> memory;
  std::vector<GraphOp> graph;  // empty when the model did not trace
  bool has_profile = false;
  DeviceProfile profile;  // the machine the probe ran on, when has_profile
};

// Checks internal consistency: numel = prod(shape) (>= 0), bytes = numel * dtype size, unique
// names (aliases included), times finite and >= 0, orders unique among params that have them,
// graph references resolvable. Also: use_count >= 0; a frozen parameter has grad_ready_order -1;
// activation_peak_bytes and every memory sample <= peak_device_bytes; graph inputs name earlier
// ops. The counts and byte sizes are at most the limits above: params, memory samples, graph ops;
// each of peak_device_bytes and the sum of the parameters' bytes at most kMaxBytes. Errors
// (kInvalidArgument) name the parameter and the field.
Status ValidateProbeRecord(const ProbeRecord& record);

// Pretty-printed JSON, keys in this order (the same record always gives the same bytes):
//   {"format": "emsa.probe", "version": 1, "model", "device", "forward_time", "backward_time",
//    "period_under_load", "peak_device_bytes", "activation_peak_bytes",
//    "params": [{"name", "module", "shape": [..], "dtype": "float32", "numel", "bytes",
//                "trainable", "tied_names": [..], "use_count", "forward_order", "forward_time",
//                "grad_ready_order", "grad_ready_time"}, ...],
//    "memory": [{"module", "event", "time", "device_bytes"}, ...],
//    "graph": [{"name", "params": [..], "inputs": [..]}, ...],
//    "profile": {DeviceProfileToJson's object}}            <- only when has_profile
// Reading requires format, version, forward_time, backward_time, peak_device_bytes,
// activation_peak_bytes, params; per parameter name, module, shape, dtype, numel, bytes; per
// memory sample all four keys; per graph op its name. Everything else may be absent (or null)
// and takes the struct's default; unknown keys are ignored, so a newer writer's additions do
// not break an older reader.
std::string ProbeRecordToJson(const ProbeRecord& record);
// Parses and validates. Wrong "format" or "version", missing or mistyped fields: kParseError
// naming the field ("params[12].shape: expected an array of integers"). Unsupported dtypes:
// kUnsupported naming the parameter. A record that parses but fails ValidateProbeRecord:
// kParseError with Validate's message.
Result<ProbeRecord> ProbeRecordFromJson(std::string_view text);
// As ProbeRecordFromJson, messages prefixed with the path; an unreadable file is kIoError.
Result<ProbeRecord> LoadProbeRecord(const std::string& path);
// Validates first and writes nothing when the record is invalid; kIoError naming the path.
Status SaveProbeRecord(const ProbeRecord& record, const std::string& path);

}  // namespace emsa
