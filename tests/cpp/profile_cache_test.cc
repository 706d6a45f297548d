// Tests for include/emsa/profile_cache.h: a good cache file is used (no measurement, proved by
// the measurement counter), and every kind of bad one (missing, corrupt, another machine's,
// another version, too old, dated in the future) is measured again and rewritten; --refresh
// rewrites a good one; an unwritable folder still gives a profile. Every test points the cache
// at its own temporary folder: none touches the user's cache.
#include "emsa/profile_cache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

#include "common/json.h"

namespace emsa {
namespace {

// The member `key` of object `v`, for editing (it must be there).
json::Value& At(json::Value& v, const std::string& key) {
  for (auto& [name, value] : v.as_object()) {
    if (name == key) return value;
  }
  ADD_FAILURE() << "no member " << key;
  return v;
}

class ProfileCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/emsa_profile_cache_XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    root_ = options_.folder = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }

  // One call that must succeed.
  CachedProfile Get() {
    Result<CachedProfile> r = CachedDeviceProfile(options_);
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.ok() ? *r : CachedProfile{};
  }

  // The cache file, parsed; `edit` changes it and it is written back.
  void Edit(const std::string& path, const std::function<void(json::Value&)>& edit) {
    Result<std::string> text = json::ReadFile(path);
    ASSERT_TRUE(text.ok());
    Result<json::Value> doc = json::Parse(*text);
    ASSERT_TRUE(doc.ok());
    edit(*doc);
    ASSERT_TRUE(json::WriteFile(path, json::Write(*doc)).ok());
  }

  // A first call measures and writes; `spoil` damages the file; the next call must measure
  // again (its reason naming `why`), rewrite the file, and the one after use it.
  void ExpectRemeasured(const std::function<void(const std::string&)>& spoil,
                        const std::string& why) {
    const CachedProfile first = Get();
    ASSERT_FALSE(first.from_cache);
    ASSERT_TRUE(first.why_not_saved.empty()) << first.why_not_saved;
    spoil(first.path);
    const int64_t before = ProfileMeasurementCount();
    const CachedProfile again = Get();
    EXPECT_FALSE(again.from_cache);
    EXPECT_EQ(ProfileMeasurementCount(), before + 1);
    EXPECT_NE(again.why_measured.find(why), std::string::npos) << again.why_measured;
    EXPECT_EQ(again.path, first.path);
    const CachedProfile third = Get();
    EXPECT_TRUE(third.from_cache) << third.why_measured;
    EXPECT_EQ(ProfileMeasurementCount(), before + 1);
  }

  ProfileCacheOptions options_;
  std::string root_;
};

TEST_F(ProfileCacheTest, SecondCallUsesTheCacheWithoutMeasuring) {
  const int64_t before = ProfileMeasurementCount();
  const CachedProfile first = Get();
  EXPECT_FALSE(first.from_cache);
  EXPECT_NE(first.why_measured.find("no cache file"), std::string::npos) << first.why_measured;
  EXPECT_EQ(ProfileMeasurementCount(), before + 1);
  EXPECT_EQ(first.path.rfind(options_.folder + "/profile-", 0), 0u) << first.path;
  EXPECT_TRUE(std::filesystem::exists(first.path));
  EXPECT_GT(first.profile.cpu.host_mem_bandwidth, 0.0);

  const CachedProfile second = Get();
  EXPECT_TRUE(second.from_cache) << second.why_measured;
  EXPECT_TRUE(second.why_measured.empty());
  EXPECT_EQ(ProfileMeasurementCount(), before + 1);  // no second measurement
  EXPECT_GE(second.age_seconds, 0.0);
  EXPECT_EQ(second.profile.cpu.host_mem_bandwidth, first.profile.cpu.host_mem_bandwidth);
  EXPECT_EQ(second.profile.cpu.host_update_bandwidth, first.profile.cpu.host_update_bandwidth);
  EXPECT_NE(CachedProfileSummary(second).find("from cache " + second.path), std::string::npos);
  EXPECT_NE(CachedProfileSummary(first).find("measured now"), std::string::npos);
  // The JSON the C ABI returns names where it came from.
  Result<json::Value> doc = json::Parse(CachedProfileToJson(second));
  ASSERT_TRUE(doc.ok());
  EXPECT_TRUE(doc->Find("from_cache")->as_bool());
  EXPECT_EQ(doc->Find("path")->as_string(), second.path);
  EXPECT_TRUE(DeviceProfileFromJson(json::Write(*doc->Find("profile"))).ok());
}

TEST_F(ProfileCacheTest, WhatChangesPerProcessIsReadFreshNotFromTheFile) {
  const CachedProfile first = Get();
  Edit(first.path, [](json::Value& d) {
    At(At(d, "profile"), "cpu").Set("host_memory", uint64_t{4096});
    At(At(d, "profile"), "cpu").Set("host_mem_bandwidth", 1234.0);
  });
  const CachedProfile second = Get();
  ASSERT_TRUE(second.from_cache);
  EXPECT_EQ(second.profile.cpu.host_memory, first.profile.cpu.host_memory);  // fresh
  EXPECT_EQ(second.profile.cpu.host_mem_bandwidth, 1234.0);                  // cached
}

// GPU hosts only: the key names the GPU and its driver, the PCIe and HBM figures come from the
// file, and the device's free memory (the default budget) never does.
TEST_F(ProfileCacheTest, GpuFiguresAreCachedAndFreeMemoryIsReadFresh) {
  const CachedProfile first = Get();
  if (!first.profile.gpu.present) GTEST_SKIP() << "no CUDA device";
  EXPECT_GT(first.profile.gpu.h2d_bandwidth, 0.0);
  const std::string key = ProfileCacheKey(first.profile);
  EXPECT_NE(key.find("gpu=" + first.profile.gpu.name), std::string::npos) << key;
  EXPECT_NE(key.find("cuda "), std::string::npos) << key;  // the driver API's version
  Edit(first.path, [](json::Value& d) {
    At(At(d, "profile"), "gpu").Set("free_memory", uint64_t{1});
    At(At(d, "profile"), "gpu").Set("h2d_bandwidth", 4321.0);
  });
  const CachedProfile second = Get();
  ASSERT_TRUE(second.from_cache) << second.why_measured;
  EXPECT_EQ(second.profile.gpu.h2d_bandwidth, 4321.0);
  EXPECT_GT(second.profile.gpu.free_memory, uint64_t{1});
  EXPECT_EQ(second.profile.gpu.total_memory, first.profile.gpu.total_memory);
}

TEST_F(ProfileCacheTest, CorruptFileIsMeasuredAgain) {
  ExpectRemeasured(
      [](const std::string& path) { ASSERT_TRUE(json::WriteFile(path, "{\"ver").ok()); },
      "corrupt");
}

TEST_F(ProfileCacheTest, ProfileWithoutBandwidthsIsMeasuredAgain) {
  ExpectRemeasured(
      [this](const std::string& path) {
        Edit(path,
             [](json::Value& d) { At(At(d, "profile"), "cpu").Set("host_update_bandwidth", 0.0); });
      },
      "no measured bandwidths");
}

TEST_F(ProfileCacheTest, AnotherMachinesFileIsMeasuredAgain) {
  ExpectRemeasured(
      [this](const std::string& path) {
        Edit(path, [](json::Value& d) { At(d, "key").Set("cpu", "Some Other CPU"); });
      },
      "another machine");
}

TEST_F(ProfileCacheTest, OtherFormatVersionIsMeasuredAgain) {
  ExpectRemeasured(
      [this](const std::string& path) { Edit(path, [](json::Value& d) { d.Set("version", 99); }); },
      "not a version 1");
}

TEST_F(ProfileCacheTest, OldMeasurementIsMeasuredAgain) {
  ExpectRemeasured(
      [this](const std::string& path) {
        Edit(path, [this](json::Value& d) {
          const double at = d.Find("measured_at")->as_double();
          d.Set("measured_at", at - static_cast<double>(options_.max_age_seconds) - 10.0);
        });
      },
      "older than the age limit");
}

TEST_F(ProfileCacheTest, MeasurementDatedInTheFutureIsMeasuredAgain) {
  ExpectRemeasured(
      [this](const std::string& path) {
        Edit(path, [](json::Value& d) {
          d.Set("measured_at", d.Find("measured_at")->as_double() + 86400.0);
        });
      },
      "in the future");
}

TEST_F(ProfileCacheTest, RefreshMeasuresAndRewritesAGoodFile) {
  const CachedProfile first = Get();
  // Dated five seconds back, so that the rewrite's later stamp shows even on a coarse clock.
  Edit(first.path,
       [](json::Value& d) { d.Set("measured_at", d.Find("measured_at")->as_double() - 5.0); });
  const double stamped = [&] {
    Result<std::string> text = json::ReadFile(first.path);
    return json::Parse(*text)->Find("measured_at")->as_double();
  }();
  options_.refresh = true;
  const int64_t before = ProfileMeasurementCount();
  const CachedProfile refreshed = Get();
  EXPECT_FALSE(refreshed.from_cache);
  EXPECT_EQ(refreshed.why_measured, "refresh requested");
  EXPECT_EQ(ProfileMeasurementCount(), before + 1);
  Result<std::string> text = json::ReadFile(first.path);
  ASSERT_TRUE(text.ok());
  EXPECT_GT(json::Parse(*text)->Find("measured_at")->as_double(), stamped);  // rewritten
}

TEST_F(ProfileCacheTest, UnwritableFolderStillGivesAProfile) {
  ASSERT_TRUE(json::WriteFile(options_.folder + "/file", "x").ok());
  options_.folder += "/file/cache";  // a folder under a regular file cannot be made
  const CachedProfile got = Get();
  EXPECT_FALSE(got.from_cache);
  EXPECT_FALSE(got.why_not_saved.empty());
  EXPECT_GT(got.profile.cpu.host_mem_bandwidth, 0.0);
  EXPECT_NE(CachedProfileSummary(got).find("not cached"), std::string::npos);
}

TEST_F(ProfileCacheTest, CallersStartedTogetherMeasureOnce) {
  const int64_t before = ProfileMeasurementCount();
  Result<CachedProfile> a = Status::Internal("not run"), b = Status::Internal("not run");
  std::thread other([&] { a = CachedDeviceProfile(options_); });
  b = CachedDeviceProfile(options_);
  other.join();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(ProfileMeasurementCount(), before + 1);  // the lock: one measured, one read it
  EXPECT_NE(a->from_cache, b->from_cache);
}

TEST_F(ProfileCacheTest, KeyNamesTheMachineAndNegativeAgeIsRefused) {
  const CachedProfile got = Get();
  const std::string key = ProfileCacheKey(got.profile);
  EXPECT_NE(key.find("cpu=" + got.profile.cpu.model), std::string::npos) << key;
  EXPECT_NE(key.find("cores=" + std::to_string(got.profile.cpu.logical_cores)), std::string::npos);
  EXPECT_NE(key.find("profile=1"), std::string::npos);
  EXPECT_EQ(ProfileCachePath(options_, got.profile), got.path);
  options_.max_age_seconds = -1;
  EXPECT_FALSE(CachedDeviceProfile(options_).ok());
}

}  // namespace
}  // namespace emsa
