// Tests for ProbeRecord validation and its JSON form: round trips, required and optional keys,
// and malformed input (truncated, mistyped, inconsistent) that must fail cleanly.
#include "emsa/probe_record.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "common/json.h"

namespace emsa {
namespace {

ParamRecord Param(std::string name, std::string module, std::vector<int64_t> shape, DType dtype) {
  ParamRecord p;
  p.name = std::move(name);
  p.module = std::move(module);
  p.numel = 1;
  for (int64_t d : shape) p.numel *= d;
  p.shape = std::move(shape);
  p.dtype = dtype;
  p.bytes = static_cast<uint64_t>(p.numel) * DTypeSize(dtype);
  return p;
}

// Every feature at once: a tied tensor, two dtypes, a frozen zero-size tensor, memory samples,
// a graph and a profile with a GPU.
ProbeRecord SampleRecord() {
  ProbeRecord r;
  r.model = "TinyModel \"quoted\"";
  r.device = "cuda:0";
  r.forward_time = 0.012;
  r.backward_time = 0.025;
  r.period_under_load = 0.061;
  r.peak_device_bytes = 1 << 20;
  r.activation_peak_bytes = 1 << 19;

  ParamRecord embed = Param("embed.weight", "embed", {10, 4}, DType::kFloat32);
  embed.tied_names = {"head.weight"};
  embed.use_count = 2;
  embed.forward_order = 0;
  embed.grad_ready_order = 2;
  embed.grad_ready_time = 0.037;
  ParamRecord weight = Param("fc.weight", "fc", {4, 4}, DType::kBFloat16);
  weight.forward_order = 1;
  weight.forward_time = 0.004;
  weight.grad_ready_order = 0;
  weight.grad_ready_time = 0.02;
  ParamRecord bias = Param("fc.bias", "fc", {4}, DType::kBFloat16);
  bias.forward_order = 2;
  bias.forward_time = 0.004;
  bias.grad_ready_order = 1;
  bias.grad_ready_time = 0.0201;
  ParamRecord frozen = Param("buf.scale", "buf", {0, 3}, DType::kFloat16);
  frozen.trainable = false;
  frozen.use_count = 0;
  r.params = {embed, weight, bias, frozen};

  r.memory = {{"embed", "forward_pre", 0.0, 1000}, {"fc", "backward_post", 0.03, 5000}};
  r.graph = {{"embedding", {"embed.weight"}, {}},
             {"linear", {"fc.weight", "fc.bias"}, {0}},
             {"head", {"head.weight"}, {0, 1}}};

  r.has_profile = true;
  r.profile.cpu.model = "Test CPU";
  r.profile.cpu.logical_cores = 16;
  r.profile.cpu.simd = SimdLevel::kAvx512;
  r.profile.cpu.host_mem_bandwidth = 1.04e11;
  r.profile.cpu.host_update_bandwidth = 9.5e10;
  GpuProfile& g = r.profile.gpu;
  g.present = true;
  g.name = "Test GPU";
  g.compute_capability_major = 9;
  g.sm_count = 132;
  g.total_memory = 150000000000ull;
  g.free_memory = 140000000000ull;
  g.l2_bytes = 62914560;
  g.max_persisting_l2_bytes = 39321600;
  g.hbm_bandwidth = 4.16e12;
  g.h2d_bandwidth = 5.5e10;
  g.d2h_bandwidth = 5.5e10;
  return r;
}

void ExpectParamsEqual(const ParamRecord& a, const ParamRecord& b) {
  SCOPED_TRACE(a.name);
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.module, b.module);
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.numel, b.numel);
  EXPECT_EQ(a.bytes, b.bytes);
  EXPECT_EQ(a.trainable, b.trainable);
  EXPECT_EQ(a.tied_names, b.tied_names);
  EXPECT_EQ(a.use_count, b.use_count);
  EXPECT_EQ(a.forward_order, b.forward_order);
  EXPECT_EQ(a.forward_time, b.forward_time);
  EXPECT_EQ(a.grad_ready_order, b.grad_ready_order);
  EXPECT_EQ(a.grad_ready_time, b.grad_ready_time);
}

void ExpectRecordsEqual(const ProbeRecord& a, const ProbeRecord& b) {
  EXPECT_EQ(a.model, b.model);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(a.forward_time, b.forward_time);
  EXPECT_EQ(a.backward_time, b.backward_time);
  EXPECT_EQ(a.period_under_load, b.period_under_load);
  EXPECT_EQ(a.peak_device_bytes, b.peak_device_bytes);
  EXPECT_EQ(a.activation_peak_bytes, b.activation_peak_bytes);
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) ExpectParamsEqual(a.params[i], b.params[i]);
  ASSERT_EQ(a.memory.size(), b.memory.size());
  for (size_t i = 0; i < a.memory.size(); ++i) {
    EXPECT_EQ(a.memory[i].module, b.memory[i].module);
    EXPECT_EQ(a.memory[i].event, b.memory[i].event);
    EXPECT_EQ(a.memory[i].time, b.memory[i].time);
    EXPECT_EQ(a.memory[i].device_bytes, b.memory[i].device_bytes);
  }
  ASSERT_EQ(a.graph.size(), b.graph.size());
  for (size_t i = 0; i < a.graph.size(); ++i) {
    EXPECT_EQ(a.graph[i].name, b.graph[i].name);
    EXPECT_EQ(a.graph[i].params, b.graph[i].params);
    EXPECT_EQ(a.graph[i].inputs, b.graph[i].inputs);
  }
  ASSERT_EQ(a.has_profile, b.has_profile);
  if (a.has_profile) EXPECT_EQ(DeviceProfileToJson(a.profile), DeviceProfileToJson(b.profile));
}

// ---- JSON editing helpers
// ------------------------------------------------------------------------

json::Value ParseOrDie(const std::string& text) {
  Result<json::Value> v = json::Parse(text);
  EXPECT_TRUE(v.ok()) << v.status().ToString();
  return v.ok() ? std::move(v).value() : json::Value();
}

json::Value& Field(json::Value& obj, const std::string& key) {
  for (auto& [k, v] : obj.as_object()) {
    if (k == key) return v;
  }
  ADD_FAILURE() << "no key " << key;
  static json::Value none;
  return none;
}

void Erase(json::Value& obj, const std::string& key) {
  auto& o = obj.as_object();
  for (auto it = o.begin(); it != o.end(); ++it) {
    if (it->first == key) {
      o.erase(it);
      return;
    }
  }
  ADD_FAILURE() << "no key " << key;
}

// Parses the sample record's JSON, applies `edit`, and reads the result back.
Result<ProbeRecord> ReadEdited(const std::function<void(json::Value&)>& edit) {
  json::Value doc = ParseOrDie(ProbeRecordToJson(SampleRecord()));
  edit(doc);
  return ProbeRecordFromJson(json::Write(doc));
}

json::Value& Param0(json::Value& doc) { return Field(doc, "params").as_array()[0]; }

::testing::AssertionResult FailsWith(const Result<ProbeRecord>& r, StatusCode code,
                                     const std::string& fragment) {
  if (r.ok()) return ::testing::AssertionFailure() << "expected an error, got OK";
  if (r.status().code() != code || r.status().message().find(fragment) == std::string::npos) {
    return ::testing::AssertionFailure() << "expected " << StatusCodeName(code) << " containing '"
                                         << fragment << "', got " << r.status().ToString();
  }
  return ::testing::AssertionSuccess();
}

std::string TempPath(const std::string& name) { return ::testing::TempDir() + "/" + name; }

// ---- round trips
// ---------------------------------------------------------------------------------

TEST(ProbeRecordJson, RoundTripIsExactAndByteStable) {
  const ProbeRecord original = SampleRecord();
  ASSERT_TRUE(ValidateProbeRecord(original).ok()) << ValidateProbeRecord(original).ToString();
  const std::string text = ProbeRecordToJson(original);
  Result<ProbeRecord> back = ProbeRecordFromJson(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectRecordsEqual(original, *back);
  EXPECT_EQ(ProbeRecordToJson(*back), text);
}

TEST(ProbeRecordJson, HeaderAndProfilePresence) {
  ProbeRecord r = SampleRecord();
  json::Value doc = ParseOrDie(ProbeRecordToJson(r));
  EXPECT_EQ(Field(doc, "format").as_string(), "emsa.probe");
  EXPECT_EQ(Field(doc, "version").as_int(), 1);
  EXPECT_TRUE(Field(doc, "profile").is_object());

  r.has_profile = false;
  const std::string text = ProbeRecordToJson(r);
  EXPECT_EQ(ParseOrDie(text).Find("profile"), nullptr);
  Result<ProbeRecord> back = ProbeRecordFromJson(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_FALSE(back->has_profile);
  EXPECT_EQ(ProbeRecordToJson(*back), text);
}

TEST(ProbeRecordJson, EmptyRecordRoundTrips) {
  const std::string text = ProbeRecordToJson(ProbeRecord{});
  Result<ProbeRecord> back = ProbeRecordFromJson(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->params.empty());
  EXPECT_EQ(ProbeRecordToJson(*back), text);
}

TEST(ProbeRecordJson, FileRoundTripIsByteIdentical) {
  const std::string path = TempPath("probe_record_roundtrip.json");
  ASSERT_TRUE(SaveProbeRecord(SampleRecord(), path).ok());
  Result<std::string> first = json::ReadFile(path);
  ASSERT_TRUE(first.ok());
  Result<ProbeRecord> loaded = LoadProbeRecord(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ExpectRecordsEqual(SampleRecord(), *loaded);
  ASSERT_TRUE(SaveProbeRecord(*loaded, path).ok());
  Result<std::string> second = json::ReadFile(path);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*first, *second);
  std::remove(path.c_str());
}

TEST(ProbeRecordJson, UnknownKeysAreIgnored) {
  Result<ProbeRecord> r = ReadEdited([](json::Value& doc) {
    doc.Set("written_by", "emsa 9.0");
    Param0(doc).Set("fx_centrality", 0.5);
    Field(doc, "memory").as_array()[0].Set("reserved_bytes", 7);
    Field(doc, "graph").as_array()[0].Set("op", json::Value::MakeObject());
  });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectRecordsEqual(SampleRecord(), *r);
}

TEST(ProbeRecordJson, OptionalKeysTakeDefaults) {
  Result<ProbeRecord> r = ReadEdited([](json::Value& doc) {
    for (const char* key : {"model", "device", "period_under_load", "memory", "graph", "profile"}) {
      Erase(doc, key);
    }
    json::Value& p = Field(doc, "params").as_array()[1];  // fc.weight
    for (const char* key : {"trainable", "tied_names", "use_count", "forward_order", "forward_time",
                            "grad_ready_order", "grad_ready_time"}) {
      Erase(p, key);
    }
  });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model, "");
  EXPECT_EQ(r->period_under_load, 0.0);
  EXPECT_TRUE(r->memory.empty());
  EXPECT_TRUE(r->graph.empty());
  EXPECT_FALSE(r->has_profile);
  const ParamRecord& p = r->params[1];
  EXPECT_TRUE(p.trainable);
  EXPECT_TRUE(p.tied_names.empty());
  EXPECT_EQ(p.use_count, 1);
  EXPECT_EQ(p.forward_order, -1);
  EXPECT_EQ(p.grad_ready_order, -1);
  EXPECT_EQ(p.forward_time, 0.0);
  EXPECT_EQ(p.grad_ready_time, 0.0);
}

// ---- required keys, versions, dtypes
// -------------------------------------------------------------

TEST(ProbeRecordJson, RequiredKeysAreNamedWhenMissing) {
  for (const char* key : {"format", "version", "forward_time", "backward_time", "peak_device_bytes",
                          "activation_peak_bytes", "params"}) {
    SCOPED_TRACE(key);
    EXPECT_TRUE(FailsWith(ReadEdited([&](json::Value& doc) { Erase(doc, key); }),
                          StatusCode::kParseError,
                          std::string(key) + ": required field is missing"));
  }
  for (const char* key : {"name", "module", "shape", "dtype", "numel", "bytes"}) {
    SCOPED_TRACE(key);
    EXPECT_TRUE(FailsWith(ReadEdited([&](json::Value& doc) { Erase(Param0(doc), key); }),
                          StatusCode::kParseError, std::string("params[0].") + key));
  }
}

TEST(ProbeRecordJson, WrongFormatOrVersionIsRefused) {
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) { d.Set("format", "emsa.plan"); }),
                        StatusCode::kParseError, "format"));
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) { d.Set("version", 2); }),
                        StatusCode::kParseError, "version 2 is not supported"));
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) { d.Set("version", 0); }),
                        StatusCode::kParseError, "version"));
  EXPECT_TRUE(FailsWith(ProbeRecordFromJson("[1, 2]"), StatusCode::kParseError, "object"));
  EXPECT_TRUE(FailsWith(ProbeRecordFromJson(""), StatusCode::kParseError, "line 1"));
}

TEST(ProbeRecordJson, UnsupportedDtypeNamesTheParameter) {
  for (const char* dtype : {"float64", "complex64", "int8"}) {
    SCOPED_TRACE(dtype);
    Result<ProbeRecord> r = ReadEdited(
        [&](json::Value& doc) { Field(doc, "params").as_array()[1].Set("dtype", dtype); });
    EXPECT_TRUE(FailsWith(r, StatusCode::kUnsupported, "params[1].dtype"));
    EXPECT_TRUE(FailsWith(r, StatusCode::kUnsupported, "fc.weight"));
    EXPECT_TRUE(FailsWith(r, StatusCode::kUnsupported, dtype));
  }
}

TEST(ProbeRecordJson, TorchDtypeSpellingsAreAccepted) {
  Result<ProbeRecord> r = ReadEdited(
      [](json::Value& doc) { Field(doc, "params").as_array()[1].Set("dtype", "torch.bfloat16"); });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->params[1].dtype, DType::kBFloat16);
}

// ---- shapes, sizes, names
// ------------------------------------------------------------------------

TEST(ProbeRecordJson, ShapeEntriesMustBeIntegers) {
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) {
                          Field(Param0(d), "shape").as_array()[1] = json::Value(1.5);
                        }),
                        StatusCode::kParseError, "params[0].shape[1]: expected an integer"));
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) {
                          Field(Param0(d), "shape").as_array()[1] = json::Value("4");
                        }),
                        StatusCode::kParseError, "params[0].shape[1]: expected an integer"));
}

TEST(ProbeRecordJson, ZeroSizeTensorsAreAllowed) {
  Result<ProbeRecord> r = ProbeRecordFromJson(ProbeRecordToJson(SampleRecord()));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->params[3].numel, 0);
  EXPECT_EQ(r->params[3].bytes, 0u);
  EXPECT_EQ(r->params[3].shape, (std::vector<int64_t>{0, 3}));
}

TEST(ProbeRecordJson, InconsistentSizesAreRefused) {
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) {
                          Field(Param0(d), "shape").as_array()[0] = json::Value(-10);
                        }),
                        StatusCode::kParseError, "params[0] ('embed.weight').shape[0]: -10"));
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) { Param0(d).Set("numel", -40); }),
                        StatusCode::kParseError, "numel: -40 is negative"));
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) { Param0(d).Set("numel", 41); }),
                        StatusCode::kParseError, "numel: 41 does not equal the product"));
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) { Param0(d).Set("bytes", 40); }),
                        StatusCode::kParseError, "params[0] ('embed.weight').bytes"));
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) { Param0(d).Set("bytes", -160); }),
                        StatusCode::kParseError, "params[0].bytes"));
  // A shape whose element count overflows int64 is an error, not undefined behaviour.
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) {
                          json::Value shape = json::Value::MakeArray();
                          for (int i = 0; i < 3; ++i) shape.Push(int64_t{1} << 40);
                          Param0(d).Set("shape", shape);
                        }),
                        StatusCode::kParseError, "overflows"));
}

TEST(ProbeRecordJson, DuplicateNamesAreRefused) {
  EXPECT_TRUE(FailsWith(
      ReadEdited([](json::Value& d) { Field(d, "params").as_array()[2].Set("name", "fc.weight"); }),
      StatusCode::kParseError, "'fc.weight' is already used by params[1]"));
  // A tied alias that is also listed as a parameter of its own.
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) {
                          json::Value names = json::Value::MakeArray();
                          names.Push("head.weight");
                          names.Push("fc.bias");
                          Param0(d).Set("tied_names", names);
                        }),
                        StatusCode::kParseError, "'fc.bias' is already used"));
  // An alias that repeats the tensor's own name.
  EXPECT_TRUE(FailsWith(ReadEdited([](json::Value& d) {
                          json::Value names = json::Value::MakeArray();
                          names.Push("embed.weight");
                          Param0(d).Set("tied_names", names);
                        }),
                        StatusCode::kParseError, "tied_names[0]"));
}

// ---- malformed input must fail cleanly
// -----------------------------------------------------------

TEST(ProbeRecordJson, EveryTruncationFails) {
  const std::string text = ProbeRecordToJson(SampleRecord());
  const size_t last_brace = text.rfind('}');
  ASSERT_NE(last_brace, std::string::npos);
  int tried = 0;
  for (size_t n = 0; n <= last_brace; n += 7) {
    Result<ProbeRecord> r = ProbeRecordFromJson(text.substr(0, n));
    EXPECT_FALSE(r.ok()) << "prefix of " << n << " bytes parsed";
    if (!r.ok()) EXPECT_EQ(r.status().code(), StatusCode::kParseError);
    ++tried;
  }
  EXPECT_GT(tried, 100);
}

using PathStep = std::pair<std::string, size_t>;  // key, or "" and an index

json::Value* Walk(json::Value& root, const std::vector<PathStep>& path) {
  json::Value* v = &root;
  for (const auto& [key, index] : path) v = key.empty() ? &v->as_array()[index] : &Field(*v, key);
  return v;
}

void CollectPaths(const json::Value& v, std::vector<PathStep>* prefix,
                  std::vector<std::vector<PathStep>>* out) {
  out->push_back(*prefix);
  if (v.is_object()) {
    for (const auto& [k, child] : v.as_object()) {
      prefix->push_back({k, 0});
      CollectPaths(child, prefix, out);
      prefix->pop_back();
    }
  } else if (v.is_array()) {
    for (size_t i = 0; i < v.as_array().size(); ++i) {
      prefix->push_back({"", i});
      CollectPaths(v.as_array()[i], prefix, out);
      prefix->pop_back();
    }
  }
}

std::string PathText(const std::vector<PathStep>& path) {
  std::string s;
  for (const auto& [key, index] : path) {
    s += key.empty() ? "[" + std::to_string(index) + "]" : (s.empty() ? "" : ".") + key;
  }
  return s;
}

// Keys that may be absent, hence null: nulling them must not crash, but may succeed.
bool MayBeNull(const std::vector<PathStep>& path) {
  static const std::set<std::string> top = {"model",  "device", "period_under_load",
                                            "memory", "graph",  "profile"};
  static const std::set<std::string> param = {"trainable",      "tied_names",   "use_count",
                                              "forward_order",  "forward_time", "grad_ready_order",
                                              "grad_ready_time"};
  static const std::set<std::string> op = {"params", "inputs"};
  if (path.size() == 1) return top.count(path[0].first) > 0;
  if (path.size() == 3 && path[0].first == "params") return param.count(path[2].first) > 0;
  if (path.size() == 3 && path[0].first == "graph") return op.count(path[2].first) > 0;
  // Absent from profiles written before it was measured.
  if (path.size() == 3 && path[0].first == "profile" && path[1].first == "gpu") {
    return path[2].first == "duplex_bandwidth" || path[2].first == "host_update_duplex_bandwidth" ||
           path[2].first == "duplex_under_update_bandwidth";
  }
  return false;
}

TEST(ProbeRecordJson, EveryTypeFlipFails) {
  const json::Value original = ParseOrDie(ProbeRecordToJson(SampleRecord()));
  std::vector<std::vector<PathStep>> paths;
  std::vector<PathStep> prefix;
  CollectPaths(original, &prefix, &paths);
  ASSERT_GT(paths.size(), 100u);

  const std::vector<json::Value> replacements = {json::Value(true), json::Value(int64_t{7}),
                                                 json::Value("x"), json::Value::MakeArray(),
                                                 json::Value::MakeObject()};
  int flips = 0;
  for (const auto& path : paths) {
    for (const json::Value& replacement : replacements) {
      json::Value doc = original;
      json::Value* target = Walk(doc, path);
      if (target->kind() == replacement.kind()) continue;
      *target = replacement;
      Result<ProbeRecord> r = ProbeRecordFromJson(json::Write(doc));
      EXPECT_FALSE(r.ok()) << PathText(path) << " replaced by " << json::Write(replacement, -1)
                           << " was accepted";
      ++flips;
    }
    json::Value doc = original;
    *Walk(doc, path) = json::Value();
    Result<ProbeRecord> r = ProbeRecordFromJson(json::Write(doc));
    if (!MayBeNull(path)) EXPECT_FALSE(r.ok()) << PathText(path) << " = null was accepted";
  }
  EXPECT_GT(flips, 400);
}

// ---- validation of records built in memory
// -------------------------------------------------------

TEST(ValidateProbeRecord, NamesTheBrokenField) {
  struct Case {
    const char* what;
    std::function<void(ProbeRecord&)> edit;
    const char* fragment;
  };
  const std::vector<Case> cases = {
      {"negative time", [](ProbeRecord& r) { r.params[1].forward_time = -1.0; },
       "params[1] ('fc.weight').forward_time"},
      {"nan time", [](ProbeRecord& r) { r.params[2].grad_ready_time = std::nan(""); },
       "params[2] ('fc.bias').grad_ready_time"},
      {"infinite duration", [](ProbeRecord& r) { r.backward_time = HUGE_VAL; }, "backward_time"},
      {"negative loaded period", [](ProbeRecord& r) { r.period_under_load = -0.5; },
       "period_under_load"},
      {"duplicate forward rank", [](ProbeRecord& r) { r.params[2].forward_order = 1; },
       "forward_order: rank 1 is also held by params[1]"},
      {"duplicate grad rank", [](ProbeRecord& r) { r.params[0].grad_ready_order = 0; },
       "grad_ready_order: rank 0"},
      {"bad rank", [](ProbeRecord& r) { r.params[0].forward_order = -2; }, "forward_order: -2"},
      {"frozen with gradient", [](ProbeRecord& r) { r.params[3].grad_ready_order = 5; },
       "params[3] ('buf.scale').grad_ready_order"},
      {"negative use count", [](ProbeRecord& r) { r.params[1].use_count = -1; }, "use_count"},
      {"empty name", [](ProbeRecord& r) { r.params[1].name = ""; }, "params[1] ('').name"},
      {"empty alias", [](ProbeRecord& r) { r.params[0].tied_names = {""}; }, "tied_names[0]"},
      {"bad dtype", [](ProbeRecord& r) { r.params[1].dtype = static_cast<DType>(9); },
       "params[1] ('fc.weight').dtype"},
      {"graph ref", [](ProbeRecord& r) { r.graph[1].params = {"fc.gone"}; },
       "graph[1].params[0]: 'fc.gone'"},
      {"graph forward input", [](ProbeRecord& r) { r.graph[1].inputs = {1}; },
       "graph[1].inputs[0]"},
      {"graph negative input", [](ProbeRecord& r) { r.graph[2].inputs = {-1}; },
       "graph[2].inputs[0]"},
      {"sample above peak", [](ProbeRecord& r) { r.memory[1].device_bytes = 2 << 20; },
       "memory[1].device_bytes"},
      {"sample time", [](ProbeRecord& r) { r.memory[0].time = -0.5; }, "memory[0].time"},
      {"empty event", [](ProbeRecord& r) { r.memory[0].event = ""; }, "memory[0].event"},
      {"activation above peak", [](ProbeRecord& r) { r.activation_peak_bytes = 2 << 20; },
       "activation_peak_bytes"},
  };
  ASSERT_TRUE(ValidateProbeRecord(SampleRecord()).ok());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ProbeRecord r = SampleRecord();
    c.edit(r);
    Status s = ValidateProbeRecord(r);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(c.fragment), std::string::npos) << s.ToString();
  }
}

// ---- files
// ---------------------------------------------------------------------------------------

TEST(ProbeRecordFile, MissingFileIsIoErrorNamingThePath) {
  const std::string path = TempPath("no_such_probe_record.json");
  Result<ProbeRecord> r = LoadProbeRecord(path);
  EXPECT_TRUE(FailsWith(r, StatusCode::kIoError, path));
}

TEST(ProbeRecordFile, UnwritablePathIsIoErrorNamingThePath) {
  const std::string path = TempPath("no_such_dir/probe.json");
  Status s = SaveProbeRecord(SampleRecord(), path);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find(path), std::string::npos) << s.ToString();
}

TEST(ProbeRecordFile, InvalidRecordWritesNothing) {
  const std::string path = TempPath("invalid_probe_record.json");
  std::remove(path.c_str());
  ProbeRecord r = SampleRecord();
  r.params[0].numel = 3;
  EXPECT_EQ(SaveProbeRecord(r, path).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(json::ReadFile(path).status().code(), StatusCode::kIoError);
}

TEST(ProbeRecordFile, ParseErrorsArePrefixedWithThePath) {
  const std::string path = TempPath("corrupt_probe_record.json");
  ASSERT_TRUE(json::WriteFile(path, "{\"format\": \"emsa.probe\", \"version\": 1,").ok());
  Result<ProbeRecord> r = LoadProbeRecord(path);
  EXPECT_TRUE(FailsWith(r, StatusCode::kParseError, path + ": line 1"));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace emsa
