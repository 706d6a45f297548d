// host_dma_bench.cu — does the host tier's CPU update run faster when each gradient chunk has
// just arrived by DMA than when it landed long before? On hosts where the PCIe writes allocate in
// the last-level cache (Intel DDIO), a chunk read right after its copy comes from the cache and
// not from DRAM, and the delta the CPU writes may be read by the next upload from the cache too.
// The host tier's copies run ahead of the CPU (backward hands gradients over faster than the CPU
// updates them), so its gradients wait in DRAM; this measures what pacing the copies would gain.
//
// One pass = the update of --params fp32 parameters in chunks of --chunk elements, AdamW with the
// update written as a delta over the gradient (TensorUpdate::delta, as the host tier does):
//   cpu       the CPU update alone, gradients already in host memory (no DMA at all)
//   ahead     every chunk's gradient copy (D2H) enqueued at the start, the CPU following the
//             copies' events, each chunk's delta uploaded (H2D) once updated: the host tier's way
//   paced-W   the same, but chunk k+W's copy is enqueued only when the CPU has finished chunk k
// Modes are timed round by round (one pass of each per round, order rotating), median of --reps.
// Host memory moved per parameter: 24 B by the CPU (both moments read and written, the gradient
// read, the delta written), 8 B by the DMA (the gradient written, the delta read).
//
//   host_dma_bench [--params N] [--chunk ELEMENTS] [--windows 1,2,4] [--threads K]
//                  [--reps R] [--out FILE.json]
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "common/thread_pool.h"
#include "emsa/cpu_update.h"
#include "emsa/host_arena.h"

namespace {

__global__ void FillGradients(float* g, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    g[i] = (emsa_bench::Uniform(seed, i) - 0.5f) * 1e-2f;
  }
}

struct Setup {
  int64_t n = 0;
  int64_t chunk = 0;
  int64_t chunks = 0;
  emsa::CpuUpdater* updater = nullptr;
  std::vector<emsa::TensorUpdate> ups;  // one per chunk
  float* staging = nullptr;             // host: the gradient, then the delta over it
  float* d_grad = nullptr;              // device: the gradients
  float* d_delta = nullptr;             // device: where the deltas go up to
  cudaStream_t d2h = nullptr, h2d = nullptr;
  std::vector<cudaEvent_t> landed;  // one per chunk
};

int64_t ChunkNumel(const Setup& s, int64_t k) { return std::min(s.chunk, s.n - k * s.chunk); }

void CopyDown(Setup& s, int64_t k) {
  const size_t off = static_cast<size_t>(k * s.chunk);
  CHECK_CUDA(cudaMemcpyAsync(s.staging + off, s.d_grad + off, ChunkNumel(s, k) * sizeof(float),
                             cudaMemcpyDeviceToHost, s.d2h));
  CHECK_CUDA(cudaEventRecord(s.landed[static_cast<size_t>(k)], s.d2h));
}

void UpdateChunk(Setup& s, int64_t k) {
  CHECK_OK(s.updater->Step(&s.ups[static_cast<size_t>(k)], 1, emsa::StepOptions{}));
  ++s.ups[static_cast<size_t>(k)].step;
}

void CopyUp(Setup& s, int64_t k) {
  const size_t off = static_cast<size_t>(k * s.chunk);
  CHECK_CUDA(cudaMemcpyAsync(s.d_delta + off, s.staging + off, ChunkNumel(s, k) * sizeof(float),
                             cudaMemcpyHostToDevice, s.h2d));
}

// window 0: the CPU alone; window < 0: every copy ahead; else at most `window` chunks ahead.
double Pass(Setup& s, int window) {
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto start = std::chrono::steady_clock::now();
  if (window == 0) {
    for (int64_t k = 0; k < s.chunks; ++k) UpdateChunk(s, k);
  } else {
    const int64_t ahead = window < 0 ? s.chunks : window;
    int64_t issued = 0;
    for (; issued < std::min(ahead, s.chunks); ++issued) CopyDown(s, issued);
    for (int64_t k = 0; k < s.chunks; ++k) {
      CHECK_CUDA(cudaEventSynchronize(s.landed[static_cast<size_t>(k)]));
      UpdateChunk(s, k);
      CopyUp(s, k);
      if (issued < s.chunks) CopyDown(s, issued++);
    }
    CHECK_CUDA(cudaStreamSynchronize(s.h2d));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = int64_t{256} << 20;
  int64_t chunk = int64_t{4} << 20;
  std::string windows_arg = "1,2,4,16";
  int threads = std::max(1, static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)) - 1);
  int reps = 9;
  std::string out_path;
  if (!emsa_bench::ParseFlags(argc, argv,
                              {{"--params", [&](const char* v) { n = std::atoll(v); }},
                               {"--chunk", [&](const char* v) { chunk = std::atoll(v); }},
                               {"--windows", [&](const char* v) { windows_arg = v; }},
                               {"--threads", [&](const char* v) { threads = std::atoi(v); }},
                               {"--reps", [&](const char* v) { reps = std::atoi(v); }},
                               {"--out", [&](const char* v) { out_path = v; }}}) ||
      n < 1 || chunk < 64 || reps < 1 || threads < 1) {
    std::fprintf(stderr,
                 "usage: host_dma_bench [--params N] [--chunk ELEMENTS >= 64] [--windows 1,2,4] "
                 "[--threads K] [--reps R] [--out FILE.json]\n");
    return 2;
  }
  std::vector<int> windows;
  for (size_t at = 0; at < windows_arg.size();) {
    const size_t comma = std::min(windows_arg.find(',', at), windows_arg.size());
    const int w = std::atoi(windows_arg.substr(at, comma - at).c_str());
    if (w < 1) return std::fprintf(stderr, "--windows: positive chunk counts\n"), 2;
    windows.push_back(w);
    at = comma + 1;
  }

  emsa::CpuUpdaterOptions o;
  o.threads = threads;
  auto updater = emsa::CpuUpdater::Create(o);
  if (!updater.ok()) return std::fprintf(stderr, "%s\n", updater.status().ToString().c_str()), 1;
  emsa::ThreadPool& pool = (*updater)->pool();
  std::vector<std::unique_ptr<emsa::HostArena>> arenas;
  auto pinned = [&](size_t bytes) {
    auto a = emsa::HostArena::Create(bytes, true, &pool);
    if (!a.ok() || (*a)->kind() != emsa::HostArena::Kind::kPinned) {
      std::fprintf(stderr, "cannot pin %zu bytes\n", bytes);
      std::exit(1);
    }
    arenas.push_back(std::move(a).value());
    return static_cast<float*>(arenas.back()->data());
  };
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  Setup s;
  s.n = n;
  s.chunk = chunk;
  s.chunks = (n + chunk - 1) / chunk;
  s.updater = updater->get();
  s.staging = pinned(bytes);
  float* m = pinned(bytes);
  float* v = pinned(bytes);
  emsa_bench::Buffer d_grad(bytes), d_delta(bytes);
  s.d_grad = d_grad.f();
  s.d_delta = d_delta.f();
  FillGradients<<<1024, 256>>>(s.d_grad, n, 7);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaMemcpy(s.staging, s.d_grad, bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaStreamCreateWithFlags(&s.d2h, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&s.h2d, cudaStreamNonBlocking));
  s.landed.resize(static_cast<size_t>(s.chunks));
  for (auto& e : s.landed) CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  emsa::HyperParams hyper;  // the defaults; outlives the updates that point at it
  s.ups.resize(static_cast<size_t>(s.chunks));
  for (int64_t k = 0; k < s.chunks; ++k) {
    emsa::TensorUpdate& u = s.ups[static_cast<size_t>(k)];
    const size_t off = static_cast<size_t>(k * chunk);
    u.grad = s.staging + off;
    u.delta = s.staging + off;
    u.exp_avg = m + off;
    u.exp_avg_sq = v + off;
    u.numel = ChunkNumel(s, k);
    u.hyper = &hyper;
  }

  struct Mode {
    std::string name;
    int window;
    std::vector<double> seconds;
  };
  std::vector<Mode> modes = {{"cpu", 0, {}}, {"ahead", -1, {}}};
  for (int w : windows) modes.push_back({"paced-" + std::to_string(w), w, {}});
  for (Mode& md : modes) Pass(s, md.window);  // warm: pages, caches, the pool's threads
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < modes.size(); ++i) {
      Mode& md = modes[(i + static_cast<size_t>(r)) % modes.size()];
      md.seconds.push_back(Pass(s, md.window));
    }
  }

  std::printf("host_dma_bench: %lld fp32 params in %lld chunks of %lld, %d CPU threads, %d reps\n",
              static_cast<long long>(n), static_cast<long long>(s.chunks),
              static_cast<long long>(chunk), (*updater)->threads(), reps);
  std::printf("%-10s %9s %9s %10s %10s %8s\n", "mode", "median_ms", "min_ms", "cpu_GB/s",
              "host_GB/s", "vs_ahead");
  double ahead_ms = 0;
  emsa::json::Value results = emsa::json::Value::MakeArray();
  for (Mode& md : modes) {
    std::sort(md.seconds.begin(), md.seconds.end());
    const double med = md.seconds[md.seconds.size() / 2];
    if (md.window < 0) ahead_ms = med * 1e3;
  }
  for (const Mode& md : modes) {
    const double med = md.seconds[md.seconds.size() / 2];
    const double cpu_gbs = 24.0 * static_cast<double>(n) / med / 1e9;
    const double host_gbs = (md.window == 0 ? 24.0 : 32.0) * static_cast<double>(n) / med / 1e9;
    std::printf("%-10s %9.2f %9.2f %10.1f %10.1f %8.3f\n", md.name.c_str(), med * 1e3,
                md.seconds.front() * 1e3, cpu_gbs, host_gbs, med * 1e3 / ahead_ms);
    emsa::json::Value row = emsa::json::Value::MakeObject();
    row.Set("mode", md.name);
    row.Set("window_chunks", md.window);
    row.Set("median_ms", med * 1e3);
    row.Set("min_ms", md.seconds.front() * 1e3);
    row.Set("max_ms", md.seconds.back() * 1e3);
    row.Set("cpu_gb_per_s", cpu_gbs);
    row.Set("host_memory_gb_per_s", host_gbs);
    row.Set("over_ahead", med * 1e3 / ahead_ms);
    results.Push(std::move(row));
  }
  if (!out_path.empty()) {
    emsa::json::Value doc = emsa_bench::ResultDoc("host_dma", argc, argv);
    doc.Set("params", n);
    doc.Set("chunk", chunk);
    doc.Set("threads", (*updater)->threads());
    doc.Set("reps", reps);
    doc.Set("results", std::move(results));
    CHECK_OK(emsa::json::WriteFile(out_path, emsa::json::Write(doc)));
    std::printf("wrote %s\n", out_path.c_str());
  }
  for (auto& e : s.landed) CHECK_CUDA(cudaEventDestroy(e));
  CHECK_CUDA(cudaStreamDestroy(s.d2h));
  CHECK_CUDA(cudaStreamDestroy(s.h2d));
  return 0;
}
