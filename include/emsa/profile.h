// emsa/profile.h — what the machine is: CPU, host memory bandwidth, GPU, PCIe.
//
// MeasureDeviceProfile() runs short measurements (well under a second in all on the CPU side; a
// few hundred milliseconds more when a GPU is present). The result is plain data, serializable to
// JSON so that a profile taken on one machine can be planned against on another (the CLI's
// --profile). Bandwidths are in bytes per second and count bytes read plus bytes written.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "emsa/status.h"

namespace emsa {

// Values equal the C ABI's EMSA_SIMD_* constants. Ordered: a higher level implies the lower ones.
enum class SimdLevel : int32_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
const char* SimdLevelName(SimdLevel level);  // "scalar", "avx2", "avx512"
Result<SimdLevel> ParseSimdLevel(const std::string& name);
// What this CPU and OS support, from cpuid and xgetbv (AVX-512 needs F, BW, VL, DQ and OS
// support for the zmm state; AVX2 needs AVX2, FMA, F16C and the ymm state).
//
// The environment variable EMSA_MAX_SIMD=scalar|avx2|avx512 caps the result (it never raises
// it): for testing the lower paths, or for hypervisors that advertise an ISA they handle badly.
// It is read on every call. Any other non-empty value caps at scalar, with one warning on stderr.
SimdLevel DetectSimdLevel();

struct CpuProfile {
  std::string model;      // brand string, or "unknown"
  int logical_cores = 0;  // threads the OS lets this process use (affinity mask)
  SimdLevel simd = SimdLevel::kScalar;
  double host_mem_bandwidth = 0.0;  // B/s, multi-threaded in-place a += s*b, read+write, measured
  double host_update_bandwidth = 0.0;  // B/s, the host tier's fp32 AdamW update (CpuUpdater,
                                       // 28 bytes per element), measured on one core fewer
                                       // than logical_cores, as the host tier's pool runs
  uint64_t host_memory = 0;  // bytes of physical memory (RAM); 0: not known (older profiles)
};

struct GpuProfile {
  bool present = false;  // false: every other field is zero/empty
  int device = 0;        // CUDA ordinal
  std::string name;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  int sm_count = 0;
  uint64_t total_memory = 0;  // bytes
  uint64_t free_memory = 0;   // bytes, when measured
  uint64_t l2_bytes = 0;
  uint64_t max_persisting_l2_bytes = 0;  // 0: the device has no persisting L2 (or MIG)
  double hbm_bandwidth = 0.0;            // B/s, device-to-device copy, read+write, measured
  // PCIe figures count each byte once (it crosses the link once), one direction at a time.
  double h2d_bandwidth = 0.0;  // B/s, pinned host to device, measured
  double d2h_bandwidth = 0.0;  // B/s, device to pinned host, measured
  // B/s each way with both directions copying at once (two streams), the slower of the two:
  // what the host tier's GPU-updated moments, going up and down together, get. 0: not measured
  // (profiles from before it existed); the planner then takes the slower single direction.
  double duplex_bandwidth = 0.0;
  // B/s, the host tier's CPU update (as CpuProfile::host_update_bandwidth, 28 B per parameter)
  // while copies run both ways between pinned host memory and the device: the DMA's trips
  // through host memory slow it. The planner weighs the host tier's CPU path against its
  // GPU-updated path (whose moments stream both ways) with it. 0: not measured (older profiles);
  // the planner then charges the DMA's bytes to the host's memory in full.
  double host_update_duplex_bandwidth = 0.0;
  // B/s each way, the copies both ways at once (as duplex_bandwidth) while that CPU update runs
  // throughout: the CPU's traffic in host memory slows the DMA too. The planner times the host
  // tier's links with it while its CPU path works. 0: not measured (older profiles); the
  // planner then takes duplex_bandwidth.
  double duplex_under_update_bandwidth = 0.0;
};

struct DeviceProfile {
  static constexpr int kVersion = 1;
  CpuProfile cpu;
  GpuProfile gpu;
};

struct ProfileOptions {
  bool measure_bandwidth = true;  // false: skip the timed parts (bandwidths stay 0)
  int gpu_device = 0;             // which CUDA device to describe, if any
  int threads = 0;                // CPU threads for the host measurement; 0 = all allowed
};

// CPU part only; never touches CUDA.
Result<CpuProfile> MeasureCpuProfile(const ProfileOptions& options = {});
// GPU part; {present=false} when there is no CUDA build, no driver or no device (not an error).
// A gpu_device beyond the devices present is kInvalidArgument. Restores the calling thread's
// current device; frees everything it allocated (about 2 GiB of device memory, 256 MiB pinned).
Result<GpuProfile> MeasureGpuProfile(const ProfileOptions& options = {});
Result<DeviceProfile> MeasureDeviceProfile(const ProfileOptions& options = {});

// JSON: {"version":1,"cpu":{...},"gpu":{...}}, keys named as the struct fields. Reading a file
// of another version, or with a missing or mistyped field, is kParseError naming the field
// ("profile.cpu.simd: ..."). Unknown keys (a preset's "note") are ignored. With
// "gpu":{"present":false} the other GPU fields are neither written nor required.
// Presets for machines not at hand live in examples/profiles/ (h200.json).
std::string DeviceProfileToJson(const DeviceProfile& profile);
Result<DeviceProfile> DeviceProfileFromJson(const std::string& text);

// What the host tier puts on this machine while it runs, made on purpose: the CPU update of
// HostTierThreads(cores) threads streaming through `update_params` fp32 parameters' state in host
// memory, and (with a CUDA device) copies both ways between pinned host memory and the device,
// each on its own thread, over and over until Stop. The host's memory and PCIe, saturated so, slow
// the threads that launch the GPU's forward and backward; the probe times the model's forward and
// backward under it (ProbeRecord::period_under_load) and the planner uses that for plans with a
// host tier.
struct HostLoadOptions {
  int threads = 0;                            // CPU update threads; 0: HostTierThreads(all cores)
  int64_t update_params = int64_t{64} << 20;  // 1 GiB of fp32 param, grad and moments; >= 64
  int gpu_device = 0;                         // copies to and from this device
  bool copies = true;                         // false (or no CUDA device): the CPU update only
  uint64_t copy_bytes = uint64_t{64} << 20;   // per copy; two device and two pinned buffers
};

class HostLoad {
 public:
  // Allocates everything, starts both threads and returns once each has done one round. Bad
  // options: kInvalidArgument naming the field; allocation failures: kOutOfMemory; nothing is
  // left running on error.
  static Result<std::unique_ptr<HostLoad>> Start(const HostLoadOptions& options = {});
  ~HostLoad();  // stops (errors dropped: call Stop to see them)
  HostLoad(const HostLoad&) = delete;
  HostLoad& operator=(const HostLoad&) = delete;

  // Stops both threads and waits for them; the first error either met. Idempotent.
  Status Stop();
  // Rounds done so far: CPU update steps, and copies each way (0 without copies).
  int64_t update_rounds() const;
  int64_t copy_rounds() const;

 private:
  struct Impl;
  explicit HostLoad(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace emsa
