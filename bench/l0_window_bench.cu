// l0_window_bench.cu — tier L0, measured honestly: does a persisting-L2 window over the hottest
// optimizer state make a training step faster, once the forward and backward's own traffic
// runs between two updates?
//
//   l0_window_bench [--out PATH] [--rounds N] [--reps N] [--traffic-mib M] [--rest-m N]
//
// One "step" is, on one stream, timed with events between each part:
//   traffic   a kernel streaming --traffic-mib MiB in and out (a += 0.5 b over two buffers), in
//             place of the forward and backward: it sweeps L2, evicting whatever does not persist;
//   hot       the fp32 AdamW update of the hot set: as many parameters as the window's reserve
//             holds of their two moments (one contiguous range, as emsa's arena lays them out);
//   rest      the update of --rest-m million more parameters (the rest of the model's state).
// Window off and on alternate by round (--rounds, --reps steps each, after a warm-up step): on,
// an L2Window (3/16 of L2, hitRatio = reserve / window) is reserved and the hot table launched
// with it; off, the set-aside is released (cudaCtxResetPersistingL2Cache) and the table launched
// plainly. Reported: the median of each part and of the whole step, on and off, and their
// differences: the gain on the hot update and what the set-aside costs the traffic and the rest.
// The results of both are the same bits (tests/cpp/cuda_update_test.cc checks it).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "common/json.h"
#include "emsa/cuda_update.h"
#include "memory/l2_window.h"

namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

__global__ void Traffic(float* __restrict a, const float* __restrict b, uint64_t n) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    a[i] += 0.5f * b[i];
  }
}

// Fills n floats in [lo, hi) from a hash of (seed, index): never zeros, never a constant.
__global__ void Fill(float* p, uint64_t n, uint32_t seed, float lo, float hi) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 0x9E3779B9u ^ seed * 0x85EBCA6Bu;
    x ^= x >> 15;
    x *= 0x2C1B3C6Du;
    x ^= x >> 12;
    p[i] = lo + (hi - lo) * static_cast<float>(x >> 8) / 16777216.0f;
  }
}

float* Device(uint64_t floats, uint32_t seed, float lo, float hi) {
  float* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, floats * sizeof(float)));
  Fill<<<1024, 256>>>(p, floats, seed, lo, hi);
  CHECK_CUDA(cudaGetLastError());
  return p;
}

// One fp32 AdamW table over n parameters whose two moments sit back to back in `moments`
// (exp_avg then exp_avg_sq, as one contiguous range for the window).
struct Set {
  uint64_t n = 0;
  float *param = nullptr, *grad = nullptr, *moments = nullptr;
  std::unique_ptr<emsa::DeviceUpdateTable> table;

  Set(uint64_t count, uint32_t seed) : n(count) {
    param = Device(n, seed, 0.5f, 1.5f);
    grad = Device(n, seed + 1, 1e-4f, 2e-2f);
    moments = Device(2 * n, seed + 2, 1e-8f, 1e-3f);
    emsa::TensorUpdate t;
    t.param = param;
    t.grad = grad;
    t.exp_avg = moments;
    t.exp_avg_sq = moments + n;
    t.numel = static_cast<int64_t>(n);
    auto made = emsa::DeviceUpdateTable::Create(&t, nullptr, 1, emsa::DeviceTableOptions{});
    CHECK_OK(made.status());
    table = std::move(*made);
  }
  ~Set() {
    table.reset();
    for (float* p : {param, grad, moments}) (void)cudaFree(p);
  }
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Parts {
  std::vector<double> traffic, hot, rest, step;
};

int Usage() {
  std::fprintf(stderr,
               "usage: l0_window_bench [--out PATH] [--rounds N] [--reps N] [--traffic-mib M] "
               "[--rest-m N]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out;
  int rounds = 6, reps = 20;
  uint64_t traffic_mib = 2048, rest_m = 200;
  if (!emsa_bench::ParseFlags(
          argc, argv,
          {{"--out", [&](const char* v) { out = v; }},
           {"--rounds", [&](const char* v) { rounds = std::atoi(v); }},
           {"--reps", [&](const char* v) { reps = std::atoi(v); }},
           {"--traffic-mib", [&](const char* v) { traffic_mib = std::strtoull(v, nullptr, 10); }},
           {"--rest-m", [&](const char* v) { rest_m = std::strtoull(v, nullptr, 10); }}})) {
    return Usage();
  }
  if (rounds < 1 || reps < 1 || traffic_mib == 0) return Usage();

  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  auto limits = emsa::QueryL2Limits(device);
  CHECK_OK(limits.status());
  // The hot set: as many parameters as the reserve holds of their 8 bytes of moments.
  const uint64_t cap = std::min<uint64_t>(limits->max_persisting_bytes,
                                          static_cast<uint64_t>(limits->l2_bytes * 3.0 / 16.0));
  if (cap == 0) {
    std::printf("no persisting L2 on %s (MIG or an older GPU): tier L0 cannot run here\n",
                prop.name);
    return 0;
  }
  const uint64_t hot_n = cap / 8 / 64 * 64;
  Set hot(hot_n, 10), rest(rest_m * 1000000, 20);
  const uint64_t traffic_n = traffic_mib * kMiB / sizeof(float) / 2;
  float* ta = Device(traffic_n, 30, -1.0f, 1.0f);
  float* tb = Device(traffic_n, 31, -1.0f, 1.0f);

  emsa::HyperParams hyper;
  auto scalars = emsa::DeviceScalars::Create(&hyper, 1);
  CHECK_OK(scalars.status());
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_OK((*scalars)->SetInputs(1.0f, 0.0f, 7, stream));
  CHECK_OK((*scalars)->BeginStep(stream));
  CHECK_OK((*scalars)->AdvanceSteps(stream));
  CHECK_CUDA(cudaDeviceSynchronize());

  cudaEvent_t ev[4];
  for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  const auto step = [&](Parts* parts) {
    CHECK_CUDA(cudaEventRecord(ev[0], stream));
    Traffic<<<prop.multiProcessorCount * 8, 256, 0, stream>>>(ta, tb, traffic_n);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaEventRecord(ev[1], stream));
    CHECK_OK(hot.table->Update(**scalars, stream));
    CHECK_CUDA(cudaEventRecord(ev[2], stream));
    CHECK_OK(rest.table->Update(**scalars, stream));
    CHECK_CUDA(cudaEventRecord(ev[3], stream));
    CHECK_CUDA(cudaEventSynchronize(ev[3]));
    if (parts == nullptr) return;
    float t[3], all = 0;
    for (int k = 0; k < 3; ++k) CHECK_CUDA(cudaEventElapsedTime(&t[k], ev[k], ev[k + 1]));
    CHECK_CUDA(cudaEventElapsedTime(&all, ev[0], ev[3]));
    parts->traffic.push_back(t[0]);
    parts->hot.push_back(t[1]);
    parts->rest.push_back(t[2]);
    parts->step.push_back(all);
  };

  Parts off, on;
  uint64_t granted = 0;
  float hit_ratio = 0;
  for (int r = 0; r < rounds; ++r) {
    for (const bool use : {false, true}) {
      std::unique_ptr<emsa::L2Window> window;
      if (use) {
        auto w = emsa::L2Window::EnableFor(device, hot.moments, hot_n * 8);
        CHECK_OK(w.status());
        window = std::move(*w);
        granted = window->granted_bytes();
        hit_ratio = window->window().hitRatio;
        CHECK_OK(hot.table->SetAccessWindow({hot.moments, hot_n * 8, hit_ratio}));
      } else {
        CHECK_OK(hot.table->SetAccessWindow({}));
      }
      step(nullptr);  // warm-up: on, it marks the window's lines persisting
      for (int i = 0; i < reps; ++i) step(use ? &on : &off);
      CHECK_OK(hot.table->SetAccessWindow({}));
      window.reset();  // demotes the persisting lines and restores the limit
    }
  }

  const double hot_bytes = 28.0 * static_cast<double>(hot_n);
  const auto ms = [](const std::vector<double>& v) { return Median(v); };
  std::printf(
      "tier L0 A/B on %s: L2 %.1f MiB, persisting max %.1f MiB, reserve granted %.2f MiB, "
      "hitRatio %.3f\n",
      prop.name, limits->l2_bytes / double(kMiB), limits->max_persisting_bytes / double(kMiB),
      granted / double(kMiB), hit_ratio);
  std::printf(
      "hot set %.2f M params (%.2f MiB of moments), rest %.0f M params, traffic %llu MiB "
      "in+out; %d rounds x %d steps each way\n",
      hot_n / 1e6, hot_n * 8 / double(kMiB), rest.n / 1e6,
      static_cast<unsigned long long>(traffic_mib), rounds, reps);
  std::printf("%-10s %12s %12s %12s\n", "part", "off ms", "on ms", "on - off us");
  const char* names[] = {"traffic", "hot", "rest", "step"};
  const std::vector<double>* a[] = {&off.traffic, &off.hot, &off.rest, &off.step};
  const std::vector<double>* b[] = {&on.traffic, &on.hot, &on.rest, &on.step};
  emsa::json::Value parts = emsa::json::Value::MakeObject();
  for (int k = 0; k < 4; ++k) {
    const double x = ms(*a[k]), y = ms(*b[k]);
    std::printf("%-10s %12.4f %12.4f %12.1f\n", names[k], x, y, (y - x) * 1e3);
    emsa::json::Value row = emsa::json::Value::MakeObject();
    row.Set("off_median_ms", x);
    row.Set("on_median_ms", y);
    row.Set("on_minus_off_us", (y - x) * 1e3);
    parts.Set(names[k], std::move(row));
  }
  std::printf("hot update: %.1f GB/s off, %.1f GB/s on (28 B/param)\n",
              hot_bytes / (ms(off.hot) * 1e-3) / 1e9, hot_bytes / (ms(on.hot) * 1e-3) / 1e9);

  if (!out.empty()) {
    emsa::json::Value root = emsa_bench::ResultDoc("l0-window", argc, argv);
    root.Set("device", std::string(prop.name));
    root.Set("l2_bytes", static_cast<double>(limits->l2_bytes));
    root.Set("reserve_granted_bytes", static_cast<double>(granted));
    root.Set("hit_ratio", static_cast<double>(hit_ratio));
    root.Set("hot_params", static_cast<double>(hot_n));
    root.Set("rest_params", static_cast<double>(rest.n));
    root.Set("traffic_bytes", static_cast<double>(traffic_mib * kMiB));
    root.Set("rounds", rounds);
    root.Set("reps", reps);
    root.Set("parts", std::move(parts));
    CHECK_OK(emsa::json::WriteFile(out, emsa::json::Write(root)));
    std::printf("wrote %s\n", out.c_str());
  }
  for (cudaEvent_t e : ev) (void)cudaEventDestroy(e);
  (void)cudaFree(ta);
  (void)cudaFree(tb);
  (void)cudaStreamDestroy(stream);
  return 0;
}
