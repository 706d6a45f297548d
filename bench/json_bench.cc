// json_bench.cc — src/common/json on the inputs that matter: the records and plans emsa reads and
// writes (a 7 B model's probe record and plan, the largest record the analytic probe makes) and
// the hostile inputs of tests/cpp/hostile_test.cc and json_test.cc, larger. Per input: parse
// time (median of repeats), MB/s, the heap high-water mark during one parse above what was held
// before it, whether it was accepted (or the error), and for accepted documents the time to write
// them back. Not part of the test build.
//
//   cmake -S . -B build -DEMSA_BUILD_BENCH=ON && cmake --build build --target json_bench
//   json_bench [--case NAME] [--min-seconds S] [--out FILE.json]
//
// --case: only the inputs whose name contains NAME. --min-seconds (default 1): each input is
// parsed at least 3 times and until this much time has passed (at most 31 times).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "common/json.h"
#include "emsa/analytic_probe.h"
#include "emsa/model_config.h"
#include "emsa/plan.h"
#include "emsa/probe_record.h"
#include "emsa/profile.h"

// ---- heap accounting: every operator new counted, so a parse's peak is measured, not guessed

namespace {

std::atomic<size_t> g_heap_now{0}, g_heap_peak{0};
constexpr size_t kHeader = 16;  // keeps the caller's block 16-byte aligned

void* Allocate(size_t n) {
  void* p = std::malloc(n + kHeader);
  if (p == nullptr) throw std::bad_alloc();
  *static_cast<size_t*>(p) = n;
  const size_t now = g_heap_now.fetch_add(n) + n;
  size_t peak = g_heap_peak.load();
  while (now > peak && !g_heap_peak.compare_exchange_weak(peak, now)) {
  }
  return static_cast<char*>(p) + kHeader;
}

void Free(void* q) noexcept {
  if (q == nullptr) return;
  void* p = static_cast<char*>(q) - kHeader;
  g_heap_now.fetch_sub(*static_cast<size_t*>(p));
  std::free(p);
}

}  // namespace

void* operator new(size_t n) { return Allocate(n); }
void* operator new[](size_t n) { return Allocate(n); }
void operator delete(void* p) noexcept { Free(p); }
void operator delete[](void* p) noexcept { Free(p); }
void operator delete(void* p, size_t) noexcept { Free(p); }
void operator delete[](void* p, size_t) noexcept { Free(p); }

namespace {

using emsa::Result;
using emsa::json::Value;

#define CHECK_OK(expr)                                                         \
  do {                                                                         \
    const auto& r_ = (expr);                                                   \
    if (!r_.ok()) {                                                            \
      std::fprintf(stderr, "%s: %s\n", #expr, r_.status().ToString().c_str()); \
      std::exit(2);                                                            \
    }                                                                          \
  } while (0)

// ---- the inputs ---------------------------------------------------------------------------------

struct Input {
  std::string name;
  std::string text;
  // What is timed besides json::Parse: the reader of this kind of document, if any.
  std::function<bool(const std::string&)> read;
};

emsa::ProbeRecord Record(const emsa::DecoderConfig& c) {
  Result<emsa::ProbeRecord> r = emsa::AnalyticDecoderProbe(c);
  CHECK_OK(r);
  return std::move(r).value();
}

bool ReadRecord(const std::string& text) { return emsa::ProbeRecordFromJson(text).ok(); }

std::vector<Input> Inputs(const std::string& only) {
  std::vector<Input> in;
  auto want = [&](const char* name) { return only.empty() || std::strstr(name, only.c_str()); };

  Result<std::string> llama = emsa::ModelPresetText("llama-2-7b");
  CHECK_OK(llama);
  Result<emsa::DecoderConfig> c7b = emsa::DecoderConfigFromHfJson(*llama, "llama-2-7b");
  CHECK_OK(c7b);
  const emsa::ProbeRecord r7b = Record(*c7b);
  if (want("record-7b")) in.push_back({"record-7b", emsa::ProbeRecordToJson(r7b), ReadRecord});
  if (want("plan-7b")) {
    Result<std::string> h200 = emsa::DevicePresetText("h200");
    CHECK_OK(h200);
    Result<emsa::DeviceProfile> profile = emsa::DeviceProfileFromJson(*h200);
    CHECK_OK(profile);
    Result<emsa::Plan> plan = emsa::MakePlan(r7b, *profile, emsa::PlanOptions{});
    CHECK_OK(plan);
    in.push_back({"plan-7b", emsa::PlanToJson(*plan), nullptr});
  }
  if (want("record-4096-layers")) {  // the most layers AnalyticDecoderProbe builds
    emsa::DecoderConfig c;
    c.hidden_size = 256;
    c.intermediate_size = 512;
    c.num_heads = 4;
    c.num_kv_heads = 4;
    c.num_layers = emsa::DecoderConfig::kMaxLayers;
    in.push_back({"record-4096-layers", emsa::ProbeRecordToJson(Record(c)), ReadRecord});
  }
  if (want("doubles-1M")) {  // numbers as Write writes them: the shortest text that reads back
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<double> u(-1e6, 1e6);
    Value a = Value::MakeArray();
    for (int i = 0; i < 1000000; ++i) a.Push(u(rng));
    in.push_back({"doubles-1M", emsa::json::Write(a, -1), nullptr});
  }
  if (want("keys-1M")) {  // hostile_test's many keys, ten times more
    std::string t = "{";
    for (int i = 0; i < 1000000; ++i) t += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":1";
    in.push_back({"keys-1M", t + "}", nullptr});
  }
  if (want("keys-1M-duplicate")) {
    std::string t = "{";
    for (int i = 0; i < 1000000; ++i) t += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":1";
    in.push_back({"keys-1M-duplicate", t + ",\"k5\":2}", nullptr});
  }
  if (want("string-64MiB"))
    in.push_back({"string-64MiB", "\"" + std::string(64 << 20, 'a') + "\""});
  if (want("string-64MiB-escapes")) {  // a \n and a \u00e9 in every 66 bytes
    std::string t = "\"";
    for (int i = 0; i < (1 << 20); ++i)
      t += "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUV\\n\\u00e9";
    in.push_back({"string-64MiB-escapes", t + "\""});
  }
  if (want("values-over-limit")) {  // hostile_test's: one value past kMaxValues
    std::string t = "[";
    for (size_t i = 0; i <= emsa::json::kMaxValues; ++i) t += i ? ",0" : "0";
    in.push_back({"values-over-limit", t + "]"});
  }
  if (want("deep-1e6")) {
    in.push_back({"deep-1e6", std::string(1000000, '[') + std::string(1000000, ']')});
  }
  if (want("deep-256")) {  // the deepest nesting accepted
    in.push_back({"deep-256", std::string(257, '[') + std::string(257, ']')});
  }
  if (want("invalid-utf8")) {  // a lone continuation byte at the end of a 1 MiB string
    in.push_back({"invalid-utf8", "[\"" + std::string(1 << 20, 'a') + "\x80\"]"});
  }
  if (want("nul-after-value")) {
    in.push_back({"nul-after-value", std::string("{\"a\": 1}\0{\"b\": 2}", 17)});
  }
  return in;
}

// ---- timing
// --------------------------------------------------------------------------------------

double Seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The median of at least 3 runs, repeated until min_seconds have passed (at most 31).
double Median(const std::function<void()>& f, double min_seconds) {
  std::vector<double> t;
  double total = 0.0;
  while (t.size() < 3 || (total < min_seconds && t.size() < 31)) {
    t.push_back(Seconds(f));
    total += t.back();
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::string Printable(const std::string& s, size_t most) {
  std::string out;
  for (char c : s.substr(0, most)) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) {
      out += c;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    }
  }
  return s.size() > most ? out + "..." : out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string only, out_path;
  double min_seconds = 1.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--case") {
      only = argv[i + 1];
    } else if (k == "--min-seconds") {
      min_seconds = std::atof(argv[i + 1]);
    } else if (k == "--out") {
      out_path = argv[i + 1];
    } else {
      std::fprintf(stderr, "usage: json_bench [--case NAME] [--min-seconds S] [--out FILE]\n");
      return 2;
    }
  }
  Value rows = Value::MakeArray();
  std::printf("%-22s %10s %10s %8s %10s %10s %10s  %s\n", "input", "MB", "parse ms", "MB/s",
              "peak MB", "write ms", "read ms", "result");
  for (Input& in : Inputs(only)) {
    const double mb = static_cast<double>(in.text.size()) / 1e6;
    // One parse for the result and the heap peak above what is held now.
    const size_t before = g_heap_now.load();
    g_heap_peak.store(before);
    Result<Value> doc = emsa::json::Parse(in.text);
    const double peak_mb = static_cast<double>(g_heap_peak.load() - before) / 1e6;
    const double parse_s = Median([&] { (void)emsa::json::Parse(in.text); }, min_seconds);
    double write_s = 0.0, read_s = 0.0;
    if (doc.ok()) {
      write_s = Median([&] { (void)emsa::json::Write(*doc); }, min_seconds);
    }
    if (in.read) read_s = Median([&] { (void)in.read(in.text); }, min_seconds);
    const std::string result = doc.ok() ? "ok" : Printable(doc.status().message(), 90);
    std::printf("%-22s %10.2f %10.3f %8.0f %10.1f %10.3f %10.3f  %s\n", in.name.c_str(), mb,
                parse_s * 1e3, mb / parse_s, peak_mb, write_s * 1e3, read_s * 1e3, result.c_str());
    std::fflush(stdout);
    Value row = Value::MakeObject();
    row.Set("input", in.name);
    row.Set("bytes", static_cast<int64_t>(in.text.size()));
    row.Set("parse_seconds", parse_s);
    row.Set("parse_peak_heap_bytes", static_cast<int64_t>(peak_mb * 1e6));
    if (doc.ok()) row.Set("write_seconds", write_s);
    if (in.read) row.Set("read_seconds", read_s);
    row.Set("result", result);
    rows.Push(std::move(row));
  }
  if (!out_path.empty()) {
    Value doc = Value::MakeObject();
    doc.Set("bench", "json");
    doc.Set("rows", std::move(rows));
    const emsa::Status s = emsa::json::WriteFile(out_path, emsa::json::Write(doc));
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 2;
    }
  }
  return 0;
}
