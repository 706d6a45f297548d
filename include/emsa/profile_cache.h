// emsa/profile_cache.h — the machine's profile measured once and kept in the user's cache folder.
//
// Measuring the bandwidths (host memory, the host tier's CPU update, HBM, PCIe each way and both
// ways, each under the other's load) takes about a second with a GPU; they change only when the
// machine does. CachedDeviceProfile() keeps them in one JSON file per machine under
// $XDG_CACHE_HOME/emsa/ (else ~/.cache/emsa/), keyed by what would change them: the GPU's name,
// the driver, the CPU's model, the cores this process may use and the profile format's version.
// What changes from process to process (free device memory above all: the default budget) is
// never taken from the file: the untimed description is read fresh each time (a few
// milliseconds) and only the measured bandwidths come from the cache.
//
// The file is never trusted blindly: one that does not parse, holds another machine's key, a
// format or profile version other than this emsa's, no bandwidths, or a measurement older than
// max_age_seconds (or dated in the future) is re-measured and rewritten, and the result says why
// (CachedProfile::why_measured). Writes are atomic (json::WriteFile), and an flock on the file's
// PATH.lock is held from the read to the write, so that processes started together (one job's
// ranks) measure one at a time and the rest read the first one's result. A cache folder that
// cannot be written leaves the measurement unsaved, said in CachedProfile::why_not_saved, not an
// error.
#pragma once

#include <cstdint>
#include <string>

#include "emsa/profile.h"
#include "emsa/status.h"

namespace emsa {

struct ProfileCacheOptions {
  // The cache folder; "": $XDG_CACHE_HOME/emsa, else $HOME/.cache/emsa (neither set: no cache).
  std::string folder;
  // A measurement older than this is taken again: hardware settings that the key does not name
  // (memory channels, BIOS power limits, PCIe link width) change rarely, and a week bounds how
  // long a changed one goes unnoticed while costing one measurement a week.
  int64_t max_age_seconds = int64_t{7} * 24 * 3600;
  bool refresh = false;  // measure and rewrite even when the cache holds a good profile
  int gpu_device = 0;    // which CUDA device to describe, if any
  int threads = 0;       // CPU threads for the host measurement; 0 = all allowed
};

struct CachedProfile {
  DeviceProfile profile;      // the fresh description with the bandwidths (cached or measured)
  std::string path;           // the cache file ("" when there is no cache folder)
  bool from_cache = false;    // true: no bandwidth was measured in this call
  double age_seconds = 0.0;   // since the bandwidths were measured (0 when measured now)
  std::string why_measured;   // why the cache was not used ("" when it was)
  std::string why_not_saved;  // why a measurement was not written ("" when it was, or cached)
};

// The cache key of this machine as CachedDeviceProfile computes it, as one line of text
// ("gpu=...; driver=...; cpu=...; cores=...; profile=1"), for messages and tests.
std::string ProfileCacheKey(const DeviceProfile& description);
// The file CachedDeviceProfile reads and writes for this description ("" without a folder).
std::string ProfileCachePath(const ProfileCacheOptions& options, const DeviceProfile& description);

Result<CachedProfile> CachedDeviceProfile(const ProfileCacheOptions& options = {});

// {"profile": {...}, "path": "...", "from_cache": bool, "age_seconds": s, "why_measured": "...",
// "why_not_saved": "...", "key": "...", "summary": CachedProfileSummary}: what the C ABI hands to
// Python's report.
std::string CachedProfileToJson(const CachedProfile& cached);
// One line for people: "from cache PATH, measured 3.2 h ago" or "measured now (why), cached at
// PATH" (or "not cached: why").
std::string CachedProfileSummary(const CachedProfile& cached);

// How many bandwidth measurements CachedDeviceProfile made in this process (tests prove a cache
// hit with it, never by timing).
int64_t ProfileMeasurementCount();

// The driver as the key names it: the NVIDIA kernel module's version and the CUDA driver API's
// ("550.54.15 cuda 12040"); "none" without a driver.
std::string GpuDriverVersion();

}  // namespace emsa
