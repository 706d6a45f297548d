// Tests for include/emsa/profile.h: SIMD detection and its cap, the measured CPU profile, the GPU
// profile (absent here, plausible where present), and the JSON format with its errors.
#include "emsa/profile.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "common/json.h"

namespace emsa {
namespace {

// Sets (or unsets, for nullptr) EMSA_MAX_SIMD for one scope, restoring the old value after.
class ScopedMaxSimd {
 public:
  explicit ScopedMaxSimd(const char* value) {
    const char* old = std::getenv("EMSA_MAX_SIMD");
    had_old_ = old != nullptr;
    if (had_old_) old_ = old;
    if (value == nullptr) {
      unsetenv("EMSA_MAX_SIMD");
    } else {
      setenv("EMSA_MAX_SIMD", value, 1);
    }
  }
  ~ScopedMaxSimd() {
    if (had_old_) {
      setenv("EMSA_MAX_SIMD", old_.c_str(), 1);
    } else {
      unsetenv("EMSA_MAX_SIMD");
    }
  }

 private:
  bool had_old_ = false;
  std::string old_;
};

// The first "flags" line of /proc/cpuinfo; the kernel drops flags whose register state it does
// not manage, so this is an independent view of what the OS lets us use.
std::set<std::string> CpuinfoFlags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string w; words >> w;) flags.insert(w);
    return flags;
  }
  return {};
}

SimdLevel Min(SimdLevel a, SimdLevel b) {
  return static_cast<int>(a) < static_cast<int>(b) ? a : b;
}

TEST(ProfileSimd, MatchesProcCpuinfo) {
  ScopedMaxSimd no_cap(nullptr);
  const std::set<std::string> flags = CpuinfoFlags();
  if (flags.empty()) GTEST_SKIP() << "/proc/cpuinfo has no flags line on this machine";
  auto has = [&](std::initializer_list<const char*> names) {
    for (const char* n : names) {
      if (flags.count(n) == 0) return false;
    }
    return true;
  };
  SimdLevel expected = SimdLevel::kScalar;
  if (has({"avx2", "fma", "f16c"})) {
    expected = has({"avx512f", "avx512bw", "avx512vl", "avx512dq"}) ? SimdLevel::kAvx512
                                                                    : SimdLevel::kAvx2;
  }
  EXPECT_EQ(SimdLevelName(DetectSimdLevel()), std::string(SimdLevelName(expected)));
}

TEST(ProfileSimd, EnvironmentCapsNeverRaises) {
  SimdLevel hardware;
  {
    ScopedMaxSimd no_cap(nullptr);
    hardware = DetectSimdLevel();
  }
  for (SimdLevel cap : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    ScopedMaxSimd env(SimdLevelName(cap));
    EXPECT_EQ(DetectSimdLevel(), Min(hardware, cap)) << SimdLevelName(cap);
  }
  {
    ScopedMaxSimd empty("");
    EXPECT_EQ(DetectSimdLevel(), hardware);
  }
  {
    ScopedMaxSimd typo("avx-512");  // not a level: the safe choice is the lowest one
    EXPECT_EQ(DetectSimdLevel(), SimdLevel::kScalar);
  }
}

TEST(ProfileSimd, NamesRoundTripAndUnknownNamesAreRejected) {
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    Result<SimdLevel> parsed = ParseSimdLevel(SimdLevelName(level));
    ASSERT_TRUE(parsed.ok()) << SimdLevelName(level);
    EXPECT_EQ(*parsed, level);
  }
  Result<SimdLevel> bad = ParseSimdLevel("sse4");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("sse4"), std::string::npos);
}

// Only plausibility: how long the measurement takes is a speed, reported by
// bench/cpu_update_bench.cc, never asserted in a test.
TEST(ProfileCpu, FieldsPlausible) {
  Result<CpuProfile> cpu = MeasureCpuProfile();
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  std::printf("[ profile  ] CPU profile: %s, %d cores, %s, copy %.1f GB/s, update %.1f GB/s\n",
              cpu->model.c_str(), cpu->logical_cores, SimdLevelName(cpu->simd),
              cpu->host_mem_bandwidth / 1e9, cpu->host_update_bandwidth / 1e9);
  EXPECT_FALSE(cpu->model.empty());
  EXPECT_GE(cpu->logical_cores, 1);
  EXPECT_LE(cpu->logical_cores, static_cast<int>(std::thread::hardware_concurrency()));
  EXPECT_EQ(cpu->simd, DetectSimdLevel());
  for (double bw : {cpu->host_mem_bandwidth, cpu->host_update_bandwidth}) {
    EXPECT_GT(bw, 0.0);
    EXPECT_LT(bw, 10e12);
  }
}

TEST(ProfileCpu, OptionsSkipMeasurementAndRejectNegativeThreads) {
  ProfileOptions options;
  options.measure_bandwidth = false;
  Result<CpuProfile> cpu = MeasureCpuProfile(options);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  EXPECT_EQ(cpu->host_mem_bandwidth, 0.0);
  EXPECT_EQ(cpu->host_update_bandwidth, 0.0);
  EXPECT_GE(cpu->logical_cores, 1);

  options.threads = -1;
  Result<CpuProfile> bad = MeasureCpuProfile(options);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("threads"), std::string::npos);
}

// Runs everywhere: without a device it must say so, not fail; with one (the H200 run) the
// fields must be those of a real GPU.
TEST(ProfileGpu, AbsentIsNotAnErrorAndPresentIsPlausible) {
  Result<GpuProfile> gpu = MeasureGpuProfile();
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  if (!gpu->present) {
    EXPECT_TRUE(gpu->name.empty());
    EXPECT_EQ(gpu->sm_count, 0);
    EXPECT_EQ(gpu->total_memory, 0u);
    EXPECT_EQ(gpu->hbm_bandwidth, 0.0);
    return;
  }
  std::printf(
      "[ profile  ] GPU %s: cc %d.%d, %d SMs, %llu MiB, HBM %.0f GB/s, h2d %.1f GB/s, "
      "d2h %.1f GB/s, both ways at once %.1f GB/s each, host update meanwhile %.1f GB/s, "
      "both ways under that update %.1f GB/s each\n",
      gpu->name.c_str(), gpu->compute_capability_major, gpu->compute_capability_minor,
      gpu->sm_count, static_cast<unsigned long long>(gpu->total_memory >> 20),
      gpu->hbm_bandwidth / 1e9, gpu->h2d_bandwidth / 1e9, gpu->d2h_bandwidth / 1e9,
      gpu->duplex_bandwidth / 1e9, gpu->host_update_duplex_bandwidth / 1e9,
      gpu->duplex_under_update_bandwidth / 1e9);
  EXPECT_FALSE(gpu->name.empty());
  EXPECT_GE(gpu->compute_capability_major, 7);
  EXPECT_GT(gpu->sm_count, 0);
  EXPECT_GT(gpu->total_memory, 0u);
  EXPECT_LE(gpu->free_memory, gpu->total_memory);
  EXPECT_GT(gpu->l2_bytes, 0u);
  EXPECT_LE(gpu->max_persisting_l2_bytes, gpu->l2_bytes);
  EXPECT_GT(gpu->hbm_bandwidth, 1e11);
  EXPECT_GT(gpu->h2d_bandwidth, 1e9);
  EXPECT_GT(gpu->d2h_bandwidth, 1e9);
  EXPECT_GT(gpu->duplex_bandwidth, 1e9);
  EXPECT_GT(gpu->host_update_duplex_bandwidth, 1e9);
  EXPECT_GT(gpu->duplex_under_update_bandwidth, 1e9);
  EXPECT_LE(gpu->duplex_under_update_bandwidth, 1.05 * gpu->duplex_bandwidth);
}

DeviceProfile SampleProfile() {
  DeviceProfile p;
  p.cpu.model = "Test \"CPU\" \xc3\xa9 @ 3.0GHz";
  p.cpu.logical_cores = 16;
  p.cpu.simd = SimdLevel::kAvx2;
  p.cpu.host_mem_bandwidth = 1.1e11 / 3.0;  // needs all 17 digits to read back
  p.cpu.host_update_bandwidth = 104e9;
  p.gpu.present = true;
  p.gpu.device = 1;
  p.gpu.name = "NVIDIA H200";
  p.gpu.compute_capability_major = 9;
  p.gpu.compute_capability_minor = 0;
  p.gpu.sm_count = 132;
  p.gpu.total_memory = 150754820096ull;
  p.gpu.free_memory = 150000000001ull;
  p.gpu.l2_bytes = 62914560;
  p.gpu.max_persisting_l2_bytes = 39321600;
  p.gpu.hbm_bandwidth = 4.16e12;
  p.gpu.h2d_bandwidth = 55e9 + 0.5;
  p.gpu.d2h_bandwidth = 0.0;
  p.gpu.duplex_bandwidth = 47e9 + 0.25;
  p.gpu.host_update_duplex_bandwidth = 0.7 * 104e9;
  p.gpu.duplex_under_update_bandwidth = 0.8 * 47e9;
  return p;
}

void ExpectSameProfile(const DeviceProfile& a, const DeviceProfile& b) {
  EXPECT_EQ(a.cpu.model, b.cpu.model);
  EXPECT_EQ(a.cpu.logical_cores, b.cpu.logical_cores);
  EXPECT_EQ(a.cpu.simd, b.cpu.simd);
  EXPECT_EQ(a.cpu.host_mem_bandwidth, b.cpu.host_mem_bandwidth);
  EXPECT_EQ(a.cpu.host_update_bandwidth, b.cpu.host_update_bandwidth);
  EXPECT_EQ(a.gpu.present, b.gpu.present);
  EXPECT_EQ(a.gpu.device, b.gpu.device);
  EXPECT_EQ(a.gpu.name, b.gpu.name);
  EXPECT_EQ(a.gpu.compute_capability_major, b.gpu.compute_capability_major);
  EXPECT_EQ(a.gpu.compute_capability_minor, b.gpu.compute_capability_minor);
  EXPECT_EQ(a.gpu.sm_count, b.gpu.sm_count);
  EXPECT_EQ(a.gpu.total_memory, b.gpu.total_memory);
  EXPECT_EQ(a.gpu.free_memory, b.gpu.free_memory);
  EXPECT_EQ(a.gpu.l2_bytes, b.gpu.l2_bytes);
  EXPECT_EQ(a.gpu.max_persisting_l2_bytes, b.gpu.max_persisting_l2_bytes);
  EXPECT_EQ(a.gpu.hbm_bandwidth, b.gpu.hbm_bandwidth);
  EXPECT_EQ(a.gpu.h2d_bandwidth, b.gpu.h2d_bandwidth);
  EXPECT_EQ(a.gpu.d2h_bandwidth, b.gpu.d2h_bandwidth);
  EXPECT_EQ(a.gpu.duplex_bandwidth, b.gpu.duplex_bandwidth);
  EXPECT_EQ(a.gpu.host_update_duplex_bandwidth, b.gpu.host_update_duplex_bandwidth);
  EXPECT_EQ(a.gpu.duplex_under_update_bandwidth, b.gpu.duplex_under_update_bandwidth);
}

// HostLoad: bad options change nothing and say what to use; a running load has done a round of
// each part by the time Start returns, keeps going, and stops on request (twice is fine). With a
// GPU the copies run too; without one (or with copies off) the CPU part alone.
TEST(HostLoad, OptionsAreCheckedAndTheLoadRunsUntilStopped) {
  auto expect_refused = [](HostLoadOptions o, const char* field) {
    Result<std::unique_ptr<HostLoad>> load = HostLoad::Start(o);
    ASSERT_FALSE(load.ok());
    EXPECT_EQ(load.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(load.status().message().find(field), std::string::npos) << load.status().message();
  };
  HostLoadOptions bad;
  bad.threads = -1;
  expect_refused(bad, "threads");
  bad = HostLoadOptions{};
  bad.update_params = 63;
  expect_refused(bad, "update_params");
  bad = HostLoadOptions{};
  bad.copy_bytes = 0;
  expect_refused(bad, "copy_bytes");

  for (bool copies : {false, true}) {
    HostLoadOptions o;
    o.threads = 2;
    o.update_params = 1 << 16;
    o.copies = copies;
    o.copy_bytes = 1 << 20;
    Result<std::unique_ptr<HostLoad>> load = HostLoad::Start(o);
    ASSERT_TRUE(load.ok()) << load.status().ToString();
    EXPECT_GE((*load)->update_rounds(), 1);
    const bool gpu = copies && MeasureGpuProfile(ProfileOptions{false, 0, 0})->present;
    if (gpu) {
      EXPECT_GE((*load)->copy_rounds(), 4);
    } else {
      EXPECT_EQ((*load)->copy_rounds(), 0);
    }
    // Still running: the rounds keep advancing. Polled, not slept for a fixed time: on a loaded
    // machine the load's threads may wait long for a core (no duration is asserted).
    const int64_t first = (*load)->update_rounds();
    for (int i = 0; i < 60000 && (*load)->update_rounds() == first; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_GT((*load)->update_rounds(), first);
    EXPECT_TRUE((*load)->Stop().ok());
    const int64_t stopped = (*load)->update_rounds();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ((*load)->update_rounds(), stopped);
    EXPECT_TRUE((*load)->Stop().ok());
  }
}

TEST(ProfileJson, RoundTripIsExactAndByteStable) {
  for (bool gpu_present : {true, false}) {
    DeviceProfile original = SampleProfile();
    if (!gpu_present) original.gpu = GpuProfile{};
    const std::string first = DeviceProfileToJson(original);
    Result<DeviceProfile> read = DeviceProfileFromJson(first);
    ASSERT_TRUE(read.ok()) << read.status().ToString() << "\n" << first;
    ExpectSameProfile(*read, original);
    EXPECT_EQ(DeviceProfileToJson(*read), first);
  }
}

TEST(ProfileJson, MeasuredProfileRoundTrips) {
  Result<DeviceProfile> measured = MeasureDeviceProfile();
  ASSERT_TRUE(measured.ok()) << measured.status().ToString();
  const std::string text = DeviceProfileToJson(*measured);
  Result<DeviceProfile> read = DeviceProfileFromJson(text);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ExpectSameProfile(*read, *measured);
}

// Applies edit to the sample profile's JSON and expects a kParseError mentioning `field`.
template <typename Edit>
void ExpectParseError(Edit edit, const std::string& field) {
  Result<json::Value> doc = json::Parse(DeviceProfileToJson(SampleProfile()));
  ASSERT_TRUE(doc.ok());
  edit(*doc);
  const std::string text = json::Write(*doc);
  Result<DeviceProfile> read = DeviceProfileFromJson(text);
  ASSERT_FALSE(read.ok()) << "accepted: " << text;
  EXPECT_EQ(read.status().code(), StatusCode::kParseError);
  EXPECT_NE(read.status().message().find(field), std::string::npos)
      << "message \"" << read.status().message() << "\" does not name " << field;
}

json::Value& Member(json::Value& object, const std::string& key) {
  for (auto& [k, v] : object.as_object()) {
    if (k == key) return v;
  }
  ADD_FAILURE() << "no key " << key;
  return object;
}

void Erase(json::Value& object, const std::string& key) {
  auto& members = object.as_object();
  for (auto it = members.begin(); it != members.end(); ++it) {
    if (it->first == key) {
      members.erase(it);
      return;
    }
  }
  ADD_FAILURE() << "no key " << key;
}

TEST(ProfileJson, MalformedTextIsAParseError) {
  for (const char* text : {"", "{", "{\"version\": 1,}", "[1, 2]", "42", "null"}) {
    Result<DeviceProfile> read = DeviceProfileFromJson(text);
    ASSERT_FALSE(read.ok()) << text;
    EXPECT_EQ(read.status().code(), StatusCode::kParseError) << text;
    EXPECT_NE(read.status().message().find("profile"), std::string::npos)
        << read.status().message();
  }
}

TEST(ProfileJson, MissingFieldsAreNamed) {
  ExpectParseError([](json::Value& d) { Erase(d, "version"); }, "profile.version");
  ExpectParseError([](json::Value& d) { Erase(d, "cpu"); }, "profile.cpu");
  ExpectParseError([](json::Value& d) { Erase(Member(d, "cpu"), "simd"); }, "profile.cpu.simd");
  ExpectParseError([](json::Value& d) { Erase(Member(d, "gpu"), "l2_bytes"); },
                   "profile.gpu.l2_bytes");
  ExpectParseError(
      [](json::Value& d) { Member(Member(d, "gpu"), "hbm_bandwidth") = json::Value(); },
      "profile.gpu.hbm_bandwidth");
}

TEST(ProfileJson, WrongTypesAndValuesAreNamed) {
  ExpectParseError([](json::Value& d) { Member(Member(d, "cpu"), "logical_cores") = "16"; },
                   "profile.cpu.logical_cores");
  ExpectParseError([](json::Value& d) { Member(Member(d, "cpu"), "logical_cores") = 0; },
                   "profile.cpu.logical_cores");
  ExpectParseError([](json::Value& d) { Member(Member(d, "cpu"), "simd") = "sse4"; },
                   "profile.cpu.simd: expected one of scalar, avx2, avx512");
  ExpectParseError([](json::Value& d) { Member(Member(d, "cpu"), "simd") = 2; },
                   "profile.cpu.simd");
  ExpectParseError([](json::Value& d) { Member(Member(d, "gpu"), "present") = "yes"; },
                   "profile.gpu.present");
  ExpectParseError([](json::Value& d) { Member(Member(d, "gpu"), "total_memory") = 1.5; },
                   "profile.gpu.total_memory");
  ExpectParseError([](json::Value& d) { Member(Member(d, "gpu"), "free_memory") = -1; },
                   "profile.gpu.free_memory");
  ExpectParseError(
      [](json::Value& d) {
        Member(Member(d, "gpu"), "free_memory") = uint64_t{150754820097};  // > total
      },
      "profile.gpu.free_memory");
  ExpectParseError([](json::Value& d) { Member(Member(d, "gpu"), "h2d_bandwidth") = -1.0; },
                   "profile.gpu.h2d_bandwidth");
  ExpectParseError([](json::Value& d) { Member(d, "gpu") = json::Value::MakeArray(); },
                   "profile.gpu");
}

TEST(ProfileJson, OtherVersionsAreRefusedByName) {
  for (json::Value version : {json::Value(2), json::Value(0), json::Value("1")}) {
    ExpectParseError([&](json::Value& d) { Member(d, "version") = version; }, "profile.version");
  }
}

TEST(ProfileJson, UnknownKeysAreIgnored) {
  Result<json::Value> doc = json::Parse(DeviceProfileToJson(SampleProfile()));
  ASSERT_TRUE(doc.ok());
  doc->Set("note", "hand-written");
  Member(*doc, "cpu").Set("numa_nodes", 2);
  Result<DeviceProfile> read = DeviceProfileFromJson(json::Write(*doc));
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ExpectSameProfile(*read, SampleProfile());
}

TEST(ProfileJson, AbsentGpuNeedsNoOtherGpuFields) {
  Result<DeviceProfile> read = DeviceProfileFromJson(
      R"({"version": 1, "cpu": {"model": "m", "logical_cores": 2, "simd": "scalar",
          "host_mem_bandwidth": 1e10, "host_update_bandwidth": 9000000000},
          "gpu": {"present": false}})");
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_FALSE(read->gpu.present);
  EXPECT_EQ(read->cpu.host_update_bandwidth, 9e9);  // an integer literal is a valid number
}

// The preset the CLI and tests use when no GPU is at hand: the DESIGN.md facts, exactly.
TEST(ProfileJson, H200PresetHoldsTheDesignFacts) {
  Result<std::string> text =
      json::ReadFile(std::string(EMSA_SOURCE_DIR) + "/examples/profiles/h200.json");
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  Result<DeviceProfile> p = DeviceProfileFromJson(*text);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->cpu.logical_cores, 16);
  EXPECT_EQ(p->cpu.simd, SimdLevel::kAvx512);
  EXPECT_EQ(p->cpu.host_mem_bandwidth, 110e9);
  EXPECT_EQ(p->cpu.host_update_bandwidth, 104e9);
  ASSERT_TRUE(p->gpu.present);
  EXPECT_EQ(p->gpu.name, "NVIDIA H200");
  EXPECT_EQ(p->gpu.compute_capability_major, 9);
  EXPECT_EQ(p->gpu.compute_capability_minor, 0);
  EXPECT_EQ(p->gpu.sm_count, 132);
  EXPECT_EQ(p->gpu.total_memory, 143771ull << 20);
  EXPECT_LT(p->gpu.free_memory, p->gpu.total_memory);
  EXPECT_EQ(p->gpu.l2_bytes, 60ull << 20);
  EXPECT_EQ(p->gpu.max_persisting_l2_bytes, 75ull << 19);  // 37.5 MiB
  EXPECT_EQ(p->gpu.hbm_bandwidth, 4.16e12);
  EXPECT_EQ(p->gpu.h2d_bandwidth, 55e9);
  EXPECT_EQ(p->gpu.d2h_bandwidth, 55e9);
  EXPECT_EQ(p->gpu.duplex_bandwidth, 0.0);  // not in the preset: planners take min(h2d, d2h)
  EXPECT_EQ(p->gpu.host_update_duplex_bandwidth, 0.0);
}

}  // namespace
}  // namespace emsa
