// profile_cache.cc — the measured profile kept per machine (emsa/profile_cache.h).
//
// The file: {"format": "emsa.profile_cache", "version": 1, "key": {...}, "measured_at": <Unix
// seconds>, "profile": <DeviceProfile>}. Every way it can be wrong becomes a reason to measure
// again, never an error: a cache is an optimisation, and the measurement is always at hand.
#include "emsa/profile_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "common/json.h"

namespace emsa {
namespace {

constexpr const char* kFormat = "emsa.profile_cache";
constexpr int kCacheVersion = 1;

std::atomic<int64_t> g_measurements{0};

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string DefaultFolder() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && xdg[0] == '/') return std::string(xdg) + "/emsa";  // XDG: absolute only
  const char* home = std::getenv("HOME");
  if (home != nullptr && home[0] != '\0') return std::string(home) + "/.cache/emsa";
  return "";
}

// The key's fields, in the file's order.
json::Value KeyValue(const DeviceProfile& d) {
  json::Value key = json::Value::MakeObject();
  key.Set("gpu", d.gpu.present ? d.gpu.name : std::string("none"));
  key.Set("driver", d.gpu.present ? GpuDriverVersion() : std::string("none"));
  key.Set("cpu", d.cpu.model);
  key.Set("cores", d.cpu.logical_cores);
  key.Set("profile", DeviceProfile::kVersion);
  return key;
}

uint64_t Fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Bandwidths are what the cache is for: a profile without them is not a measurement.
bool HasBandwidths(const DeviceProfile& p) {
  if (p.cpu.host_mem_bandwidth <= 0.0 || p.cpu.host_update_bandwidth <= 0.0) return false;
  return !p.gpu.present ||
         (p.gpu.hbm_bandwidth > 0.0 && p.gpu.h2d_bandwidth > 0.0 && p.gpu.d2h_bandwidth > 0.0);
}

// The cached profile at `path` when it is this machine's, of this emsa's versions and young
// enough; otherwise why not (the Result's message). Sets *age to the measurement's age.
Result<DeviceProfile> ReadCache(const std::string& path, const json::Value& key,
                                int64_t max_age_seconds, double* age) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::NotFound("no cache file yet");
  EMSA_ASSIGN_OR_RETURN(std::string text, json::ReadFile(path));
  Result<json::Value> parsed = json::Parse(text);
  if (!parsed.ok()) return Status::ParseError("corrupt: " + parsed.status().message());
  const json::Value& doc = *parsed;
  if (!doc.is_object()) return Status::ParseError("corrupt: not a JSON object");
  const json::Value* format = doc.Find("format");
  const json::Value* version = doc.Find("version");
  if (format == nullptr || !format->is_string() || format->as_string() != kFormat ||
      version == nullptr || !version->is_int() || version->as_int() != kCacheVersion) {
    return Status::ParseError(std::string("not a version ") + std::to_string(kCacheVersion) + " " +
                              kFormat + " file");
  }
  const json::Value* stored = doc.Find("key");
  if (stored == nullptr || json::Write(*stored) != json::Write(key)) {
    return Status::ParseError(
        "another machine's profile: its key is " +
        (stored == nullptr ? std::string("missing") : json::Write(*stored, -1)) +
        ", this machine's " + json::Write(key, -1));
  }
  const json::Value* measured = doc.Find("measured_at");
  if (measured == nullptr || !measured->is_number()) {
    return Status::ParseError("corrupt: no measured_at");
  }
  *age = NowSeconds() - measured->as_double();
  if (*age < -60.0) return Status::ParseError("measured in the future (clock changed)");
  if (*age > static_cast<double>(max_age_seconds)) {
    return Status::ParseError("older than the age limit of " + std::to_string(max_age_seconds) +
                              " s");
  }
  const json::Value* profile = doc.Find("profile");
  if (profile == nullptr) return Status::ParseError("corrupt: no profile");
  Result<DeviceProfile> cached = DeviceProfileFromJson(json::Write(*profile));
  if (!cached.ok()) return Status::ParseError("corrupt: " + cached.status().message());
  if (!HasBandwidths(*cached)) return Status::ParseError("corrupt: no measured bandwidths");
  return cached;
}

Status WriteCache(const std::string& path, const json::Value& key, const DeviceProfile& profile) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) return Status::IoError("cannot create " + path + "'s folder: " + ec.message());
  EMSA_ASSIGN_OR_RETURN(json::Value measured, json::Parse(DeviceProfileToJson(profile)));
  json::Value doc = json::Value::MakeObject();
  doc.Set("format", kFormat);
  doc.Set("version", kCacheVersion);
  doc.Set("key", key);
  doc.Set("measured_at", NowSeconds());
  doc.Set("profile", std::move(measured));
  return json::WriteFile(path, json::Write(doc));
}

// The description (fresh) with the measured figures of `measured` (cached or new).
DeviceProfile WithBandwidths(DeviceProfile description, const DeviceProfile& measured) {
  CpuProfile& cpu = description.cpu;
  cpu.host_mem_bandwidth = measured.cpu.host_mem_bandwidth;
  cpu.host_update_bandwidth = measured.cpu.host_update_bandwidth;
  GpuProfile& gpu = description.gpu;
  if (gpu.present) {
    gpu.hbm_bandwidth = measured.gpu.hbm_bandwidth;
    gpu.h2d_bandwidth = measured.gpu.h2d_bandwidth;
    gpu.d2h_bandwidth = measured.gpu.d2h_bandwidth;
    gpu.duplex_bandwidth = measured.gpu.duplex_bandwidth;
    gpu.host_update_duplex_bandwidth = measured.gpu.host_update_duplex_bandwidth;
    gpu.duplex_under_update_bandwidth = measured.gpu.duplex_under_update_bandwidth;
  }
  return description;
}

std::string FormatAge(double seconds) {
  char text[32];
  if (seconds < 120.0) {
    std::snprintf(text, sizeof(text), "%.0f s", seconds);
  } else if (seconds < 7200.0) {
    std::snprintf(text, sizeof(text), "%.0f min", seconds / 60.0);
  } else if (seconds < 2 * 86400.0) {
    std::snprintf(text, sizeof(text), "%.1f h", seconds / 3600.0);
  } else {
    std::snprintf(text, sizeof(text), "%.1f days", seconds / 86400.0);
  }
  return text;
}

// An exclusive flock on PATH.lock for the object's life; none (and no error) when the lock file
// cannot be made: the cache then works unlocked.
class FileLock {
 public:
  explicit FileLock(const std::string& path) {
    if (path.empty()) return;
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
    fd_ = ::open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) return;
    while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  ~FileLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace

std::string ProfileCacheKey(const DeviceProfile& description) {
  const json::Value key = KeyValue(description);
  std::string out;
  for (const auto& [name, value] : key.as_object()) {
    if (!out.empty()) out += "; ";
    out += name + "=" + (value.is_string() ? value.as_string() : json::Write(value, -1));
  }
  return out;
}

std::string ProfileCachePath(const ProfileCacheOptions& options, const DeviceProfile& description) {
  const std::string folder = options.folder.empty() ? DefaultFolder() : options.folder;
  if (folder.empty()) return "";
  char name[40];
  std::snprintf(name, sizeof(name), "profile-%016llx.json",
                static_cast<unsigned long long>(Fnv1a(json::Write(KeyValue(description), -1))));
  return folder + "/" + name;
}

Result<CachedProfile> CachedDeviceProfile(const ProfileCacheOptions& options) {
  if (options.max_age_seconds < 0) {
    return Status::InvalidArgument("ProfileCacheOptions.max_age_seconds must be >= 0, got " +
                                   std::to_string(options.max_age_seconds));
  }
  ProfileOptions describe;
  describe.measure_bandwidth = false;
  describe.gpu_device = options.gpu_device;
  describe.threads = options.threads;
  EMSA_ASSIGN_OR_RETURN(DeviceProfile description, MeasureDeviceProfile(describe));
  const json::Value key = KeyValue(description);
  CachedProfile out;
  out.path = ProfileCachePath(options, description);
  // Held while the file is read, measured and written: processes started together (the ranks
  // of one job) measure one at a time, never under each other's load, and the ones that waited
  // read what the first wrote.
  const FileLock lock(out.path);
  if (out.path.empty()) {
    out.why_measured = "no cache folder ($XDG_CACHE_HOME and $HOME are unset)";
  } else if (options.refresh) {
    out.why_measured = "refresh requested";
  } else {
    double age = 0.0;
    Result<DeviceProfile> cached = ReadCache(out.path, key, options.max_age_seconds, &age);
    if (cached.ok()) {
      out.profile = WithBandwidths(std::move(description), *cached);
      out.from_cache = true;
      out.age_seconds = age;
      return out;
    }
    out.why_measured = cached.status().message();
  }
  ProfileOptions measure = describe;
  measure.measure_bandwidth = true;
  g_measurements.fetch_add(1, std::memory_order_relaxed);
  EMSA_ASSIGN_OR_RETURN(DeviceProfile measured, MeasureDeviceProfile(measure));
  // The description's free memory was read before the measurement's buffers existed.
  out.profile = WithBandwidths(std::move(description), measured);
  if (!out.path.empty()) {
    const Status saved = WriteCache(out.path, key, measured);
    if (!saved.ok()) out.why_not_saved = saved.message();
  } else {
    out.why_not_saved = out.why_measured;
  }
  return out;
}

std::string CachedProfileToJson(const CachedProfile& cached) {
  json::Value doc = json::Value::MakeObject();
  Result<json::Value> profile = json::Parse(DeviceProfileToJson(cached.profile));
  doc.Set("profile", profile.ok() ? std::move(profile).value() : json::Value());
  doc.Set("path", cached.path);
  doc.Set("from_cache", cached.from_cache);
  doc.Set("age_seconds", cached.age_seconds);
  doc.Set("why_measured", cached.why_measured);
  doc.Set("why_not_saved", cached.why_not_saved);
  doc.Set("key", ProfileCacheKey(cached.profile));
  doc.Set("summary", CachedProfileSummary(cached));
  return json::Write(doc);
}

std::string CachedProfileSummary(const CachedProfile& cached) {
  if (cached.from_cache) {
    return "from cache " + cached.path + ", measured " + FormatAge(cached.age_seconds) + " ago";
  }
  std::string line = "measured now (" + cached.why_measured + ")";
  if (cached.why_not_saved.empty()) return line + ", cached at " + cached.path;
  return line + ", not cached: " + cached.why_not_saved;
}

int64_t ProfileMeasurementCount() { return g_measurements.load(std::memory_order_relaxed); }

}  // namespace emsa
