// cuda_update_bench.cu — the device tier's fused update at Llama-1.1B shapes, against a
// device-to-device copy measured in the same run.
//
//   cuda_update_bench [--out PATH] [--reps N] [--warmup N] [--variants LIST] [--bucket-mib M]
//
// The parameter set is TinyLlama-1.1B's (hidden 2048, 22 layers, intermediate 5632, vocab 32000,
// 32 heads / 4 kv heads, untied head): 1,100,048,384 parameters in 201 tensors, laid out as
// emsa's arena does (one buffer per stream, tensors 64-element aligned), filled with hashed
// random values (never zeros). Each variant is timed three ways: the whole set as one table
// (one launch), bucketed into tables of --bucket-mib MiB of parameters (one launch per bucket),
// and the same buckets replayed from a captured CUDA graph. Times are the median over --reps
// after --warmup, between cudaEvents; bandwidth counts each stream once read and once written
// (DeviceUpdateTable::bytes_per_update), compared with cudaMemcpyAsync of a 2 GiB buffer
// (read + written). The gradient statistics pass (a read of the grads) is timed too.
//
// Variants (all AdamW unless named): fp32 (28 B/param), fp32-bf16state (20 B), amp (bf16
// param and grad, fp32 master and states: 28 B), bf16 (bf16 param, grad and states, stochastic
// rounding: 14 B), lion-fp32 (20 B).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "common/json.h"
#include "emsa/cuda_update.h"

namespace {

using emsa_bench::Buffer;
using emsa_bench::Time;
using emsa_bench::Timing;
using emsa_bench::Uniform;

using emsa::DType;
using emsa::OptimizerKind;

// ---- the parameter set -----------------------------------------------------------------------

std::vector<int64_t> LlamaShapes() {
  constexpr int64_t kHidden = 2048, kLayers = 22, kInter = 5632, kVocab = 32000;
  constexpr int64_t kHeads = 32, kKvHeads = 4, kKv = kHidden / kHeads * kKvHeads;
  std::vector<int64_t> numel = {kVocab * kHidden};  // embedding
  for (int64_t l = 0; l < kLayers; ++l) {
    for (int64_t n : {kHidden, kHidden * kHidden, kKv * kHidden, kKv * kHidden, kHidden * kHidden,
                      kHidden, kInter * kHidden, kInter * kHidden, kHidden * kInter}) {
      numel.push_back(n);
    }
  }
  numel.push_back(kHidden);           // final norm
  numel.push_back(kVocab * kHidden);  // untied head
  return numel;
}

struct Variant {
  const char* name;
  OptimizerKind optimizer;
  DType param, grad, state;
  bool master;
};

const Variant kVariants[] = {
    {"fp32", OptimizerKind::kAdamW, DType::kFloat32, DType::kFloat32, DType::kFloat32, false},
    {"fp32-bf16state", OptimizerKind::kAdamW, DType::kFloat32, DType::kFloat32, DType::kBFloat16,
     false},
    {"amp", OptimizerKind::kAdamW, DType::kBFloat16, DType::kBFloat16, DType::kFloat32, true},
    {"bf16", OptimizerKind::kAdamW, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, false},
    {"lion-fp32", OptimizerKind::kLion, DType::kFloat32, DType::kFloat32, DType::kFloat32, false},
};

// ---- random fill on the device ------------------------------------------------------------------

// x in +-[lo, hi) (or [lo, hi) when !sign), stored as `dtype`.
__global__ void FillKernel(void* out, int dtype, int64_t n, uint64_t seed, float lo, float hi,
                           bool sign) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const float u = Uniform(seed, i);
    float x = lo + (hi - lo) * u;
    if (sign && (Uniform(seed ^ 0x5555, i) < 0.5f)) x = -x;
    if (dtype == static_cast<int>(DType::kFloat32)) {
      static_cast<float*>(out)[i] = x;
    } else if (dtype == static_cast<int>(DType::kBFloat16)) {
      static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x);
    } else {
      static_cast<__half*>(out)[i] = __float2half_rn(x);
    }
  }
}

void Fill(void* out, DType dtype, int64_t n, uint64_t seed, float lo, float hi, bool sign) {
  if (n == 0) return;
  FillKernel<<<1024, 256>>>(out, static_cast<int>(dtype), n, seed, lo, hi, sign);
  CHECK_CUDA(cudaGetLastError());
}

// ---- device buffers
// ------------------------------------------------------------------------------

// ---- one variant
// ------------------------------------------------------------------------------------

struct Row {
  std::string variant, mode;
  double bytes_per_param = 0;
  int launches = 0;
  Timing t;
  double bytes = 0;
};

constexpr int64_t kAlign = 64;  // elements: 256 bytes of fp32, 128 of bf16

int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

void RunVariant(const Variant& v, const std::vector<int64_t>& shapes, int warmup, int reps,
                int64_t bucket_bytes, cudaStream_t stream, std::vector<Row>* rows) {
  int64_t total = 0, padded = 0;
  std::vector<int64_t> offset;
  for (int64_t n : shapes) {
    offset.push_back(padded);
    padded += AlignUp(n);
    total += n;
  }
  const bool lion = v.optimizer == OptimizerKind::kLion;
  const size_t bytes_needed = static_cast<size_t>(padded) *
                              (emsa::DTypeSize(v.param) + emsa::DTypeSize(v.grad) +
                               emsa::DTypeSize(v.state) * (lion ? 1 : 2) + (v.master ? 4 : 0));
  size_t free_bytes = 0, total_bytes = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (bytes_needed + (size_t{1} << 30) > free_bytes) {
    std::printf("%-16s skipped: needs %.1f GB, %.1f GB free\n", v.name, bytes_needed / 1e9,
                free_bytes / 1e9);
    return;
  }
  const auto n = static_cast<size_t>(padded);
  Buffer param(n * emsa::DTypeSize(v.param)), grad(n * emsa::DTypeSize(v.grad));
  Buffer exp_avg(n * emsa::DTypeSize(v.state));
  std::unique_ptr<Buffer> exp_avg_sq, master;
  if (!lion) exp_avg_sq = std::make_unique<Buffer>(n * emsa::DTypeSize(v.state));
  if (v.master) master = std::make_unique<Buffer>(n * 4);
  Fill(param.ptr, v.param, padded, 1, 0.5f, 1.5f, true);
  Fill(grad.ptr, v.grad, padded, 2, 1e-4f, 2e-2f, true);
  Fill(exp_avg.ptr, v.state, padded, 3, 1e-5f, 1e-2f, true);
  if (exp_avg_sq) Fill(exp_avg_sq->ptr, v.state, padded, 4, 1e-8f, 2e-4f, false);
  if (master) Fill(master->ptr, DType::kFloat32, padded, 5, 0.5f, 1.5f, true);
  CHECK_CUDA(cudaDeviceSynchronize());

  std::vector<emsa::TensorUpdate> tensors(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    emsa::TensorUpdate& t = tensors[i];
    const int64_t at = offset[i];
    t.numel = shapes[i];
    t.param_dtype = v.param;
    t.grad_dtype = v.grad;
    t.state_dtype = v.state;
    t.param = static_cast<char*>(param.ptr) + at * emsa::DTypeSize(v.param);
    t.grad = static_cast<char*>(grad.ptr) + at * emsa::DTypeSize(v.grad);
    t.exp_avg = static_cast<char*>(exp_avg.ptr) + at * emsa::DTypeSize(v.state);
    t.exp_avg_sq =
        exp_avg_sq ? static_cast<char*>(exp_avg_sq->ptr) + at * emsa::DTypeSize(v.state) : nullptr;
    t.master = master ? static_cast<float*>(master->ptr) + at : nullptr;
  }
  emsa::HyperParams hyper;
  if (lion) hyper.lr = 1e-4f;
  auto scalars = emsa::DeviceScalars::Create(&hyper, 1);
  CHECK_OK(scalars.status());
  emsa::DeviceScalars& s = **scalars;
  CHECK_OK(s.SetInputs(1.0f, 0.0f, 1234, stream));
  CHECK_OK(s.BeginStep(stream));
  CHECK_OK(s.AdvanceSteps(stream));
  emsa::DeviceTableOptions options;
  options.optimizer = v.optimizer;

  // Whole set, one table.
  auto whole = emsa::DeviceUpdateTable::Create(tensors.data(), nullptr, tensors.size(), options);
  CHECK_OK(whole.status());
  emsa::DeviceUpdateTable& table = **whole;
  const double bpp = static_cast<double>(table.bytes_per_update()) / static_cast<double>(total);
  Row row{v.name, "whole", bpp, table.launches_per_update(), {}, 0};
  row.t = Time(stream, warmup, reps, [&] { CHECK_OK(table.Update(s, stream)); });
  row.bytes = static_cast<double>(table.bytes_per_update());
  rows->push_back(row);

  // Gradient statistics: one read of the grads.
  Row stats{v.name, "grad-stats", static_cast<double>(emsa::DTypeSize(v.grad)), 1, {}, 0};
  stats.t = Time(stream, warmup, reps, [&] {
    CHECK_OK(s.BeginStep(stream));
    CHECK_OK(table.AccumulateGradStats(s, stream));
  });
  stats.bytes = static_cast<double>(total) * static_cast<double>(emsa::DTypeSize(v.grad));
  rows->push_back(stats);

  // Buckets of about bucket_bytes of parameters, in order; a larger tensor is its own bucket.
  std::vector<std::unique_ptr<emsa::DeviceUpdateTable>> buckets;
  uint64_t bucket_total = 0;
  for (size_t first = 0; first < tensors.size();) {
    size_t last = first;
    int64_t bytes = 0;
    while (last < tensors.size() &&
           (last == first ||
            bytes + tensors[last].numel * static_cast<int64_t>(emsa::DTypeSize(v.param)) <=
                bucket_bytes)) {
      bytes += tensors[last].numel * static_cast<int64_t>(emsa::DTypeSize(v.param));
      ++last;
    }
    auto b =
        emsa::DeviceUpdateTable::Create(tensors.data() + first, nullptr, last - first, options);
    CHECK_OK(b.status());
    bucket_total += (*b)->bytes_per_update();
    buckets.push_back(std::move(*b));
    first = last;
  }
  const auto all_buckets = [&] {
    for (auto& b : buckets) CHECK_OK(b->Update(s, stream));
  };
  Row bucketed{v.name, "bucketed", bpp, static_cast<int>(buckets.size()), {}, 0};
  bucketed.t = Time(stream, warmup, reps, all_buckets);
  bucketed.bytes = static_cast<double>(bucket_total);
  rows->push_back(bucketed);

  // The same buckets from one captured graph.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  all_buckets();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  Row graphed{v.name, "bucketed-graph", bpp, static_cast<int>(buckets.size()), {}, 0};
  graphed.t = Time(stream, warmup, reps, [&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); });
  graphed.bytes = static_cast<double>(bucket_total);
  rows->push_back(graphed);
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamSynchronize(stream));
}

// ---- main
// ------------------------------------------------------------------------------------------

int Usage() {
  std::fprintf(stderr,
               "usage: cuda_update_bench [--out PATH] [--reps N] [--warmup N] "
               "[--variants fp32,fp32-bf16state,amp,bf16,lion-fp32] [--bucket-mib M]\n");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path, variants = "fp32,fp32-bf16state,amp,bf16,lion-fp32";
  int reps = 30, warmup = 5;
  int64_t bucket_mib = 32;
  if (!emsa_bench::ParseFlags(
          argc, argv,
          {{"--out", [&](const char* v) { out_path = v; }},
           {"--reps", [&](const char* v) { reps = std::atoi(v); }},
           {"--warmup", [&](const char* v) { warmup = std::atoi(v); }},
           {"--variants", [&](const char* v) { variants = v; }},
           {"--bucket-mib", [&](const char* v) { bucket_mib = std::atoll(v); }}})) {
    return Usage();
  }
  if (reps < 1 || warmup < 0 || bucket_mib < 1) return Usage();

  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // The ceiling: a device-to-device copy, bytes read plus bytes written.
  constexpr size_t kCopyBytes = size_t{2} << 30;
  Timing copy;
  {
    Buffer src(kCopyBytes), dst(kCopyBytes);
    Fill(src.ptr, DType::kFloat32, static_cast<int64_t>(kCopyBytes / 4), 9, 0.5f, 1.5f, true);
    CHECK_CUDA(cudaDeviceSynchronize());  // the fill ran on the legacy stream
    copy = Time(stream, 3, std::max(reps, 20), [&] {
      CHECK_CUDA(cudaMemcpyAsync(dst.ptr, src.ptr, kCopyBytes, cudaMemcpyDeviceToDevice, stream));
    });
  }
  const double copy_tbps = 2.0 * kCopyBytes / (copy.median_ms * 1e-3) / 1e12;

  const std::vector<int64_t> shapes = LlamaShapes();
  int64_t total = 0;
  for (int64_t n : shapes) total += n;
  std::printf("device: %s, %d SMs; copy %.3f TB/s (read+write, median of %d)\n", prop.name,
              prop.multiProcessorCount, copy_tbps, std::max(reps, 20));
  std::printf("params: %lld in %zu tensors (Llama-1.1B shapes, untied head)\n",
              static_cast<long long>(total), shapes.size());

  std::vector<Row> rows;
  for (const Variant& v : kVariants) {
    if (("," + variants + ",").find("," + std::string(v.name) + ",") == std::string::npos) continue;
    RunVariant(v, shapes, warmup, reps, bucket_mib << 20, stream, &rows);
  }

  emsa::json::Value results = emsa::json::Value::MakeArray();
  std::printf("\n%-15s %-15s %6s %8s %9s %9s %7s %7s\n", "variant", "mode", "B/par", "launches",
              "median_ms", "floor_ms", "TB/s", "of_copy");
  for (const Row& r : rows) {
    const double tbps = r.bytes / (r.t.median_ms * 1e-3) / 1e12;
    const double floor_ms = r.bytes / (copy_tbps * 1e12) * 1e3;
    std::printf("%-15s %-15s %6.1f %8d %9.3f %9.3f %7.3f %7.3f\n", r.variant.c_str(),
                r.mode.c_str(), r.bytes_per_param, r.launches, r.t.median_ms, floor_ms, tbps,
                tbps / copy_tbps);
    emsa::json::Value o = emsa::json::Value::MakeObject();
    o.Set("variant", r.variant);
    o.Set("mode", r.mode);
    o.Set("bytes_per_param", r.bytes_per_param);
    o.Set("bytes", r.bytes);
    o.Set("launches", r.launches);
    o.Set("median_ms", r.t.median_ms);
    o.Set("min_ms", r.t.min_ms);
    o.Set("max_ms", r.t.max_ms);
    o.Set("floor_ms", floor_ms);
    o.Set("tbps", tbps);
    o.Set("fraction_of_copy", tbps / copy_tbps);
    results.Push(std::move(o));
  }
  CHECK_CUDA(cudaStreamDestroy(stream));

  if (!out_path.empty()) {
    emsa::json::Value doc = emsa_bench::ResultDoc("cuda_update", argc, argv);
    emsa::json::Value dev = emsa::json::Value::MakeObject();
    dev.Set("name", std::string(prop.name));
    dev.Set("sms", prop.multiProcessorCount);
    dev.Set("memory_bytes", static_cast<int64_t>(prop.totalGlobalMem));
    doc.Set("device", std::move(dev));
    emsa::json::Value c = emsa::json::Value::MakeObject();
    c.Set("bytes", static_cast<int64_t>(2 * kCopyBytes));
    c.Set("median_ms", copy.median_ms);
    c.Set("tbps", copy_tbps);
    doc.Set("copy", std::move(c));
    doc.Set("params", total);
    doc.Set("tensors", static_cast<int64_t>(shapes.size()));
    doc.Set("reps", reps);
    doc.Set("warmup", warmup);
    doc.Set("bucket_mib", bucket_mib);
    doc.Set("results", std::move(results));
    CHECK_OK(emsa::json::WriteFile(out_path, emsa::json::Write(doc)));
    std::printf("wrote %s\n", out_path.c_str());
  }
  return 0;
}
