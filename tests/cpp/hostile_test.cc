// Hostile input at the library level: limits named in errors, the JSON reader linear and bounded,
// files replaced atomically, and the in-backward memory model equal to its direct definition.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"
#include "emsa/analytic_probe.h"
#include "emsa/plan.h"
#include "emsa/probe_record.h"
#include "emsa/profile.h"

namespace emsa {
namespace {

bool Says(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

ProbeRecord Small(int64_t layers = 2) {
  DecoderConfig c;
  c.vocab_size = 64;
  c.hidden_size = 16;
  c.intermediate_size = 32;
  c.num_layers = layers;
  c.num_heads = 2;
  c.num_kv_heads = 2;
  c.seq_len = 8;
  Result<ProbeRecord> r = AnalyticDecoderProbe(c);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : ProbeRecord{};
}

// ---- limits
// --------------------------------------------------------------------------------------

TEST(HostileRecord, ByteSumsThatWouldWrapAreRefusedNamingTheLimit) {
  ProbeRecord r = Small();
  r.params.resize(4);
  for (ParamRecord& p : r.params) {
    p.shape = {int64_t{1} << 60};
    p.numel = int64_t{1} << 60;
    p.dtype = DType::kFloat32;
    p.bytes = uint64_t{1} << 62;
    p.tied_names.clear();
  }
  r.memory.clear();
  const Status s = ValidateProbeRecord(r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Says(s, "params[0]")) << s.ToString();
  EXPECT_TRUE(Says(s, "exceeds the limit 1125899906842624")) << s.ToString();

  // Each below the limit, together above it.
  for (ParamRecord& p : r.params) {
    p.shape = {int64_t{1} << 47};
    p.numel = int64_t{1} << 47;
    p.bytes = uint64_t{1} << 49;
  }
  const Status sum = ValidateProbeRecord(r);
  EXPECT_TRUE(Says(sum, "params[2]")) << sum.ToString();
  EXPECT_TRUE(Says(sum, "bytes up to here")) << sum.ToString();
  EXPECT_FALSE(MakePlan(r, DeviceProfile{}, PlanOptions{}).ok());
}

TEST(HostileRecord, CountsAboveTheLimitsAreRefusedBeforeAnyWork) {
  ProbeRecord r = Small();
  r.memory.resize(ProbeRecord::kMaxMemorySamples + 1, r.memory.front());
  const Status s = ValidateProbeRecord(r);
  EXPECT_TRUE(Says(s, "memory: 1048577 entries exceed the limit 1048576")) << s.ToString();
  ProbeRecord g = Small();
  g.graph.resize(ProbeRecord::kMaxGraphOps + 1);
  EXPECT_TRUE(Says(ValidateProbeRecord(g), "graph: ")) << ValidateProbeRecord(g).ToString();
  ProbeRecord peak = Small();
  peak.peak_device_bytes = ~uint64_t{0};
  EXPECT_TRUE(Says(ValidateProbeRecord(peak), "peak_device_bytes")) << "no limit on the peak";
}

TEST(HostileOptions, HugeBucketsAndAlignmentsAreRefused) {
  const ProbeRecord r = Small();
  PlanOptions o;
  o.bucket_bytes = ~uint64_t{0};
  EXPECT_TRUE(Says(MakePlan(r, DeviceProfile{}, o).status(), "bucket_bytes"));
  o = PlanOptions{};
  o.device_module_alignment = uint64_t{1} << 63;
  EXPECT_TRUE(Says(MakePlan(r, DeviceProfile{}, o).status(), "device_module_alignment"));
}

// ---- JSON
// ----------------------------------------------------------------------------------------

TEST(HostileJson, ManyKeysParseAndADuplicateIsFoundWhereItIs) {
  std::string text = "{";
  for (int i = 0; i < 120000; ++i) text += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":1";
  text += "}";
  Result<json::Value> v = json::Parse(text);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->as_object().size(), 120000u);
  text.insert(text.size() - 1, ",\"k5\":2");
  const Status dup = json::Parse(text).status();
  EXPECT_TRUE(Says(dup, "duplicate key \"k5\"")) << dup.ToString();
  EXPECT_TRUE(Says(dup, "column " + std::to_string(text.size() - 6))) << dup.ToString();
}

TEST(HostileJson, MoreValuesThanTheLimitAreRefused) {
  std::string text = "[";
  for (size_t i = 0; i <= json::kMaxValues; ++i) text += i ? ",0" : "0";
  text += "]";
  EXPECT_TRUE(Says(json::Parse(text).status(), "values in one document"));
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_TRUE(Says(json::Parse(deep).status(), "nesting deeper than 256"));
}

TEST(HostileJson, AValueIsOneWord) {
  // What keeps a parsed document within a small multiple of its text.
  EXPECT_LE(sizeof(json::Value), 16u);
  json::Value a = json::Value::MakeObject();
  a.Set("s", "text");
  a.Set("n", json::Value::MakeArray()).Push(2.5);
  json::Value b = a;  // deep copy
  b.Set("s", "other");
  EXPECT_EQ(a.Find("s")->as_string(), "text");
  EXPECT_EQ(json::Write(b, -1), "{\"s\":\"other\",\"n\":[2.5]}");
  json::Value moved = std::move(b);
  EXPECT_TRUE(b.is_null());  // NOLINT: a moved-from value is null
  EXPECT_EQ(moved.Find("n")->as_array().size(), 1u);
}

// A record is read one list element at a time (json::ElementSink); the errors are still the
// ones a read of the whole document meets first: syntax anywhere, then the root's fields, then
// params, memory and graph in that order.
TEST(HostileRecord, ReadElementByElementTheFirstErrorIsStillTheWholeReadsFirst) {
  const std::string good = ProbeRecordToJson(Small());
  ASSERT_TRUE(ProbeRecordFromJson(good).ok());
  Result<json::Value> doc = json::Parse(good);
  ASSERT_TRUE(doc.ok());
  auto edited = [&](auto edit) {
    json::Value d = *doc;
    edit(d);
    return ProbeRecordFromJson(json::Write(d)).status();
  };
  auto params = [](json::Value& d) -> json::Value::Array& {
    return d.as_object()[9].second.as_array();  // "params", as ProbeRecordToJson orders keys
  };
  auto bad_shape = [&](json::Value& d) { params(d)[1].Set("shape", json::Value("x")); };
  auto bad_sample = [](json::Value& d) {
    d.as_object()[10].second.as_array()[0].Set("time", json::Value("no"));
  };
  EXPECT_TRUE(Says(edited(bad_shape), "params[1].shape: expected an array"));
  EXPECT_TRUE(Says(edited([&](json::Value& d) {
                     bad_shape(d);
                     d.Set("forward_time", json::Value("x"));
                   }),
                   "forward_time: expected a finite number"));
  EXPECT_TRUE(Says(edited([&](json::Value& d) {
                     bad_sample(d);
                     bad_shape(d);
                   }),
                   "params[1].shape"));
  EXPECT_TRUE(Says(edited(bad_sample), "memory[0].time"));
  EXPECT_TRUE(Says(edited([](json::Value& d) { d.Set("params", json::Value(5)); }),
                   "params: expected an array, got an integer"));
  EXPECT_TRUE(Says(edited([](json::Value& d) { d.Set("params", json::Value()); }),
                   "params: required field is missing"));
  EXPECT_TRUE(Says(edited([&](json::Value& d) {
                     bad_shape(d);
                     d.Set("format", json::Value("emsa.plan"));
                   }),
                   "this is not a probe record"));
  json::Value broken = *doc;
  bad_shape(broken);
  std::string text = json::Write(broken);
  text.insert(text.rfind('}'), ",");
  EXPECT_TRUE(Says(ProbeRecordFromJson(text).status(), "expected a quoted key"));
  text = good;
  text.insert(text.rfind('}'), ",\"params\": []");
  EXPECT_TRUE(Says(ProbeRecordFromJson(text).status(), "duplicate key \"params\""));
}

TEST(HostileFiles, StreamsAndLargeFilesAreRefusedBeforeTheyAreHeld) {
  const Result<std::string> zero = json::ReadFile("/dev/zero", 1 << 20);
  EXPECT_EQ(zero.status().code(), StatusCode::kIoError);
  EXPECT_TRUE(Says(zero.status(), "larger than 1.00 MiB")) << zero.status().ToString();
}

TEST(HostileFiles, WriteFileReplacesAtomicallyAndLeavesNoTemporary) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("emsa_hostile_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "plan.json").string();
  ASSERT_TRUE(json::WriteFile(path, "old").ok());
  ASSERT_TRUE(json::WriteFile(path, "new text").ok());
  EXPECT_EQ(json::ReadFile(path).value(), "new text");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator{}),
            1);
  // Text made in pieces is written in order, and replaces the file the same way.
  const json::Producer pieces = [](const std::function<void(std::string_view)>& emit) {
    for (const char* piece : {"one ", "two ", "three"}) emit(piece);
  };
  ASSERT_TRUE(json::WriteFile(path, pieces).ok());
  EXPECT_EQ(json::ReadFile(path).value(), "one two three");
  EXPECT_TRUE(json::WriteFile("/dev/null", "in place").ok());  // a device is written, not replaced
  EXPECT_FALSE(json::WriteFile((dir / "no" / "such.json").string(), "x").ok());
  std::filesystem::remove_all(dir);
}

// ---- the in-backward memory model
// ------------------------------------------------------------------------

// The base of plan.h's release_grads model written directly: per sample, what it held less the
// gradients final by its time; the peak placed at the largest sample.
uint64_t DirectReleasedBase(const ProbeRecord& r, const PlanOptions& o) {
  uint64_t weights = 0, grads = 0;
  for (const ParamRecord& p : r.params) {
    weights += p.bytes;
    if (p.trainable) grads += p.bytes;
  }
  auto released_by = [&](double t) {
    uint64_t sum = 0;
    for (const ParamRecord& p : r.params) {
      if (p.trainable && p.grad_ready_order >= 0 && p.grad_ready_time <= t) sum += p.bytes;
    }
    return sum;
  };
  uint64_t held = 0, largest = 0;
  double peak_time = -1.0;
  for (const MemorySample& m : r.memory) {
    const uint64_t rel = released_by(m.time);
    held = std::max(held, m.device_bytes > rel ? m.device_bytes - rel : 0);
    if (m.device_bytes > largest) {
      largest = m.device_bytes;
      peak_time = m.time;
    }
  }
  const uint64_t at_peak = peak_time >= 0.0 ? released_by(peak_time) : grads;
  held = std::max(held, r.peak_device_bytes > at_peak ? r.peak_device_bytes - at_peak : 0);
  return std::max(held, weights) + std::min(grads, 2 * o.bucket_bytes);
}

TEST(HostileInBackward, TheSortedSumsEqualTheDirectModel) {
  std::mt19937_64 rng(20);
  for (int trial = 0; trial < 40; ++trial) {
    ProbeRecord r = Small(1 + trial % 5);
    const double end = r.forward_time + r.backward_time;
    std::uniform_real_distribution<double> when(0.0, end);
    for (ParamRecord& p : r.params) {  // ready times with ties, in no particular order
      if (p.grad_ready_order >= 0) p.grad_ready_time = trial % 2 ? when(rng) : end / 2;
    }
    std::uniform_int_distribution<uint64_t> bytes(0, r.peak_device_bytes);
    r.memory.resize(trial % 7 == 0 ? 0 : r.memory.size());
    for (MemorySample& m : r.memory) {
      m.time = trial % 3 ? when(rng) : r.params[rng() % r.params.size()].grad_ready_time;
      m.device_bytes = bytes(rng);
    }
    PlanOptions keep;
    keep.allow_host_tier = false;  // no staging: the arena is the same either way
    keep.bucket_bytes = 1 << 12;
    PlanOptions release = keep;
    release.release_grads = true;
    uint64_t weights = 0, grads = 0;
    for (const ParamRecord& p : r.params) {
      weights += p.bytes;
      grads += p.trainable ? p.bytes : 0;
    }
    uint64_t min_keep = 0, min_release = 0;
    (void)MakePlan(r, DeviceProfile{}, keep, &min_keep);
    (void)MakePlan(r, DeviceProfile{}, release, &min_release);
    const uint64_t arena = min_keep - std::max(r.peak_device_bytes, weights + grads);
    EXPECT_EQ(min_release, arena + DirectReleasedBase(r, release)) << "trial " << trial;
  }
}

}  // namespace
}  // namespace emsa
