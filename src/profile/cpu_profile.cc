// cpu_profile.cc — the CPU half of the device profile: model, usable cores, SIMD level, and two
// measured host-memory bandwidths (a streaming read-modify-write, and the host tier's own AdamW
// update on its own pool, which predicts the host tier's update speed).
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

#include "common/thread_pool.h"
#include "emsa/cpu_update.h"
#include "emsa/host_tier_costs.h"
#include "emsa/profile.h"
#include "profile/update_probe.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace emsa {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
// Scratch size: several times the L3 of one CCD or socket (a sweep over more than the cache
// gets almost no hits), 32 MiB per thread on many-core hosts, at most an eighth of RAM so that
// small machines are not pushed into swap. Not derived from sysconf's L3 size: VMs report the
// host's, not the slice they get. Bigger only costs time: the first touch of fresh pages
// dominates the measurement, and on a VM it is several times slower than on metal.
constexpr uint64_t kMinScratchBytes = 256 * kMiB;
constexpr uint64_t kScratchBytesPerThread = 128 * kMiB;
constexpr int kRepetitions = 6;
constexpr int64_t kClaimFloats = 64 * 1024;  // the streaming pass's unit of work

std::string CpuModel() {
#if defined(__x86_64__) || defined(__i386__)
  uint32_t regs[12] = {};  // three leaves of eax, ebx, ecx, edx: 48 bytes of ASCII
  uint32_t max_leaf = __get_cpuid_max(0x80000000u, nullptr);
  if (max_leaf < 0x80000004u) return "unknown";
  for (uint32_t leaf = 0; leaf < 3; ++leaf) {
    uint32_t* r = regs + size_t{4} * leaf;
    __get_cpuid(0x80000002u + leaf, &r[0], &r[1], &r[2], &r[3]);
  }
  char brand[sizeof regs + 1] = {};
  std::memcpy(brand, regs, sizeof regs);
  std::string model(brand);
  const size_t first = model.find_first_not_of(' ');
  if (first == std::string::npos) return "unknown";
  const size_t last = model.find_last_not_of(' ');
  return model.substr(first, last - first + 1);
#else
  return "unknown";
#endif
}

// Threads the OS lets this process run on: the affinity mask, not the machine's core count,
// so that containers and taskset are respected.
int LogicalCores() {
  for (int ncpus = 1024; ncpus <= (1 << 20); ncpus *= 4) {
    cpu_set_t* set = CPU_ALLOC(ncpus);
    if (set == nullptr) break;
    const size_t bytes = CPU_ALLOC_SIZE(ncpus);
    CPU_ZERO_S(bytes, set);
    const bool ok = sched_getaffinity(0, bytes, set) == 0;
    const int count = ok ? CPU_COUNT_S(bytes, set) : 0;
    CPU_FREE(set);
    if (ok) return std::max(count, 1);
    // EINVAL: the kernel's mask is wider than ours; retry with a larger one.
  }
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 1;
}

uint64_t ScratchBytes(int threads) {
  uint64_t bytes = std::max(kMinScratchBytes, kScratchBytesPerThread * threads);
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page_size > 0) {
    bytes = std::min(bytes, static_cast<uint64_t>(pages) * page_size / 8);
  }
  // A multiple of 16 KiB per thread: the halves (copy) and quarters (update) stay page-aligned.
  const uint64_t slab_unit = uint64_t{4} * 4096;
  const uint64_t slab = std::max(bytes / threads / slab_unit, uint64_t{1}) * slab_unit;
  return slab * threads;
}

void StreamTriad(float* __restrict a, const float* __restrict b, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) a[i] += 0.5f * b[i];
}

struct HostBandwidths {
  double copy = 0.0;
  double update = 0.0;
};

// Best of a few passes: the interesting number is what the memory system can do, and the
// slower passes are the ones disturbed by other processes.
template <typename Pass>
double BestBytesPerSecond(double bytes_per_pass, Pass&& pass) {
  double best_seconds = 0.0;
  for (int rep = 0; rep < kRepetitions; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    if (!pass()) return 0.0;
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    if (rep == 0 || took.count() < best_seconds) best_seconds = took.count();
  }
  return best_seconds > 0.0 ? bytes_per_pass / best_seconds : 0.0;
}

Result<HostBandwidths> MeasureHostBandwidths(int threads) {
  // ThreadPool reports a failure to start its threads by throwing; nothing may escape emsa.
  std::unique_ptr<ThreadPool> owned;
  try {
    owned = std::make_unique<ThreadPool>(threads);
  } catch (const std::exception& e) {
    return Status::OutOfMemory("could not start " + std::to_string(threads) +
                               " threads for the host bandwidth measurement (" + e.what() +
                               "); set ProfileOptions.threads lower");
  }
  ThreadPool& pool = *owned;
  const int workers = pool.size();
  const uint64_t total = ScratchBytes(workers);
  const int64_t count = static_cast<int64_t>(total / sizeof(float));
  const profile_internal::HostFloats scratch =
      profile_internal::TouchedHostFloats(pool, count, kClaimFloats);
  if (scratch == nullptr) {
    return Status::OutOfMemory("host bandwidth measurement could not allocate " +
                               std::to_string(total) +
                               " bytes of scratch; free memory or set measure_bandwidth=false");
  }
  float* const floats = scratch.get();

  HostBandwidths out;
  // In place, a += s*b over the two halves: every written line was just read, so no
  // write-allocate traffic hides in the count (a memcpy's stores read their lines first, so 2
  // bytes counted move 3). Work is claimed in runs, as the update's pool does, so that one
  // thread held up by the OS does not hold up the pass.
  const int64_t half = count / 2;
  out.copy = BestBytesPerSecond(12.0 * static_cast<double>(half), [&] {
    std::atomic<int64_t> next{0};
    pool.Run([&](int, int) {
      for (int64_t at; (at = next.fetch_add(kClaimFloats, std::memory_order_relaxed)) < half;) {
        StreamTriad(floats + at, floats + half + at, std::min(kClaimFloats, half - at));
      }
    });
    return true;
  });
  owned.reset();  // the update brings its own pool

  // The host tier's update itself: the same kernels, pool size (one core fewer than usable:
  // the last core launches the GPU's work) and scheduling as the host tier's CpuUpdater, on
  // four fp32 arrays (param, grad, two moments: 28 B per parameter moved).
  CpuUpdaterOptions options;
  options.threads = HostTierThreads(workers);
  Result<std::unique_ptr<CpuUpdater>> updater = CpuUpdater::Create(options);
  if (!updater.ok()) return updater.status();
  const int64_t n = count / 4;
  const HyperParams hyper;
  TensorUpdate t = profile_internal::FourArrayUpdate(floats, n, &hyper);
  const StepOptions step = profile_internal::NearestRounding();
  Status failed;
  out.update =
      BestBytesPerSecond(profile_internal::kFourArrayUpdateBytes * static_cast<double>(n), [&] {
        failed = (*updater)->Step(&t, 1, step);
        ++t.step;
        return failed.ok();
      });
  EMSA_RETURN_IF_ERROR(failed);
  return out;
}

}  // namespace

Result<CpuProfile> MeasureCpuProfile(const ProfileOptions& options) {
  if (options.threads < 0) {
    return Status::InvalidArgument(
        "ProfileOptions.threads must be >= 0 (0 = every allowed CPU), got " +
        std::to_string(options.threads));
  }
  CpuProfile cpu;
  cpu.model = CpuModel();
  cpu.logical_cores = LogicalCores();
  cpu.simd = DetectSimdLevel();
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page_size > 0) cpu.host_memory = static_cast<uint64_t>(pages) * page_size;
  if (options.measure_bandwidth) {
    const int threads = options.threads > 0 ? options.threads : cpu.logical_cores;
    EMSA_ASSIGN_OR_RETURN(HostBandwidths bw, MeasureHostBandwidths(threads));
    cpu.host_mem_bandwidth = bw.copy;
    cpu.host_update_bandwidth = bw.update;
  }
  return cpu;
}

}  // namespace emsa
