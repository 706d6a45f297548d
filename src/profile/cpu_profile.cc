// cpu_profile.cc — the CPU half of the device profile: model, usable cores, SIMD level, and two
// measured host-memory bandwidths (a streaming copy, and an Adam-shaped pass that predicts the
// host tier's update speed).
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

#include "emsa/host_tier.h"
#include "emsa/profile.h"
#include "engine/thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace emsa {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kHugePage = 2 * kMiB;
// Scratch size: several times the L3 of one CCD or socket (a sweep over more than the cache
// gets almost no hits), 32 MiB per thread on many-core hosts, at most an eighth of RAM so that
// small machines are not pushed into swap. Not derived from sysconf's L3 size: VMs report the
// host's, not the slice they get. Bigger only costs time: the first touch of fresh pages
// dominates the measurement, and on a VM it is several times slower than on metal.
constexpr uint64_t kMinScratchBytes = 256 * kMiB;
constexpr uint64_t kScratchBytesPerThread = 32 * kMiB;
constexpr int kRepetitions = 4;

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
  // Each thread owns a slab split in halves (copy) and quarters (update), all page-aligned.
  const uint64_t slab_unit = uint64_t{4} * 4096;
  const uint64_t slab = std::max(bytes / threads / slab_unit, uint64_t{1}) * slab_unit;
  return slab * threads;
}

// The Adam shape: 4 fp32 streams read, 3 written back in place. The arithmetic stands in for
// the real update without sqrt: with math-errno (the default) the compiler will not vectorize
// sqrtf, and a scalar sqrt would time the square-root unit instead of the memory system.
void AdamShapedPass(float* __restrict param, const float* __restrict grad,
                    float* __restrict exp_avg, float* __restrict exp_avg_sq, uint64_t n) {
  const float beta1 = 0.9f, beta2 = 0.999f, lr = 1e-3f, eps = 1e-8f, weight_decay = 1e-2f;
  for (uint64_t i = 0; i < n; ++i) {
    const float m = beta1 * exp_avg[i] + (1.0f - beta1) * grad[i];
    const float v = beta2 * exp_avg_sq[i] + (1.0f - beta2) * grad[i] * grad[i];
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] -= lr * (m / (v + eps) + weight_decay * param[i]);
  }
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
template <typename Fn>
double BestBytesPerSecond(ThreadPool& pool, double bytes_per_pass, Fn&& pass) {
  double best_seconds = 0.0;
  for (int rep = 0; rep < kRepetitions; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    pool.Run(pass);
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
  const uint64_t slab = total / workers;
  const uint64_t alloc_bytes = (total + kHugePage - 1) / kHugePage * kHugePage;
  char* scratch = static_cast<char*>(std::aligned_alloc(kHugePage, alloc_bytes));
  if (scratch == nullptr) {
    return Status::OutOfMemory("host bandwidth measurement could not allocate " +
                               std::to_string(alloc_bytes) +
                               " bytes of scratch; free memory or set measure_bandwidth=false");
  }
  // Huge pages shorten the first touch and match the host arena, which asks for them too.
  (void)madvise(scratch, alloc_bytes, MADV_HUGEPAGE);

  // Each worker touches, and later streams through, only its own slab, so on a NUMA host the
  // pages sit on the node of the thread that uses them.
  pool.Run([&](int index, int) { std::memset(scratch + index * slab, 0, slab); });

  HostBandwidths out;
  const uint64_t half = slab / 2;
  // In place, a += s*b: every written line was just read, so no write-allocate traffic hides
  // in the count (a memcpy's stores read their lines first, so 2 bytes counted move 3). This
  // is the pattern of an optimizer update, which writes back what it read.
  const uint64_t m = half / sizeof(float);
  out.copy = BestBytesPerSecond(pool, 12.0 * m * workers, [&](int index, int) {
    float* a = reinterpret_cast<float*>(scratch + index * slab);
    StreamTriad(a, a + m, m);
  });
  // The update runs on one core fewer, as the host tier's pool does (the last core launches the
  // GPU's work): with the pass limited by each core's outstanding misses, the core left out is
  // worth ~1/workers of the bandwidth, which the plan must not count on.
  const uint64_t n = slab / 4 / sizeof(float);
  const int updaters = HostTierThreads(workers);
  out.update = BestBytesPerSecond(pool, 28.0 * n * updaters, [&](int index, int) {
    if (index >= updaters) return;
    float* base = reinterpret_cast<float*>(scratch + index * slab);
    AdamShapedPass(base, base + n, base + 2 * n, base + 3 * n, n);
  });
  std::free(scratch);
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
  if (options.measure_bandwidth) {
    const int threads = options.threads > 0 ? options.threads : cpu.logical_cores;
    EMSA_ASSIGN_OR_RETURN(HostBandwidths bw, MeasureHostBandwidths(threads));
    cpu.host_mem_bandwidth = bw.copy;
    cpu.host_update_bandwidth = bw.update;
  }
  return cpu;
}

}  // namespace emsa
