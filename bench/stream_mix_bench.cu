// stream_mix_bench.cu — where the fp32 AdamW update loses to a device copy: the same bytes moved
// by kernels that differ in stream count, arithmetic and load machinery, in one run.
//
//   stream_mix_bench [--out PATH] [--elems N] [--reps N] [--warmup N] [--only SUBSTR]
//
// The fused fp32 AdamW update (src/kernels/cuda/update_kernel.cuh) reads param, grad, exp_avg
// and exp_avg_sq and writes three of them back: 28 bytes per element over 7 streams. On the H200
// it reaches 90-91% of a cudaMemcpyAsync copy, a 1-stream read 101-103%. Is it the stream count,
// the per-thread load/store scheduling, or the arithmetic? Rows, each on flat arrays of --elems
// fp32 elements per stream (default 2^28: 1 GiB a stream; a multiple of 32768):
//
//   memcpy         cudaMemcpyAsync device to device of 2 GiB (bytes = 2 x 2 GiB): the reference;
//                  timed again last (memcpy-end) to show drift over the run.
//   copy-kernel    1 stream in, 1 out over the memcpy's buffers, with adamw-ldst's access pattern:
//                  kernel versus copy engine at one stream.
//   mix-KinJout    the update's access pattern with one add per output (x' = g - x): 2in-1out
//                  (param), 3in-2out (Lion's shape), 4in-3out (AdamW's shape).
//   adamw-ldst     the product's per-element AdamW (update_math.cuh UpdateElement) with the
//                  product kernel's access pattern, rebuilt here: 256 threads, a persistent grid
//                  of (occupancy x SMs) blocks taking 32768-element chunks round-robin, each
//                  thread loading kUnroll float4 per stream per pass (vectors 256 threads apart),
//                  every load of a pass issued before the first use, __ldcs/__stcs (evict first).
//                  unroll 2 (8 elements a thread a pass) is the product's geometry; unroll 4 extra;
//                  "product grid": unroll 2 on the product kernel's blocks per SM (its occupancy,
//                  set by its registers: 3 where this kernel fits 4 in the build of 2026-11-30).
//   product        the shipped kernel itself (DeviceUpdateTable over one tensor of --elems).
//   adamw-tma, mix-4in-3out-tma
//                  the loads by Hopper bulk copies: one thread issues cp.async.bulk global ->
//                  shared (completing on an mbarrier, L2 evict_first) for one tile of each input
//                  stream into a ring of S stages; all threads wait on the stage's mbarrier
//                  parity, compute from shared memory and store the outputs either
//                  (st) as st.global.cs float4 from registers, or
//                  (bulk) into one of two shared output tiles, stored by cp.async.bulk shared ->
//                  global (bulk_group; the tile is rewritten only after wait_group.read).
//                  Tiles of T in {1024, 2048, 4096} elements at 256 threads a block, and T = 512
//                  at 128 threads; S in {2, 3, 4}; a persistent grid of (occupancy x SMs) blocks
//                  takes tiles round-robin. Configurations whose shared memory exceeds the
//                  device's opt-in limit are skipped with the reason.
//
// The AdamW arithmetic is emsa's (update_math.cuh UpdateElement<kAdamW>, every operation rounded
// on its own, no FMA): g' = g * 1; p' = p * (1 - lr*wd); m' = m + (g - m) * (1 - beta1);
// v' = v * beta2 + ((1 - beta2) * g) * g; p' += (-lr / (1 - beta1^t) * m') /
// (sqrt(v') / sqrt(1 - beta2^t) + eps). The step constants (bias corrections included) are
// computed once by the product's MakeStepConsts from DeviceScalars (default HyperParams, step 10)
// and passed to every kernel as an argument; the product kernel computes the same bits per block.
//
// Checks (each must pass, or the row says FAIL and the exit status is 1): a reference is made by
// a plain one-element-per-thread kernel with the same device function; it must agree bit for bit
// with the host's transcription of that function on 3 x 4096 sampled elements, must change more
// than 90% of every output stream, and a planted one-bit error in a copy of it must be counted
// as exactly one difference. Every row (adamw-ldst, the product and every TMA configuration
// included) then runs once from the same saved inputs and its three outputs must equal the
// reference bit for bit (so every row matches adamw-ldst); streams a mix row does not write must
// be unchanged. copy-kernel's output must equal its input.
//
// Timing: cudaEvents around each launch, the median of --reps (default 20) after --warmup
// (default 3). Between launches the arrays are updated in place: AdamW stays finite and
// non-trivial; the mix's x' = g - x alternates x, g - x, x (up to rounding), never settling, so
// every pass reads and writes non-zero data. Bandwidth counts bytes read plus bytes written.
// At the default size a row takes ~60 ms (check plus 23 launches of ~2 ms): the whole run took
// 2.5 s on an H200 (2026-11-30). The registers, blocks per SM and shared memory (dynamic +
// static, as the runtime reports it) of every kernel are in the table and the JSON.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "common/json.h"
#include "emsa/cuda_update.h"
#include "kernels/cuda/bulk_copy.cuh"
#include "kernels/cuda/device_table.h"
#include "kernels/cuda/update_math.cuh"

namespace {

using emsa_bench::Buffer;
using emsa_bench::Time;
using emsa_bench::Timing;
using emsa_bench::Uniform;

using emsa::OptimizerKind;
using emsa::cuda::BulkCommit;  // the bulk-copy helpers (kernels/cuda/bulk_copy.cuh)
using emsa::cuda::BulkLoad;
using emsa::cuda::BulkStore;
using emsa::cuda::BulkWait;
using emsa::cuda::BulkWaitRead;
using emsa::cuda::EvictFirstPolicy;
using emsa::cuda::FenceMbarInit;
using emsa::cuda::FenceProxyAsyncShared;
using emsa::cuda::MbarArriveExpectTx;
using emsa::cuda::MbarInit;
using emsa::cuda::MbarWait;
using emsa::cuda::StepConsts;

// ---- geometry ----------------------------------------------------------------------------------

// As update_kernel.cuh's defaults (kUpdateThreads, kChunkElems).
constexpr int kThreads = 256;
constexpr int64_t kChunkElems = 32768;
constexpr int64_t kChunkVecs = kChunkElems / 4;  // float4 per chunk
constexpr size_t kCopyBytes = size_t{2} << 30;   // the memcpy reference, as cuda_update_bench

// ---- the per-element operations ----------------------------------------------------------------

// The four streams; v and m are unused by mix rows with fewer outputs.
struct Streams {
  float* p;
  const float* g;
  float* m;
  float* v;
};

// The memory pattern with one add per output: x' = g - x for the first kOut of (p, m, v). kOut + 1
// streams in, kOut out. Never a fixed point (x, g - x, x, ...), bounded by |x| + |g|.
template <int kOut>
struct Mix {
  static_assert(kOut >= 1 && kOut <= 3, "p, m, v");
  static constexpr int kOutputs = kOut;
  EMSA_HD void operator()(float& p, float g, float& m, float& v) const {
    p = emsa::cuda::Sub(g, p);
    if constexpr (kOut >= 2) m = emsa::cuda::Sub(g, m);
    if constexpr (kOut >= 3) v = emsa::cuda::Sub(g, v);
  }
};

// The product's fp32 AdamW element update, with this step's constants.
struct AdamW {
  static constexpr int kOutputs = 3;
  StepConsts c;
  EMSA_HD void operator()(float& p, float g, float& m, float& v) const {
    emsa::cuda::UpdateElement<OptimizerKind::kAdamW>(c, p, g, m, v);
  }
};

template <class Op>
__device__ __forceinline__ void Apply4(const Op& op, float4& p, const float4& g, float4& m,
                                       float4& v) {
  op(p.x, g.x, m.x, v.x);
  op(p.y, g.y, m.y, v.y);
  op(p.z, g.z, m.z, v.z);
  op(p.w, g.w, m.w, v.w);
}

// ---- per-thread loads and stores: the product kernel's pattern ---------------------------------

// Block b takes chunks b, b + grid, ...; each pass of a chunk, thread t loads vectors
// v0 + u * 256 + t (u < kUnroll) of every input stream, then computes and stores them.
template <class Op, int kUnroll>
__global__ void __launch_bounds__(kThreads) LdstKernel(Streams s, Op op, int64_t chunks) {
  constexpr int kOut = Op::kOutputs;
  static_assert(kChunkVecs % (kThreads * kUnroll) == 0, "full chunks are whole passes");
  for (int64_t ci = blockIdx.x; ci < chunks; ci += gridDim.x) {
    const int64_t base = ci * kChunkVecs;
    float4* p = reinterpret_cast<float4*>(s.p) + base;
    const float4* g = reinterpret_cast<const float4*>(s.g) + base;
    float4* m = reinterpret_cast<float4*>(s.m) + base;
    float4* v = reinterpret_cast<float4*>(s.v) + base;
    for (int v0 = 0; v0 < kChunkVecs; v0 += kThreads * kUnroll) {
      float4 pr[kUnroll], gr[kUnroll], mr[kUnroll] = {}, vr[kUnroll] = {};
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = v0 + u * kThreads + static_cast<int>(threadIdx.x);
        pr[u] = __ldcs(p + i);
        gr[u] = __ldcs(g + i);
        if constexpr (kOut >= 2) mr[u] = __ldcs(m + i);
        if constexpr (kOut >= 3) vr[u] = __ldcs(v + i);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = v0 + u * kThreads + static_cast<int>(threadIdx.x);
        Apply4(op, pr[u], gr[u], mr[u], vr[u]);
        // The product's store order: exp_avg, exp_avg_sq, param.
        if constexpr (kOut >= 2) __stcs(m + i, mr[u]);
        if constexpr (kOut >= 3) __stcs(v + i, vr[u]);
        __stcs(p + i, pr[u]);
      }
    }
  }
}

// 1 stream in, 1 out, the same pattern.
template <int kUnroll>
__global__ void __launch_bounds__(kThreads)
    CopyKernel(const float4* __restrict__ src, float4* __restrict__ dst, int64_t chunks) {
  static_assert(kChunkVecs % (kThreads * kUnroll) == 0, "full chunks are whole passes");
  for (int64_t ci = blockIdx.x; ci < chunks; ci += gridDim.x) {
    const float4* in = src + ci * kChunkVecs;
    float4* out = dst + ci * kChunkVecs;
    for (int v0 = 0; v0 < kChunkVecs; v0 += kThreads * kUnroll) {
      float4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = __ldcs(in + v0 + u * kThreads + threadIdx.x);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) __stcs(out + v0 + u * kThreads + threadIdx.x, r[u]);
    }
  }
}

// The reference: one element per thread, plain loads, the same device function.
template <class Op>
__global__ void RefKernel(Streams s, Op op, int64_t n) {
  constexpr int kOut = Op::kOutputs;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x) {
    float p = s.p[i];
    float m = kOut >= 2 ? s.m[i] : 0.0f;
    float v = kOut >= 3 ? s.v[i] : 0.0f;
    op(p, s.g[i], m, v);
    s.p[i] = p;
    if (kOut >= 2) s.m[i] = m;
    if (kOut >= 3) s.v[i] = v;
  }
}

// ---- the bulk-copy pipeline --------------------------------------------------------------------

// Shared memory of one block: kStages stages of kIn input tiles, then (bulk stores) two sets of
// kOut output tiles. Mbarriers are static shared memory.
template <int kIn, int kOut, int kTile, int kStages, bool kBulkStore, int kBlock>
struct TmaShape {
  static constexpr int kTileBytes = kTile * 4;
  static constexpr int kVecsPerThread = kTile / 4 / kBlock;
  static constexpr int kInFloats = kStages * kIn * kTile;
  static constexpr int kOutBuffers = 2;
  static constexpr int kOutFloats = kBulkStore ? kOutBuffers * kOut * kTile : 0;
  static constexpr size_t kSmemBytes = size_t{4} * (kInFloats + kOutFloats);
  static_assert(kTileBytes % 16 == 0, "a bulk copy moves a multiple of 16 bytes");
  static_assert(kTile % (4 * kBlock) == 0, "every thread takes whole float4s of a tile");
  static_assert(kStages >= 1, "at least one stage");
};

// Block b takes tiles b, b + grid, ... (its k-th tile in stage k % kStages, filled for the
// (k / kStages)-th time: mbarrier phase parity (k / kStages) & 1). Thread 0 fills the first
// kStages stages, then refills a stage after the __syncthreads that ends every thread's reads of
// it; so a stage is never rewritten while read, and a waiter never sees a barrier two phases on.
template <class Op, int kTile, int kStages, bool kBulkStore, int kBlock>
__global__ void __launch_bounds__(kBlock) TmaKernel(Streams s, Op op, int64_t tiles) {
  constexpr int kOut = Op::kOutputs;
  constexpr int kIn = kOut + 1;
  using Shape = TmaShape<kIn, kOut, kTile, kStages, kBulkStore, kBlock>;
  extern __shared__ __align__(128) float smem[];
  __shared__ uint64_t full[kStages];

  const int tid = static_cast<int>(threadIdx.x);
  const int64_t first = blockIdx.x, stride = gridDim.x;
  const int64_t count = first < tiles ? (tiles - 1 - first) / stride + 1 : 0;
  const float* const src[4] = {s.p, s.g, s.m, s.v};
  float* const dst[3] = {s.p, s.m, s.v};
  const uint64_t policy = EvictFirstPolicy();

  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) MbarInit(&full[st], 1);
    FenceMbarInit();
  }
  __syncthreads();

  const auto fill = [&](int64_t k) {  // thread 0 only
    const int st = static_cast<int>(k % kStages);
    const int64_t at = (first + k * stride) * kTile;
    MbarArriveExpectTx(&full[st], kIn * Shape::kTileBytes);
    for (int q = 0; q < kIn; ++q) {
      BulkLoad(smem + (st * kIn + q) * kTile, src[q] + at, Shape::kTileBytes, &full[st], policy);
    }
  };
  if (tid == 0) {
    for (int64_t k = 0; k < kStages && k < count; ++k) fill(k);
  }

  for (int64_t k = 0; k < count; ++k) {
    const int st = static_cast<int>(k % kStages);
    MbarWait(&full[st], static_cast<uint32_t>((k / kStages) & 1));
    const float4* in = reinterpret_cast<const float4*>(smem + st * kIn * kTile);
    float4* out = reinterpret_cast<float4*>(smem + Shape::kInFloats + (k & 1) * kOut * kTile);
    const int64_t at = (first + k * stride) * kTile;
    constexpr int kTileVecs = kTile / 4;
#pragma unroll
    for (int j = 0; j < Shape::kVecsPerThread; ++j) {
      const int i = tid + j * kBlock;
      float4 p = in[i], g = in[kTileVecs + i], m{}, v{};
      if constexpr (kOut >= 2) m = in[2 * kTileVecs + i];
      if constexpr (kOut >= 3) v = in[3 * kTileVecs + i];
      Apply4(op, p, g, m, v);
      if constexpr (kBulkStore) {
        out[i] = p;
        if constexpr (kOut >= 2) out[kTileVecs + i] = m;
        if constexpr (kOut >= 3) out[2 * kTileVecs + i] = v;
      } else {
        if constexpr (kOut >= 2) __stcs(reinterpret_cast<float4*>(dst[1] + at) + i, m);
        if constexpr (kOut >= 3) __stcs(reinterpret_cast<float4*>(dst[2] + at) + i, v);
        __stcs(reinterpret_cast<float4*>(dst[0] + at) + i, p);
      }
    }
    if constexpr (kBulkStore) {
      FenceProxyAsyncShared();  // this thread's st.shared before the bulk store's reads
      // The previous tile's store (the other output buffer, written next iteration) has read its
      // source before the barrier lets anyone write it again.
      if (tid == 0) BulkWaitRead<0>();
    }
    __syncthreads();  // every read of stage st and every write of `out` is done
    if (tid == 0) {
      if (k + kStages < count) fill(k + kStages);
      if constexpr (kBulkStore) {
        for (int o = 0; o < kOut; ++o) {
          BulkStore(dst[o] + at, out + o * kTileVecs, Shape::kTileBytes, policy);
        }
        BulkCommit();
      }
    }
  }
  if constexpr (kBulkStore) {
    if (tid == 0) BulkWait<0>();  // shared memory stays until the stores are complete
  }
}

// ---- fill, compare, step constants -------------------------------------------------------------

// x in +-[lo, hi) (or [lo, hi) when !sign), from a hash of (seed, index): never zero.
__global__ void FillKernel(float* out, int64_t n, uint64_t seed, float lo, float hi, bool sign) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x) {
    float x = lo + (hi - lo) * Uniform(seed, i);
    if (sign && Uniform(seed ^ 0x5555, i) < 0.5f) x = -x;
    out[i] = x;
  }
}

// Counts 32-bit words that differ; the smallest differing index into result[1].
__global__ void DiffKernel(const uint4* a, const uint4* b, int64_t vecs,
                           unsigned long long* result) {
  unsigned long long count = 0, first = ~0ull;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < vecs;
       i += int64_t{blockDim.x} * gridDim.x) {
    const uint4 x = a[i], y = b[i];
    const int d[4] = {x.x != y.x, x.y != y.y, x.z != y.z, x.w != y.w};
    for (int k = 0; k < 4; ++k) {
      if (d[k]) {
        ++count;
        const auto at = static_cast<unsigned long long>(4 * i + k);
        if (at < first) first = at;
      }
    }
  }
  if (count != 0) {
    atomicAdd(&result[0], count);
    atomicMin(&result[1], first);
  }
}

__global__ void FlipBitKernel(float* p, int64_t i) {
  p[i] = __uint_as_float(__float_as_uint(p[i]) ^ 0x00000100u);
}

// The product's per-step constants, made on the device as the product kernel makes them.
__global__ void StepConstsKernel(const emsa::DeviceGroupScalars* group,
                                 const emsa::DeviceStepHeader* header, StepConsts* out) {
  *out = emsa::cuda::MakeStepConsts<OptimizerKind::kAdamW>(*group, header->grad_multiplier);
}

// ---- host helpers ------------------------------------------------------------------------------

void Fill(float* out, int64_t n, uint64_t seed, float lo, float hi, bool sign, cudaStream_t st) {
  FillKernel<<<1024, 256, 0, st>>>(out, n, seed, lo, hi, sign);
  CHECK_CUDA(cudaGetLastError());
}

// A launch's geometry and the kernel's resources.
struct KernelInfo {
  int regs = 0;
  int blocks_per_sm = 0;
  int grid = 0;
  size_t smem_bytes = 0;  // dynamic + static per block
};

struct Row {
  std::string name, config;
  double bytes = 0;
  KernelInfo k;
  Timing t;
  std::string check;  // "ok", "FAIL ...", "-" (not checked), or "skipped: why"
  bool timed = false;
};

// Everything a row needs.
struct Bench {
  cudaStream_t stream = nullptr;
  cudaDeviceProp prop{};
  int64_t n = 0;
  int warmup = 3, reps = 20;
  std::string only;
  bool failed = false;
  std::vector<Row> rows;
  std::unique_ptr<Buffer> counters;  // 2 x unsigned long long for DiffKernel
  // Working streams (updated in place), the saved inputs, and the reference outputs.
  float *p = nullptr, *g = nullptr, *m = nullptr, *v = nullptr;
  float *p0 = nullptr, *m0 = nullptr, *v0 = nullptr;
  float *pr = nullptr, *mr = nullptr, *vr = nullptr;

  Streams streams() const { return {p, g, m, v}; }
  bool Selected(const std::string& name) const {
    return only.empty() || name.find(only) != std::string::npos;
  }
  void Restore() {
    const size_t bytes = static_cast<size_t>(n) * 4;
    CHECK_CUDA(cudaMemcpyAsync(p, p0, bytes, cudaMemcpyDeviceToDevice, stream));
    CHECK_CUDA(cudaMemcpyAsync(m, m0, bytes, cudaMemcpyDeviceToDevice, stream));
    CHECK_CUDA(cudaMemcpyAsync(v, v0, bytes, cudaMemcpyDeviceToDevice, stream));
  }
  // Words of a and b (count floats, a multiple of 4) that differ; *first the smallest index.
  uint64_t Diff(const float* a, const float* b, int64_t count, int64_t* first = nullptr) {
    unsigned long long init[2] = {0, ~0ull}, got[2] = {0, 0};
    CHECK_CUDA(cudaMemcpyAsync(counters->ptr, init, sizeof init, cudaMemcpyHostToDevice, stream));
    DiffKernel<<<prop.multiProcessorCount * 8, 256, 0, stream>>>(
        reinterpret_cast<const uint4*>(a), reinterpret_cast<const uint4*>(b), count / 4,
        static_cast<unsigned long long*>(counters->ptr));
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaMemcpyAsync(got, counters->ptr, sizeof got, cudaMemcpyDeviceToHost, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    if (first != nullptr) *first = got[0] == 0 ? -1 : static_cast<int64_t>(got[1]);
    return got[0];
  }
  // Runs `launch` once from the saved inputs; the first `outputs` of (p, m, v) must equal the
  // reference bit for bit and the others their inputs.
  std::string CheckUpdate(int outputs, const std::function<void()>& launch) {
    Restore();
    launch();
    CHECK_CUDA(cudaStreamSynchronize(stream));
    const float* got[3] = {p, m, v};
    const float* want[3] = {pr, outputs >= 2 ? mr : m0, outputs >= 3 ? vr : v0};
    const char* names[3] = {"param", "exp_avg", "exp_avg_sq"};
    std::string bad;
    for (int k = 0; k < 3; ++k) {
      int64_t at = -1;
      const uint64_t d = Diff(got[k], want[k], n, &at);
      if (d == 0) continue;
      float x = 0, y = 0;
      CHECK_CUDA(cudaMemcpy(&x, got[k] + at, 4, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(&y, want[k] + at, 4, cudaMemcpyDeviceToHost));
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s%s: %llu differ, first [%lld] %.9g want %.9g",
                    bad.empty() ? "" : "; ", names[k], static_cast<unsigned long long>(d),
                    static_cast<long long>(at), x, y);
      bad += buf;
    }
    if (bad.empty()) return "ok";
    failed = true;
    return "FAIL " + bad;
  }
  double copy_tbps = 0;  // the memcpy's, once measured
  // Keeps the row and prints it as progress.
  void Add(Row row) {
    if (row.timed) {
      const double tbps = row.bytes / (row.t.median_ms * 1e-3) / 1e12;
      std::printf("  %-18s %-30s %8.3f ms %6.3f TB/s %6.3f of copy  %s\n", row.name.c_str(),
                  row.config.c_str(), row.t.median_ms, tbps, copy_tbps > 0 ? tbps / copy_tbps : 1.0,
                  row.check.c_str());
    } else {
      std::printf("  %-18s %-30s %s\n", row.name.c_str(), row.config.c_str(), row.check.c_str());
    }
    std::fflush(stdout);
    rows.push_back(std::move(row));
  }
};

// Fills `k` for a kernel launched with `threads` a block and `smem` dynamic bytes; false (and
// why) if it cannot launch.
template <typename Kernel>
bool Resources(Kernel kernel, int threads, size_t smem, const cudaDeviceProp& prop, KernelInfo* k,
               std::string* why) {
  cudaFuncAttributes attr{};
  CHECK_CUDA(cudaFuncGetAttributes(&attr, kernel));
  k->regs = attr.numRegs;
  k->smem_bytes = smem + attr.sharedSizeBytes;
  if (k->smem_bytes > prop.sharedMemPerBlockOptin) {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "skipped: needs %zu bytes of shared memory per block, the device allows %zu",
                  k->smem_bytes, static_cast<size_t>(prop.sharedMemPerBlockOptin));
    *why = buf;
    return false;
  }
  if (smem > 0) {
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    cudaSharedmemCarveoutMaxShared));
  }
  CHECK_CUDA(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&k->blocks_per_sm, kernel, threads, smem));
  if (k->blocks_per_sm < 1) {
    *why = "skipped: no block fits on an SM";
    return false;
  }
  k->grid = k->blocks_per_sm * prop.multiProcessorCount;
  return true;
}

// ---- rows --------------------------------------------------------------------------------------

template <class Op, int kUnroll>
void RunLdst(Bench& b, const char* name, const Op& op, int blocks_per_sm = 0) {
  char config[64];
  std::snprintf(config, sizeof config, "unroll %d (%d elem/thread/pass)%s", kUnroll, 4 * kUnroll,
                blocks_per_sm > 0 ? ", product grid" : "");
  if (!b.Selected(name)) return;
  Row row{name, config, 4.0 * (2 * Op::kOutputs + 1) * static_cast<double>(b.n), {}, {}, "", 0};
  const auto kernel = LdstKernel<Op, kUnroll>;
  std::string why;
  if (!Resources(kernel, kThreads, 0, b.prop, &row.k, &why)) {
    row.check = why;
    b.Add(row);
    return;
  }
  if (blocks_per_sm > 0 && blocks_per_sm < row.k.blocks_per_sm) {
    row.k.blocks_per_sm = blocks_per_sm;
    row.k.grid = blocks_per_sm * b.prop.multiProcessorCount;
  }
  const int grid = row.k.grid;
  const int64_t chunks = b.n / kChunkElems;
  const auto launch = [&] {
    kernel<<<grid, kThreads, 0, b.stream>>>(b.streams(), op, chunks);
    CHECK_CUDA(cudaGetLastError());
  };
  row.check = b.CheckUpdate(Op::kOutputs, launch);
  row.t = Time(b.stream, b.warmup, b.reps, launch);
  row.timed = true;
  b.Add(row);
}

template <class Op, int kTile, int kStages, bool kBulkStore, int kBlock>
void RunTma(Bench& b, const char* name, const Op& op) {
  using Shape = TmaShape<Op::kOutputs + 1, Op::kOutputs, kTile, kStages, kBulkStore, kBlock>;
  char config[64];
  std::snprintf(config, sizeof config, "T=%d S=%d %s%s", kTile, kStages,
                kBulkStore ? "bulk-store" : "st.global", kBlock == kThreads ? "" : ", 128 thr");
  static_assert(kBlock == kThreads || kBlock == 128, "the config names 128 or 256 threads");
  if (!b.Selected(name)) return;
  Row row{name, config, 4.0 * (2 * Op::kOutputs + 1) * static_cast<double>(b.n), {}, {}, "", 0};
  if (b.prop.major < 9) {
    row.check = "skipped: bulk copies need compute capability 9.0";
    b.Add(row);
    return;
  }
  if (b.n % kTile != 0) {  // cannot happen with n a multiple of kChunkElems; kept as a guard
    row.check = "skipped: --elems is not a multiple of the tile";
    b.Add(row);
    return;
  }
  const auto kernel = TmaKernel<Op, kTile, kStages, kBulkStore, kBlock>;
  std::string why;
  if (!Resources(kernel, kBlock, Shape::kSmemBytes, b.prop, &row.k, &why)) {
    row.check = why;
    b.Add(row);
    return;
  }
  const int grid = row.k.grid;
  const int64_t tiles = b.n / kTile;
  const auto launch = [&] {
    kernel<<<grid, kBlock, Shape::kSmemBytes, b.stream>>>(b.streams(), op, tiles);
    CHECK_CUDA(cudaGetLastError());
  };
  row.check = b.CheckUpdate(Op::kOutputs, launch);
  row.t = Time(b.stream, b.warmup, b.reps, launch);
  row.timed = true;
  b.Add(row);
}

template <class Op, int kTile, int kBlock = kThreads>
void RunTmaStages(Bench& b, const char* name, const Op& op) {
  RunTma<Op, kTile, 2, false, kBlock>(b, name, op);
  RunTma<Op, kTile, 2, true, kBlock>(b, name, op);
  RunTma<Op, kTile, 3, false, kBlock>(b, name, op);
  RunTma<Op, kTile, 3, true, kBlock>(b, name, op);
  RunTma<Op, kTile, 4, false, kBlock>(b, name, op);
  RunTma<Op, kTile, 4, true, kBlock>(b, name, op);
}

// T in {1024, 2048, 4096} at 256 threads; then T = 512 at 128 threads (one float4 a thread a
// stream, as T = 1024 at 256): do smaller tiles and more blocks per SM keep helping?
template <class Op>
void RunTmaAll(Bench& b, const char* name, const Op& op) {
  RunTmaStages<Op, 1024>(b, name, op);
  RunTmaStages<Op, 2048>(b, name, op);
  RunTmaStages<Op, 4096>(b, name, op);
  RunTmaStages<Op, 512, 128>(b, name, op);
}

// The reference outputs of `op` from the saved inputs into pr/mr/vr, and the controls that show
// the comparison can fail. Returns false (after printing why) if a control fails.
template <class Op>
bool MakeReference(Bench& b, const Op& op, const char* what, emsa::json::Value* controls) {
  b.Restore();
  RefKernel<<<b.prop.multiProcessorCount * 8, 256, 0, b.stream>>>(b.streams(), op, b.n);
  CHECK_CUDA(cudaGetLastError());
  const size_t bytes = static_cast<size_t>(b.n) * 4;
  CHECK_CUDA(cudaMemcpyAsync(b.pr, b.p, bytes, cudaMemcpyDeviceToDevice, b.stream));
  CHECK_CUDA(cudaMemcpyAsync(b.mr, b.m, bytes, cudaMemcpyDeviceToDevice, b.stream));
  CHECK_CUDA(cudaMemcpyAsync(b.vr, b.v, bytes, cudaMemcpyDeviceToDevice, b.stream));
  CHECK_CUDA(cudaStreamSynchronize(b.stream));
  bool ok = true;
  emsa::json::Value c = emsa::json::Value::MakeObject();

  // 1. The host's transcription of the same function, on three windows of 4096 elements.
  constexpr int64_t kWindow = 4096;
  const int64_t starts[3] = {0, (b.n / 2) / 4 * 4, b.n - kWindow};
  uint64_t host_bad = 0;
  for (int64_t at : starts) {
    std::vector<float> in[4], out[3];
    const float* din[4] = {b.p0, b.g, b.m0, b.v0};
    const float* dout[3] = {b.pr, b.mr, b.vr};
    for (int q = 0; q < 4; ++q) {
      in[q].resize(kWindow);
      CHECK_CUDA(cudaMemcpy(in[q].data(), din[q] + at, kWindow * 4, cudaMemcpyDeviceToHost));
    }
    for (int q = 0; q < 3; ++q) {
      out[q].resize(kWindow);
      CHECK_CUDA(cudaMemcpy(out[q].data(), dout[q] + at, kWindow * 4, cudaMemcpyDeviceToHost));
    }
    for (int64_t i = 0; i < kWindow; ++i) {
      float p = in[0][i], m = in[2][i], v = in[3][i];
      op(p, in[1][i], m, v);
      const float want[3] = {p, Op::kOutputs >= 2 ? m : 0.0f, Op::kOutputs >= 3 ? v : 0.0f};
      for (int q = 0; q < Op::kOutputs; ++q) {
        if (std::memcmp(&want[q], &out[q][i], 4) != 0) ++host_bad;
      }
    }
  }
  c.Set("host_sample_mismatches", host_bad);
  if (host_bad != 0) {
    std::printf("FAIL %s reference: %llu of %lld sampled words differ from the host's math\n", what,
                static_cast<unsigned long long>(host_bad),
                static_cast<long long>(3 * kWindow * Op::kOutputs));
    ok = false;
  }

  // 2. The update changes (nearly) every element of every output.
  const float* before[3] = {b.p0, b.m0, b.v0};
  const float* after[3] = {b.pr, b.mr, b.vr};
  emsa::json::Value changed = emsa::json::Value::MakeArray();
  for (int q = 0; q < Op::kOutputs; ++q) {
    const uint64_t d = b.Diff(after[q], before[q], b.n);
    const double frac = static_cast<double>(d) / static_cast<double>(b.n);
    changed.Push(frac);
    if (frac < 0.9) {
      std::printf("FAIL %s reference: output %d changed only %.3f of its elements\n", what, q,
                  frac);
      ok = false;
    }
  }
  c.Set("changed_fraction", std::move(changed));

  // 3. A planted one-bit error is found, once.
  CHECK_CUDA(cudaMemcpyAsync(b.p, b.pr, bytes, cudaMemcpyDeviceToDevice, b.stream));
  FlipBitKernel<<<1, 1, 0, b.stream>>>(b.p, b.n / 3 + 1);
  CHECK_CUDA(cudaGetLastError());
  int64_t at = -1;
  const uint64_t planted = b.Diff(b.p, b.pr, b.n, &at);
  c.Set("planted_error_found", planted == 1 && at == b.n / 3 + 1);
  if (planted != 1 || at != b.n / 3 + 1) {
    std::printf("FAIL %s reference: a planted one-bit error gave %llu differences at %lld\n", what,
                static_cast<unsigned long long>(planted), static_cast<long long>(at));
    ok = false;
  }
  std::printf("%s reference: host sample %s, every output changed, planted error %s\n", what,
              host_bad == 0 ? "matches" : "DIFFERS", planted == 1 ? "found" : "MISSED");
  controls->Set(what, std::move(c));
  if (!ok) b.failed = true;
  return ok;
}

int Usage() {
  std::fprintf(stderr,
               "usage: stream_mix_bench [--out PATH] [--elems N (multiple of 32768, default "
               "268435456)] [--reps N] [--warmup N] [--only SUBSTR (row names; memcpy always "
               "runs)]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  std::string out_path;
  b.n = int64_t{1} << 28;
  if (!emsa_bench::ParseFlags(argc, argv,
                              {{"--out", [&](const char* v) { out_path = v; }},
                               {"--elems", [&](const char* v) { b.n = std::atoll(v); }},
                               {"--reps", [&](const char* v) { b.reps = std::atoi(v); }},
                               {"--warmup", [&](const char* v) { b.warmup = std::atoi(v); }},
                               {"--only", [&](const char* v) { b.only = v; }}})) {
    return Usage();
  }
  if (b.reps < 1 || b.warmup < 0) return Usage();
  if (b.n < kChunkElems || b.n % kChunkElems != 0) {
    std::fprintf(stderr, "--elems must be a positive multiple of %lld (one chunk), got %lld\n",
                 static_cast<long long>(kChunkElems), static_cast<long long>(b.n));
    return 2;
  }

  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaGetDeviceProperties(&b.prop, device));
  const size_t stream_bytes = static_cast<size_t>(b.n) * 4;
  const size_t needed = 10 * stream_bytes + 2 * kCopyBytes;
  size_t free_bytes = 0, total_bytes = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (needed + (size_t{1} << 30) > free_bytes) {
    std::fprintf(stderr,
                 "needs %.1f GB of device memory (10 streams + the 2 x 2 GiB copy), "
                 "%.1f GB free: pass a smaller --elems\n",
                 needed / 1e9, free_bytes / 1e9);
    return 2;
  }
  CHECK_CUDA(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
  b.counters = std::make_unique<Buffer>(2 * sizeof(unsigned long long));
  std::printf(
      "device: %s, %d SMs, L2 %.0f MiB, smem opt-in %zu B/block; %lld elements a stream "
      "(%.2f GiB); median of %d after %d warm-ups\n",
      b.prop.name, b.prop.multiProcessorCount, b.prop.l2CacheSize / 1048576.0,
      static_cast<size_t>(b.prop.sharedMemPerBlockOptin), static_cast<long long>(b.n),
      stream_bytes / 1073741824.0, b.reps, b.warmup);

  // ---- the copy: memcpy and copy-kernel ----
  Buffer csrc(kCopyBytes), cdst(kCopyBytes);
  Fill(csrc.f(), kCopyBytes / 4, 9, 0.5f, 1.5f, true, b.stream);
  CHECK_CUDA(cudaStreamSynchronize(b.stream));
  const auto memcpy_row = [&](const char* name) {
    Row row{name, "2 GiB D2D", 2.0 * kCopyBytes, {}, {}, "-", true};
    row.t = Time(b.stream, 3, std::max(b.reps, 20), [&] {
      CHECK_CUDA(
          cudaMemcpyAsync(cdst.ptr, csrc.ptr, kCopyBytes, cudaMemcpyDeviceToDevice, b.stream));
    });
    b.Add(row);
  };
  memcpy_row("memcpy");
  const double copy_ms = b.rows.back().t.median_ms;
  const double copy_tbps = 2.0 * kCopyBytes / (copy_ms * 1e-3) / 1e12;
  b.copy_tbps = copy_tbps;

  const auto copy_kernel = [&](auto kernel, int unroll) {
    char config[64];
    std::snprintf(config, sizeof config, "unroll %d, 2 GiB", unroll);
    Row row{"copy-kernel", config, 2.0 * kCopyBytes, {}, {}, "", true};
    if (!b.Selected(row.name)) return;
    std::string why;
    if (!Resources(kernel, kThreads, 0, b.prop, &row.k, &why)) {
      row.check = why;
      row.timed = false;
      b.Add(row);
      return;
    }
    const int grid = row.k.grid;
    const int64_t chunks = static_cast<int64_t>(kCopyBytes / 4) / kChunkElems;
    const auto launch = [&] {
      kernel<<<grid, kThreads, 0, b.stream>>>(static_cast<const float4*>(csrc.ptr),
                                              static_cast<float4*>(cdst.ptr), chunks);
      CHECK_CUDA(cudaGetLastError());
    };
    CHECK_CUDA(cudaMemsetAsync(cdst.ptr, 0, kCopyBytes, b.stream));
    launch();
    const uint64_t d = b.Diff(cdst.f(), csrc.f(), kCopyBytes / 4);
    row.check = d == 0 ? "ok" : "FAIL " + std::to_string(d) + " words differ";
    if (d != 0) b.failed = true;
    row.t = Time(b.stream, b.warmup, b.reps, launch);
    b.Add(row);
  };
  copy_kernel(CopyKernel<2>, 2);
  copy_kernel(CopyKernel<4>, 4);

  // ---- the four streams ----
  Buffer bp(stream_bytes), bg(stream_bytes), bm(stream_bytes), bv(stream_bytes);
  Buffer bp0(stream_bytes), bm0(stream_bytes), bv0(stream_bytes);
  Buffer bpr(stream_bytes), bmr(stream_bytes), bvr(stream_bytes);
  b.p = bp.f(), b.g = bg.f(), b.m = bm.f(), b.v = bv.f();
  b.p0 = bp0.f(), b.m0 = bm0.f(), b.v0 = bv0.f();
  b.pr = bpr.f(), b.mr = bmr.f(), b.vr = bvr.f();
  // As cuda_update_bench: param +-[0.5, 1.5), grad +-[1e-4, 2e-2), exp_avg +-[1e-5, 1e-2),
  // exp_avg_sq [1e-8, 2e-4). Never zero; grads of both signs; v > 0.
  Fill(b.p0, b.n, 1, 0.5f, 1.5f, true, b.stream);
  Fill(b.g, b.n, 2, 1e-4f, 2e-2f, true, b.stream);
  Fill(b.m0, b.n, 3, 1e-5f, 1e-2f, true, b.stream);
  Fill(b.v0, b.n, 4, 1e-8f, 2e-4f, false, b.stream);
  b.Restore();
  CHECK_CUDA(cudaStreamSynchronize(b.stream));
  emsa::json::Value controls = emsa::json::Value::MakeObject();

  // ---- mix rows ----
  std::printf("mix rows (x' = g - x):\n");
  if (MakeReference(b, Mix<3>{}, "mix", &controls)) {
    RunLdst<Mix<1>, 2>(b, "mix-2in-1out", Mix<1>{});
    RunLdst<Mix<2>, 2>(b, "mix-3in-2out", Mix<2>{});
    RunLdst<Mix<3>, 2>(b, "mix-4in-3out", Mix<3>{});
    RunLdst<Mix<3>, 4>(b, "mix-4in-3out", Mix<3>{});
    RunTmaAll(b, "mix-4in-3out-tma", Mix<3>{});
  }

  // ---- AdamW rows ----
  emsa::HyperParams hyper;  // lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2
  constexpr int64_t kStep = 10;
  auto made = emsa::DeviceScalars::Create(&hyper, 1);
  CHECK_OK(made.status());
  emsa::DeviceScalars& scalars = **made;
  CHECK_OK(scalars.SetGroup(0, hyper, kStep, b.stream));
  CHECK_OK(scalars.SetInputs(1.0f, 0.0f, 1234, b.stream));
  CHECK_OK(scalars.BeginStep(b.stream));  // grad_multiplier 1, found_inf 0
  AdamW adamw{};
  {
    Buffer dconsts(sizeof(StepConsts));
    StepConstsKernel<<<1, 1, 0, b.stream>>>(scalars.device_groups(), scalars.device_header(),
                                            static_cast<StepConsts*>(dconsts.ptr));
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaMemcpyAsync(&adamw.c, dconsts.ptr, sizeof(StepConsts), cudaMemcpyDeviceToHost,
                               b.stream));
    CHECK_CUDA(cudaStreamSynchronize(b.stream));
  }
  std::printf("AdamW rows (step %lld: decay %.9g, -lr/bc1 %.9g, sqrt(bc2) %.9g):\n",
              static_cast<long long>(kStep), adamw.c.decay, adamw.c.neg_step_size,
              adamw.c.bc2_sqrt);
  if (MakeReference(b, adamw, "adamw", &controls)) {
    RunLdst<AdamW, 2>(b, "adamw-ldst", adamw);
    RunLdst<AdamW, 4>(b, "adamw-ldst", adamw);
    // The same kernel on as many blocks per SM as the product's fp32 AdamW kernel fits (its
    // registers, not this kernel's, set that): does the product lose by occupancy?
    const emsa::cuda::Variant fp32{emsa::ParamKind::kF32, true, false};
    auto product_bps = emsa::cuda::UpdateBlocksPerSm(OptimizerKind::kAdamW, fp32, false);
    CHECK_OK(product_bps.status());
    RunLdst<AdamW, 2>(b, "adamw-ldst", adamw, *product_bps);
    // The shipped kernels through DeviceUpdateTable: the per-thread one and the bulk-copy one.
    for (const bool bulk : {false, true}) {
      if (!b.Selected("product")) break;
      emsa::TensorUpdate t;
      t.param = b.p;
      t.grad = b.g;
      t.exp_avg = b.m;
      t.exp_avg_sq = b.v;
      t.numel = b.n;
      emsa::DeviceTableOptions options;
      options.bulk_copy = bulk;
      auto table = emsa::DeviceUpdateTable::Create(&t, nullptr, 1, options);
      CHECK_OK(table.status());
      auto bps = emsa::cuda::UpdateBlocksPerSm(OptimizerKind::kAdamW, fp32,
                                               (*table)->bulk_copy_launches() > 0);
      CHECK_OK(bps.status());
      Row row;
      row.name = bulk ? "product-bulk" : "product";
      row.config = (*table)->bulk_copy_launches() > 0 ? "DeviceUpdateTable, bulk copies"
                                                      : "DeviceUpdateTable, per-thread";
      row.bytes = static_cast<double>((*table)->bytes_per_update());
      row.timed = true;
      row.k.blocks_per_sm = *bps;  // its registers are not reachable from here
      row.k.grid = *bps * b.prop.multiProcessorCount;
      const auto launch = [&] { CHECK_OK((*table)->Update(scalars, b.stream)); };
      row.check = b.CheckUpdate(3, launch);
      row.t = Time(b.stream, b.warmup, b.reps, launch);
      b.Add(row);
    }
    RunTmaAll(b, "adamw-tma", adamw);
  }

  memcpy_row("memcpy-end");

  // ---- report ----
  std::printf("\n%-18s %-30s %7s %5s %8s %9s %7s %8s  %s\n", "row", "config", "blk/SM", "regs",
              "smem_KB", "median_ms", "TB/s", "of_copy", "check");
  emsa::json::Value results = emsa::json::Value::MakeArray();
  for (const Row& r : b.rows) {
    emsa::json::Value o = emsa::json::Value::MakeObject();
    o.Set("name", r.name);
    o.Set("config", r.config);
    o.Set("check", r.check);
    o.Set("regs", r.k.regs);
    o.Set("blocks_per_sm", r.k.blocks_per_sm);
    o.Set("grid", r.k.grid);
    o.Set("smem_bytes", static_cast<uint64_t>(r.k.smem_bytes));
    o.Set("bytes", r.bytes);
    if (!r.timed) {
      std::printf("%-18s %-30s %7s %5d %8s %9s %7s %8s  %s\n", r.name.c_str(), r.config.c_str(),
                  "-", r.k.regs, "-", "-", "-", "-", r.check.c_str());
      results.Push(std::move(o));
      continue;
    }
    const double tbps = r.bytes / (r.t.median_ms * 1e-3) / 1e12;
    std::printf("%-18s %-30s %7d %5d %8.1f %9.3f %7.3f %8.3f  %s\n", r.name.c_str(),
                r.config.c_str(), r.k.blocks_per_sm, r.k.regs, r.k.smem_bytes / 1024.0,
                r.t.median_ms, tbps, tbps / copy_tbps, r.check.c_str());
    o.Set("median_ms", r.t.median_ms);
    o.Set("min_ms", r.t.min_ms);
    o.Set("max_ms", r.t.max_ms);
    o.Set("tbps", tbps);
    o.Set("fraction_of_memcpy", tbps / copy_tbps);
    results.Push(std::move(o));
  }
  std::printf("%s\n", b.failed ? "SOME CHECKS FAILED" : "all checks passed");

  if (!out_path.empty()) {
    emsa::json::Value doc = emsa_bench::ResultDoc("stream_mix", argc, argv);
    emsa::json::Value dev = emsa::json::Value::MakeObject();
    dev.Set("name", std::string(b.prop.name));
    dev.Set("sms", b.prop.multiProcessorCount);
    dev.Set("compute_capability", b.prop.major * 10 + b.prop.minor);
    dev.Set("l2_bytes", b.prop.l2CacheSize);
    dev.Set("smem_optin_bytes", static_cast<uint64_t>(b.prop.sharedMemPerBlockOptin));
    dev.Set("memory_bytes", static_cast<uint64_t>(b.prop.totalGlobalMem));
    doc.Set("device", std::move(dev));
    doc.Set("elems", b.n);
    doc.Set("reps", b.reps);
    doc.Set("warmup", b.warmup);
    emsa::json::Value c = emsa::json::Value::MakeObject();
    c.Set("bytes", static_cast<uint64_t>(2 * kCopyBytes));
    c.Set("median_ms", copy_ms);
    c.Set("tbps", copy_tbps);
    doc.Set("memcpy", std::move(c));
    emsa::json::Value consts = emsa::json::Value::MakeObject();
    consts.Set("step", kStep);
    consts.Set("lr", hyper.lr);
    consts.Set("beta1", hyper.beta1);
    consts.Set("beta2", hyper.beta2);
    consts.Set("eps", hyper.eps);
    consts.Set("weight_decay", hyper.weight_decay);
    doc.Set("adamw", std::move(consts));
    doc.Set("controls", std::move(controls));
    doc.Set("all_checks_passed", !b.failed);
    doc.Set("rows", std::move(results));
    CHECK_OK(emsa::json::WriteFile(out_path, emsa::json::Write(doc)));
    std::printf("wrote %s\n", out_path.c_str());
  }
  CHECK_CUDA(cudaStreamDestroy(b.stream));
  return b.failed ? 1 : 0;
}
