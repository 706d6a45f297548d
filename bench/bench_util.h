// bench_util.h — what the device benchmarks share: fail-fast checks, flag parsing, the UTC
// timestamp, device buffers and event timing.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/json.h"
#include "emsa/status.h"

#define CHECK_CUDA(call)                                                 \
  do {                                                                   \
    const cudaError_t err_ = (call);                                     \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(err_));                            \
      std::exit(2);                                                      \
    }                                                                    \
  } while (0)

#define CHECK_OK(expr)                                                                           \
  do {                                                                                           \
    const ::emsa::Status s_ = (expr);                                                            \
    if (!s_.ok()) {                                                                              \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, s_.ToString().c_str()); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

namespace emsa_bench {

// One `--name value` option and what to do with its value.
struct Flag {
  const char* name;
  std::function<void(const char*)> set;
};
// Applies the `--name value` pairs of argv; false on an unknown name or a missing value.
inline bool ParseFlags(int argc, char** argv, std::initializer_list<Flag> flags) {
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) return false;
    const Flag* match = nullptr;
    for (const Flag& f : flags) {
      if (argv[i] == std::string(f.name)) match = &f;
    }
    if (match == nullptr) return false;
    match->set(argv[i + 1]);
  }
  return true;
}

inline std::string UtcNow() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return buf;
}

// What produced a run, for its JSON: the commit (EMSA_COMMIT, which scripts/gpu-check passes on;
// the GPU host's copy of the tree has no .git) and the command line.
inline std::string Commit() {
  const char* c = std::getenv("EMSA_COMMIT");
  return c != nullptr && *c != '\0' ? c : "unknown (EMSA_COMMIT not set)";
}
inline std::string Command(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) out += (i > 0 ? " " : "") + std::string(argv[i]);
  return out;
}

// A uniform float in [0, 1) from a hash (splitmix64) of (seed, index): fills that are the same
// on every run and never need host memory.
__device__ __forceinline__ float Uniform(uint64_t seed, int64_t i) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * 0x1.0p-24f;  // [0, 1)
}

// A result document's opening: which benchmark, when, at which commit, by which command.
inline emsa::json::Value ResultDoc(const char* benchmark, int argc, char** argv) {
  emsa::json::Value doc = emsa::json::Value::MakeObject();
  doc.Set("benchmark", benchmark);
  doc.Set("date", UtcNow());
  doc.Set("commit", Commit());
  doc.Set("command", Command(argc, argv));
  return doc;
}

// Device memory freed at scope end.
struct Buffer {
  void* ptr = nullptr;
  explicit Buffer(size_t bytes) { CHECK_CUDA(cudaMalloc(&ptr, bytes)); }
  ~Buffer() {
    if (ptr != nullptr) (void)cudaFree(ptr);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  float* f() const { return static_cast<float*>(ptr); }
};

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
};

// Runs fn() `warmup` times, then `reps` times each between two events on `stream`; the median,
// min and max of those.
template <typename Fn>
Timing Time(cudaStream_t stream, int warmup, int reps, Fn&& fn) {
  cudaEvent_t start = nullptr, stop = nullptr;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) fn();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    fn();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back()};
}

}  // namespace emsa_bench
