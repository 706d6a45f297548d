// cpu_update_bench.cc — host-tier AdamW throughput: Gparam/s and GB/s for fp32 state (28 bytes
// per parameter moved) and bf16 state (20 bytes, nearest and stochastic rounding), each next to
// a trivial read-modify-write stream over the same arrays: the memory system's ceiling for this
// access pattern. Medians of --iters steps; first, how long MeasureCpuProfile takes. Not part
// of the test build.
//
//   cmake -S . -B build -DEMSA_BUILD_BENCH=ON && cmake --build build --target cpu_update_bench
//   (or: g++ -O3 -std=c++17 -Iinclude -Isrc bench/cpu_update_bench.cc build/libemsa_core.a
//   -lpthread) cpu_update_bench [--params N] [--tensors T] [--threads K] [--simd
//   scalar|avx2|avx512] [--iters I] [--memory plain|hostalloc]
//   [--guided MIN_ELEMENTS] [--range ELEMENTS] [--states all|fp32]
//
// --memory: where the arrays live, each a HostArena: plain huge-page memory (default), or
// cudaHostAlloc's pinned memory (4 KiB pages, as the host tier's arena; needs a CUDA build and
// device).
// --range: the step as consecutive CpuUpdater::StepRange calls of about ELEMENTS each (cut where
// StepRange accepts a cut), as the host tier updates one gradient bucket at a time; 0 (default):
// one Step over everything. Shows what the per-call fork, join and tail cost.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "emsa/cpu_update.h"
#include "emsa/host_arena.h"
#include "emsa/profile.h"

namespace {

struct Args {
  int64_t params = int64_t{64} << 20;
  int tensors = 64;
  int threads = 0;
  std::string simd = "avx512";
  int iters = 10;
  std::string memory = "plain";
  int64_t guided = emsa::CpuUpdater::kGuidedMinElements;  // SetGuidedScheduling
  int64_t range = 0;                                      // StepRange calls of this many
  bool bf16_states = true;                                // --states all: the bf16 rows too
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--params")
      a.params = std::atoll(v);
    else if (k == "--tensors")
      a.tensors = std::atoi(v);
    else if (k == "--threads")
      a.threads = std::atoi(v);
    else if (k == "--simd")
      a.simd = v;
    else if (k == "--iters")
      a.iters = std::atoi(v);
    else if (k == "--guided")
      a.guided = std::atoll(v);
    else if (k == "--range")
      a.range = std::atoll(v);
    else if (k == "--states" && (std::string(v) == "all" || std::string(v) == "fp32"))
      a.bf16_states = std::string(v) == "all";
    else if (k == "--memory" && (std::string(v) == "plain" || std::string(v) == "hostalloc"))
      a.memory = v;
    else
      std::fprintf(stderr, "unknown flag %s\n", k.c_str()), std::exit(2);
  }
  return a;
}

// A HostArena of the kind --memory names, zero-filled by the pool's workers.
void* Alloc(size_t bytes, emsa::ThreadPool& pool, const std::string& memory,
            std::vector<std::unique_ptr<emsa::HostArena>>& keep) {
  const bool pinned = memory != "plain";
  auto arena = emsa::HostArena::Create(bytes, pinned, &pool);
  if (!arena.ok()) std::fprintf(stderr, "%s\n", arena.status().ToString().c_str()), std::exit(1);
  if (pinned && (*arena)->kind() != emsa::HostArena::Kind::kPinned) {
    std::fprintf(stderr, "--memory %s: no usable CUDA device to pin with\n", memory.c_str());
    std::exit(1);
  }
  keep.push_back(std::move(arena).value());
  return keep.back()->data();
}

// This process's anonymous memory on transparent huge pages, in MiB (Linux; -1 if unreadable):
// whether the arrays really sit on huge pages, pinned or not.
long AnonHugeMiB() {
  std::FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (f == nullptr) return -1;
  char line[256];
  long kib = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "AnonHugePages: %ld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib < 0 ? -1 : kib / 1024;
}

// p += g, m += 1, v += 1 over [b, e): the update's memory traffic without its arithmetic.
void Touch(float* __restrict p, const float* __restrict g, char* m, char* v, size_t ss, int64_t b,
           int64_t e) {
  if (ss == 4) {
    float* __restrict mf = reinterpret_cast<float*>(m);
    float* __restrict vf = reinterpret_cast<float*>(v);
    for (int64_t i = b; i < e; ++i) p[i] += g[i], mf[i] += 1.0f, vf[i] += 1.0f;
  } else {
    uint16_t* __restrict mh = reinterpret_cast<uint16_t*>(m);
    uint16_t* __restrict vh = reinterpret_cast<uint16_t*>(v);
    for (int64_t i = b; i < e; ++i) p[i] += g[i], mh[i] += 1, vh[i] += 1;
  }
}

template <typename Fn>
double MedianSeconds(int iters, Fn&& fn) {
  fn();  // warm: page tables, caches, worker wake-up
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void Run(emsa::CpuUpdater& updater, const Args& a, emsa::DType state, emsa::Rounding rounding,
         const char* label) {
  emsa::ThreadPool& pool = updater.pool();
  const int64_t n = a.params;
  const size_t ss = emsa::DTypeSize(state);
  std::vector<std::unique_ptr<emsa::HostArena>> arenas;
  float* param = static_cast<float*>(Alloc(n * 4, pool, a.memory, arenas));
  float* grad = static_cast<float*>(Alloc(n * 4, pool, a.memory, arenas));
  char* m = static_cast<char*>(Alloc(n * ss, pool, a.memory, arenas));
  char* v = static_cast<char*>(Alloc(n * ss, pool, a.memory, arenas));
  pool.ParallelFor(n, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      param[i] = 0.5f;
      grad[i] = 1e-3f * static_cast<float>((i * 2654435761u) % 1000);
    }
  });
  emsa::HyperParams hyper;
  std::vector<emsa::TensorUpdate> ups(static_cast<size_t>(a.tensors));
  const int64_t per = n / a.tensors;
  for (int t = 0; t < a.tensors; ++t) {
    const int64_t off = per * t;
    emsa::TensorUpdate& u = ups[static_cast<size_t>(t)];
    u.param = param + off;
    u.grad = grad + off;
    u.exp_avg = m + off * ss;
    u.exp_avg_sq = v + off * ss;
    u.numel = t == a.tensors - 1 ? n - off : per;
    u.state_dtype = state;
    u.step = 1;
    u.hyper = &hyper;
  }
  emsa::StepOptions options;
  options.rounding = rounding;
  const double sec = MedianSeconds(a.iters, [&] {
    emsa::Status s;
    if (a.range <= 0) {
      s = updater.Step(ups.data(), ups.size(), options);
    } else {
      for (int64_t first = 0; first < n && s.ok();) {
        const int64_t last = n - first <= a.range ? n
                                                  : emsa::CpuUpdater::Aligned(
                                                        ups.data(), ups.size(), first + a.range);
        s = updater.StepRange(ups.data(), ups.size(), options, first, last);
        first = last;
      }
    }
    if (!s.ok()) std::fprintf(stderr, "%s\n", s.ToString().c_str()), std::exit(1);
    for (auto& u : ups) ++u.step;
  });
  const double bytes = static_cast<double>(n) * (12 + 4 * ss);  // p,g in; p out; m,v in+out
  std::printf("%-24s %7.3f Gparam/s  %7.1f GB/s  (%.2f ms per step; %ld MiB on huge pages)\n",
              label, n / sec / 1e9, bytes / sec / 1e9, sec * 1e3, AnonHugeMiB());

  // The ceiling: the same streams, read and written once each, with next to no arithmetic.
  const double stream_sec = MedianSeconds(a.iters, [&] {
    pool.ParallelFor(n, 4096, [&](int64_t b, int64_t e) { Touch(param, grad, m, v, ss, b, e); });
  });
  std::printf("%-24s %7.3f Gparam/s  %7.1f GB/s  (plain stream, same bytes)\n", "  ceiling",
              n / stream_sec / 1e9, bytes / stream_sec / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  auto level = emsa::ParseSimdLevel(a.simd);
  if (!level.ok()) return std::fprintf(stderr, "%s\n", level.status().ToString().c_str()), 2;
  emsa::CpuUpdaterOptions o;
  o.threads = a.threads;
  o.max_simd = *level;
  auto updater = emsa::CpuUpdater::Create(o);
  if (!updater.ok()) return std::fprintf(stderr, "%s\n", updater.status().ToString().c_str()), 1;
  const emsa::Status guided = (*updater)->SetGuidedScheduling(a.guided);
  if (!guided.ok()) return std::fprintf(stderr, "%s\n", guided.ToString().c_str()), 2;
  std::printf(
      "AdamW, %lld params in %d tensors, %d threads, %s, %s memory, guided %lld, range %lld\n",
      static_cast<long long>(a.params), a.tensors, (*updater)->threads(),
      emsa::SimdLevelName((*updater)->simd()), a.memory.c_str(), static_cast<long long>(a.guided),
      static_cast<long long>(a.range));
  const auto profile_start = std::chrono::steady_clock::now();
  const bool profiled = emsa::MeasureCpuProfile().ok();
  std::printf(
      "CPU profile (MeasureCpuProfile) %s in %.0f ms\n", profiled ? "measured" : "failed",
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - profile_start)
          .count());
  Run(**updater, a, emsa::DType::kFloat32, emsa::Rounding::kNearest, "fp32 param+state");
  if (!a.bf16_states) return 0;
  Run(**updater, a, emsa::DType::kBFloat16, emsa::Rounding::kNearest, "bf16 state, nearest");
  Run(**updater, a, emsa::DType::kBFloat16, emsa::Rounding::kStochastic, "bf16 state, stochastic");
  return 0;
}
