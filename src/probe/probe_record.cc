// probe_record.cc — checking a ProbeRecord, and its versioned JSON form.
#include "emsa/probe_record.h"

#include <cmath>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "common/json.h"

namespace emsa {
namespace {

constexpr const char* kFormat = "emsa.probe";

std::string ParamLabel(size_t i, const std::string& name) {
  return "params[" + std::to_string(i) + "] ('" + name + "')";
}

Status CheckTime(double t, const std::string& field) {
  if (std::isfinite(t) && t >= 0) return Status::Ok();
  return Status::InvalidArgument(field + ": " + std::to_string(t) +
                                 " is not a time; times are finite seconds >= 0");
}

// Order -1 means "none"; the others must be distinct ranks.
Status CheckOrder(int64_t order, size_t i, const std::string& label, const char* field,
                  std::unordered_map<int64_t, size_t>* seen) {
  if (order < -1) {
    return Status::InvalidArgument(label + "." + field + ": " + std::to_string(order) +
                                   " is not a rank; use -1 for none or a rank >= 0");
  }
  if (order == -1) return Status::Ok();
  auto [it, inserted] = seen->emplace(order, i);
  if (!inserted) {
    return Status::InvalidArgument(label + "." + field + ": rank " + std::to_string(order) +
                                   " is also held by params[" + std::to_string(it->second) +
                                   "]; ranks must be unique");
  }
  return Status::Ok();
}

// `names` views the record's own strings: the check copies none of them.
Status CheckParam(const ParamRecord& p, size_t i,
                  std::unordered_map<std::string_view, size_t>* names,
                  std::unordered_map<int64_t, size_t>* forward_ranks,
                  std::unordered_map<int64_t, size_t>* grad_ranks) {
  const std::string label = ParamLabel(i, p.name);
  if (p.name.empty()) return Status::InvalidArgument(label + ".name: must not be empty");
  auto claim = [&](const std::string& name, const std::string& field) -> Status {
    if (name.empty()) return Status::InvalidArgument(label + "." + field + ": must not be empty");
    auto [it, inserted] = names->emplace(name, i);
    if (inserted) return Status::Ok();
    return Status::InvalidArgument(
        label + "." + field + ": name '" + name + "' is already used by params[" +
        std::to_string(it->second) +
        "]; list a tied tensor once, with its other names in tied_names");
  };
  EMSA_RETURN_IF_ERROR(claim(p.name, "name"));
  for (size_t k = 0; k < p.tied_names.size(); ++k) {
    EMSA_RETURN_IF_ERROR(claim(p.tied_names[k], "tied_names[" + std::to_string(k) + "]"));
  }

  int64_t product = 1;
  for (size_t k = 0; k < p.shape.size(); ++k) {
    const std::string field = label + ".shape[" + std::to_string(k) + "]";
    if (p.shape[k] < 0) {
      return Status::InvalidArgument(field + ": " + std::to_string(p.shape[k]) +
                                     " is negative; sizes are >= 0");
    }
    if (__builtin_mul_overflow(product, p.shape[k], &product)) {
      return Status::InvalidArgument(field + ": the shape's element count overflows int64");
    }
  }
  if (p.numel < 0) {
    return Status::InvalidArgument(label + ".numel: " + std::to_string(p.numel) + " is negative");
  }
  if (p.numel != product) {
    return Status::InvalidArgument(label + ".numel: " + std::to_string(p.numel) +
                                   " does not equal the product of shape, " +
                                   std::to_string(product));
  }
  const size_t elem = DTypeSize(p.dtype);
  if (elem == 0) {
    return Status::InvalidArgument(label + ".dtype: not a known DType value (" +
                                   std::to_string(static_cast<int>(p.dtype)) + ")");
  }
  uint64_t want_bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(p.numel), static_cast<uint64_t>(elem),
                             &want_bytes)) {
    return Status::InvalidArgument(label + ".numel: byte size overflows uint64");
  }
  if (p.bytes != want_bytes) {
    return Status::InvalidArgument(label + ".bytes: " + std::to_string(p.bytes) +
                                   " does not equal numel * " + std::to_string(elem) + " (" +
                                   DTypeName(p.dtype) + ") = " + std::to_string(want_bytes));
  }
  if (p.use_count < 0) {
    return Status::InvalidArgument(label + ".use_count: " + std::to_string(p.use_count) +
                                   " is negative");
  }
  EMSA_RETURN_IF_ERROR(CheckOrder(p.forward_order, i, label, "forward_order", forward_ranks));
  EMSA_RETURN_IF_ERROR(CheckOrder(p.grad_ready_order, i, label, "grad_ready_order", grad_ranks));
  if (!p.trainable && p.grad_ready_order >= 0) {
    return Status::InvalidArgument(label +
                                   ".grad_ready_order: a frozen (trainable=false) parameter has "
                                   "no gradient; use -1");
  }
  EMSA_RETURN_IF_ERROR(CheckTime(p.forward_time, label + ".forward_time"));
  return CheckTime(p.grad_ready_time, label + ".grad_ready_time");
}

// ---- writing
// -------------------------------------------------------------------------------------

json::Value StringArray(const std::vector<std::string>& items) {
  json::Value out = json::Value::MakeArray();
  for (const std::string& s : items) out.Push(s);
  return out;
}

json::Value IntArray(const std::vector<int64_t>& items) {
  json::Value out = json::Value::MakeArray();
  for (int64_t v : items) out.Push(v);
  return out;
}

json::Value ParamToJson(const ParamRecord& p) {
  json::Value o = json::Value::MakeObject();
  o.Set("name", p.name);
  o.Set("module", p.module);
  o.Set("shape", IntArray(p.shape));
  o.Set("dtype", DTypeName(p.dtype));
  o.Set("numel", p.numel);
  o.Set("bytes", p.bytes);
  o.Set("trainable", p.trainable);
  o.Set("tied_names", StringArray(p.tied_names));
  o.Set("use_count", p.use_count);
  o.Set("forward_order", p.forward_order);
  o.Set("forward_time", p.forward_time);
  o.Set("grad_ready_order", p.grad_ready_order);
  o.Set("grad_ready_time", p.grad_ready_time);
  return o;
}

json::Value SampleToJson(const MemorySample& m) {
  json::Value o = json::Value::MakeObject();
  o.Set("module", m.module);
  o.Set("event", m.event);
  o.Set("time", m.time);
  o.Set("device_bytes", m.device_bytes);
  return o;
}

json::Value OpToJson(const GraphOp& op) {
  json::Value o = json::Value::MakeObject();
  o.Set("name", op.name);
  o.Set("params", StringArray(op.params));
  o.Set("inputs", IntArray(op.inputs));
  return o;
}

// ---- reading
// -------------------------------------------------------------------------------------

Status RequireObject(const json::Reader& r) {
  if (r.value().is_object()) return Status::Ok();
  return Status::ParseError(r.path() + ": expected an object");
}

Result<std::vector<std::string>> ReadStrings(const json::Reader& r, std::string_view key) {
  std::vector<std::string> out;
  if (!r.Has(key)) return out;
  EMSA_ASSIGN_OR_RETURN(std::vector<json::Reader> items, r.Array(key));
  for (const json::Reader& item : items) {
    EMSA_ASSIGN_OR_RETURN(std::string s, item.AsString());
    out.push_back(std::move(s));
  }
  return out;
}

Result<std::vector<int64_t>> ReadInts(const json::Reader& r, std::string_view key) {
  EMSA_ASSIGN_OR_RETURN(std::vector<json::Reader> items, r.Array(key));
  std::vector<int64_t> out;
  for (const json::Reader& item : items) {
    EMSA_ASSIGN_OR_RETURN(int64_t v, item.AsInt());
    out.push_back(v);
  }
  return out;
}

Result<int> ReadSmallInt(const json::Reader& r, std::string_view key, int def) {
  EMSA_ASSIGN_OR_RETURN(int64_t v, r.Int(key, def));
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
    return r.Error(key, "value " + std::to_string(v) + " is out of range");
  }
  return static_cast<int>(v);
}

Result<ParamRecord> ReadParam(const json::Reader& r) {
  EMSA_RETURN_IF_ERROR(RequireObject(r));
  ParamRecord p;
  EMSA_ASSIGN_OR_RETURN(p.name, r.String("name"));
  EMSA_ASSIGN_OR_RETURN(p.module, r.String("module"));
  EMSA_ASSIGN_OR_RETURN(p.shape, ReadInts(r, "shape"));
  EMSA_ASSIGN_OR_RETURN(std::string dtype, r.String("dtype"));
  Result<DType> parsed = ParseDType(dtype);
  if (!parsed.ok()) {
    return Status::Unsupported(r.path() + ".dtype: parameter '" + p.name +
                               "': " + parsed.status().message());
  }
  p.dtype = parsed.value();
  EMSA_ASSIGN_OR_RETURN(p.numel, r.Int("numel"));
  EMSA_ASSIGN_OR_RETURN(p.bytes, r.UInt("bytes"));
  EMSA_ASSIGN_OR_RETURN(p.trainable, r.Bool("trainable", true));
  EMSA_ASSIGN_OR_RETURN(p.tied_names, ReadStrings(r, "tied_names"));
  EMSA_ASSIGN_OR_RETURN(p.use_count, ReadSmallInt(r, "use_count", 1));
  EMSA_ASSIGN_OR_RETURN(p.forward_order, r.Int("forward_order", -1));
  EMSA_ASSIGN_OR_RETURN(p.forward_time, r.Number("forward_time", 0.0));
  EMSA_ASSIGN_OR_RETURN(p.grad_ready_order, r.Int("grad_ready_order", -1));
  EMSA_ASSIGN_OR_RETURN(p.grad_ready_time, r.Number("grad_ready_time", 0.0));
  return p;
}

Result<MemorySample> ReadSample(const json::Reader& r) {
  EMSA_RETURN_IF_ERROR(RequireObject(r));
  MemorySample m;
  EMSA_ASSIGN_OR_RETURN(m.module, r.String("module"));
  EMSA_ASSIGN_OR_RETURN(m.event, r.String("event"));
  EMSA_ASSIGN_OR_RETURN(m.time, r.Number("time"));
  EMSA_ASSIGN_OR_RETURN(m.device_bytes, r.UInt("device_bytes"));
  return m;
}

Result<GraphOp> ReadOp(const json::Reader& r) {
  EMSA_RETURN_IF_ERROR(RequireObject(r));
  GraphOp op;
  EMSA_ASSIGN_OR_RETURN(op.name, r.String("name"));
  EMSA_ASSIGN_OR_RETURN(op.params, ReadStrings(r, "params"));
  if (r.Has("inputs")) {
    EMSA_ASSIGN_OR_RETURN(op.inputs, ReadInts(r, "inputs"));
  }
  return op;
}

// The record's three lists, read one element at a time as the parser hands them over (see
// json::ElementSink), so the parsed text is never held whole beside the record. The first error
// of each list is kept and reported after the fields the root checks before it, in the order a
// whole-document read would meet them: params, memory, graph.
class ListReader {
 public:
  explicit ListReader(ProbeRecord* record) : record_(record) {
    sink_.keys = {"params", "memory", "graph"};
    sink_.take = [this](const std::string& key, size_t i, json::Value element) {
      if (key == "params") {
        Take(key, i, element, ReadParam, &record_->params, &params_error_);
      } else if (key == "memory") {
        Take(key, i, element, ReadSample, &record_->memory, &memory_error_);
      } else {
        Take(key, i, element, ReadOp, &record_->graph, &graph_error_);
      }
    };
  }
  ListReader(const ListReader&) = delete;  // the sink points at this object
  ListReader& operator=(const ListReader&) = delete;
  const json::ElementSink& sink() const { return sink_; }

  // After the root's fields: `params` required, `memory` and `graph` optional; each an array.
  Status Finish(const json::Reader& root) const {
    EMSA_RETURN_IF_ERROR(root.Array("params").status());
    EMSA_RETURN_IF_ERROR(params_error_);
    if (root.Has("memory")) EMSA_RETURN_IF_ERROR(root.Array("memory").status());
    EMSA_RETURN_IF_ERROR(memory_error_);
    if (root.Has("graph")) EMSA_RETURN_IF_ERROR(root.Array("graph").status());
    return graph_error_;
  }

 private:
  template <typename T, typename F>
  static void Take(const std::string& key, size_t i, const json::Value& element, F read_one,
                   std::vector<T>* out, Status* error) {
    if (!error->ok()) return;
    Result<T> v = read_one(json::Reader(element, key + "[" + std::to_string(i) + "]"));
    if (v.ok()) {
      out->push_back(std::move(v).value());
    } else {
      *error = v.status();
      out->clear();
    }
  }

  ProbeRecord* record_;
  json::ElementSink sink_;
  Status params_error_, memory_error_, graph_error_;
};

Status ReadProfile(const json::Value& doc, ProbeRecord* record) {
  const json::Value* v = doc.Find("profile");
  if (v == nullptr || v->is_null()) return Status::Ok();
  if (!v->is_object()) return Status::ParseError("profile: expected an object");
  // The profile's own reader owns its layout and its messages (already prefixed "profile.");
  // it reads text, so hand it text.
  EMSA_ASSIGN_OR_RETURN(record->profile, DeviceProfileFromJson(json::Write(*v, -1)));
  record->has_profile = true;
  return Status::Ok();
}

Status CheckCount(size_t count, size_t limit, const char* field) {
  if (count <= limit) return Status::Ok();
  return Status::InvalidArgument(std::string(field) + ": " + std::to_string(count) +
                                 " entries exceed the limit " + std::to_string(limit));
}

Status CheckLimits(const ProbeRecord& record) {
  EMSA_RETURN_IF_ERROR(CheckCount(record.params.size(), ProbeRecord::kMaxParams, "params"));
  EMSA_RETURN_IF_ERROR(CheckCount(record.memory.size(), ProbeRecord::kMaxMemorySamples, "memory"));
  EMSA_RETURN_IF_ERROR(CheckCount(record.graph.size(), ProbeRecord::kMaxGraphOps, "graph"));
  if (record.peak_device_bytes > ProbeRecord::kMaxBytes) {
    return Status::InvalidArgument(
        "peak_device_bytes: " + std::to_string(record.peak_device_bytes) + " exceeds the limit " +
        std::to_string(ProbeRecord::kMaxBytes) + " (1 PiB)");
  }
  return Status::Ok();
}

}  // namespace

Status ValidateProbeRecord(const ProbeRecord& record) {
  EMSA_RETURN_IF_ERROR(CheckTime(record.forward_time, "forward_time"));
  EMSA_RETURN_IF_ERROR(CheckTime(record.backward_time, "backward_time"));
  EMSA_RETURN_IF_ERROR(CheckTime(record.period_under_load, "period_under_load"));
  if (record.activation_peak_bytes > record.peak_device_bytes) {
    return Status::InvalidArgument(
        "activation_peak_bytes: " + std::to_string(record.activation_peak_bytes) +
        " exceeds peak_device_bytes " + std::to_string(record.peak_device_bytes));
  }
  EMSA_RETURN_IF_ERROR(CheckLimits(record));
  std::unordered_map<std::string_view, size_t> names;
  std::unordered_map<int64_t, size_t> forward_ranks;
  std::unordered_map<int64_t, size_t> grad_ranks;
  names.reserve(record.params.size());
  forward_ranks.reserve(record.params.size());
  grad_ranks.reserve(record.params.size());
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < record.params.size(); ++i) {
    EMSA_RETURN_IF_ERROR(CheckParam(record.params[i], i, &names, &forward_ranks, &grad_ranks));
    const uint64_t bytes = record.params[i].bytes;
    const std::string field = ParamLabel(i, record.params[i].name) + ".bytes: ";
    const std::string limit = std::to_string(ProbeRecord::kMaxBytes) + " (1 PiB)";
    if (bytes > ProbeRecord::kMaxBytes) {
      return Status::InvalidArgument(field + std::to_string(bytes) + " exceeds the limit " + limit);
    }
    total_bytes += bytes;  // both at most kMaxBytes: cannot wrap
    if (total_bytes > ProbeRecord::kMaxBytes) {
      return Status::InvalidArgument(field + "the parameters' bytes up to here, " +
                                     std::to_string(total_bytes) + ", exceed the limit " + limit);
    }
  }
  for (size_t i = 0; i < record.memory.size(); ++i) {
    const MemorySample& m = record.memory[i];
    const std::string label = "memory[" + std::to_string(i) + "]";
    EMSA_RETURN_IF_ERROR(CheckTime(m.time, label + ".time"));
    if (m.event.empty()) return Status::InvalidArgument(label + ".event: must not be empty");
    if (m.device_bytes > record.peak_device_bytes) {
      return Status::InvalidArgument(label + ".device_bytes: " + std::to_string(m.device_bytes) +
                                     " exceeds peak_device_bytes " +
                                     std::to_string(record.peak_device_bytes));
    }
  }
  for (size_t i = 0; i < record.graph.size(); ++i) {
    const GraphOp& op = record.graph[i];
    const std::string label = "graph[" + std::to_string(i) + "]";
    for (size_t k = 0; k < op.params.size(); ++k) {
      if (names.count(op.params[k]) == 0) {
        return Status::InvalidArgument(label + ".params[" + std::to_string(k) + "]: '" +
                                       op.params[k] + "' names no parameter in params");
      }
    }
    for (size_t k = 0; k < op.inputs.size(); ++k) {
      if (op.inputs[k] < 0 || op.inputs[k] >= static_cast<int64_t>(i)) {
        return Status::InvalidArgument(label + ".inputs[" + std::to_string(k) +
                                       "]: " + std::to_string(op.inputs[k]) +
                                       " is not the index of an earlier op (ops are in "
                                       "topological order)");
      }
    }
  }
  return Status::Ok();
}

// Written element by element (json::ObjectWriter): the record's text is the only copy held.
std::string ProbeRecordToJson(const ProbeRecord& record) {
  std::string out;
  json::ObjectWriter doc(&out, 2);
  doc.Member("format", kFormat);
  doc.Member("version", ProbeRecord::kVersion);
  doc.Member("model", record.model);
  doc.Member("device", record.device);
  doc.Member("forward_time", record.forward_time);
  doc.Member("backward_time", record.backward_time);
  doc.Member("period_under_load", record.period_under_load);
  doc.Member("peak_device_bytes", record.peak_device_bytes);
  doc.Member("activation_peak_bytes", record.activation_peak_bytes);
  doc.BeginArray("params");
  for (const ParamRecord& p : record.params) doc.Element(ParamToJson(p));
  doc.EndArray();
  doc.BeginArray("memory");
  for (const MemorySample& m : record.memory) doc.Element(SampleToJson(m));
  doc.EndArray();
  doc.BeginArray("graph");
  for (const GraphOp& op : record.graph) doc.Element(OpToJson(op));
  doc.EndArray();
  if (record.has_profile) {
    Result<json::Value> profile = json::Parse(DeviceProfileToJson(record.profile));
    // Cannot fail unless the profile writer is broken; then write something that fails loudly
    // on reading rather than dropping the profile silently.
    doc.Member("profile", profile.ok()
                              ? std::move(profile).value()
                              : json::Value("unwritable profile: " + profile.status().message()));
  }
  doc.Finish();
  return out;
}

namespace {

// The record as the text says, not yet validated.
Result<ProbeRecord> ReadRecord(std::string_view text) {
  ProbeRecord record;
  ListReader lists(&record);
  EMSA_ASSIGN_OR_RETURN(json::Value doc, json::Parse(text, lists.sink()));
  if (!doc.is_object()) {
    return Status::ParseError("expected a JSON object with \"format\": \"emsa.probe\"");
  }
  const json::Reader root(doc, "");
  EMSA_ASSIGN_OR_RETURN(std::string format, root.String("format"));
  if (format != kFormat) {
    return root.Error("format",
                      "\"" + format + "\" is not \"emsa.probe\"; this is not a probe record");
  }
  EMSA_ASSIGN_OR_RETURN(int64_t version, root.Int("version"));
  if (version != ProbeRecord::kVersion) {
    return root.Error("version", "probe record version " + std::to_string(version) +
                                     " is not supported; this emsa reads version " +
                                     std::to_string(ProbeRecord::kVersion) +
                                     " (probe again with this emsa)");
  }
  EMSA_ASSIGN_OR_RETURN(record.model, root.String("model", ""));
  EMSA_ASSIGN_OR_RETURN(record.device, root.String("device", ""));
  EMSA_ASSIGN_OR_RETURN(record.forward_time, root.Number("forward_time"));
  EMSA_ASSIGN_OR_RETURN(record.backward_time, root.Number("backward_time"));
  EMSA_ASSIGN_OR_RETURN(record.period_under_load, root.Number("period_under_load", 0.0));
  EMSA_ASSIGN_OR_RETURN(record.peak_device_bytes, root.UInt("peak_device_bytes"));
  EMSA_ASSIGN_OR_RETURN(record.activation_peak_bytes, root.UInt("activation_peak_bytes"));
  EMSA_RETURN_IF_ERROR(lists.Finish(root));
  EMSA_RETURN_IF_ERROR(ReadProfile(doc, &record));
  return record;
}

// An inconsistent file is a file that is not what it claims to be: kParseError.
Status CheckRead(const ProbeRecord& record) {
  Status valid = ValidateProbeRecord(record);
  return valid.ok() ? valid : Status::ParseError(valid.message());
}

}  // namespace

Result<ProbeRecord> ProbeRecordFromJson(std::string_view text) {
  EMSA_ASSIGN_OR_RETURN(ProbeRecord record, ReadRecord(text));
  EMSA_RETURN_IF_ERROR(CheckRead(record));
  return record;
}

Result<ProbeRecord> LoadProbeRecord(const std::string& path) {
  EMSA_ASSIGN_OR_RETURN(std::string text, json::ReadFile(path));
  Result<ProbeRecord> record = ReadRecord(text);
  std::string().swap(text);  // the text is not needed past the parse: not held while checking
  const Status s = record.ok() ? CheckRead(*record) : record.status();
  if (!s.ok()) return s.Annotate(path);
  return record;
}

Status SaveProbeRecord(const ProbeRecord& record, const std::string& path) {
  // Never write a file that would not load back.
  EMSA_RETURN_IF_ERROR(ValidateProbeRecord(record));
  return json::WriteFile(path, ProbeRecordToJson(record));
}

}  // namespace emsa
