// grad_stats.cu — sum of squares and non-finite count of a table's gradients, in one launch.
//
// Each thread accumulates in double (as the CPU kernels do: the square of every element exactly,
// sums of 1e9 elements without float's loss), each block reduces in a fixed tree and writes its
// partial; the last block to finish (ticket counter) adds the partials in block order, writes the
// table's figures and adds them to the scalars' header, then resets the ticket. No atomics on
// floats, so the result is the same bits on every run for a given device (grid).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "common/cuda_util.h"
#include "kernels/cuda/device_table.h"
#include "kernels/cuda/update_math.cuh"

namespace emsa {
namespace cuda {
namespace {

constexpr int kStatsThreads = 256;
constexpr int kStatsWarps = kStatsThreads / 32;
static_assert(kStatsThreads % 32 == 0, "whole warps");
static_assert(kChunkElems % 8 == 0, "chunks of aligned grads are whole 16-byte vectors");

struct Accum {
  double sum_sq = 0.0;
  long long nonfinite = 0;
};

__device__ __forceinline__ void Accumulate(Accum& a, float x) {
  // |x| <= FLT_MAX is false for inf and nan: the CPU kernels' test.
  if (!(fabsf(x) <= 3.4028234663852886e38f)) ++a.nonfinite;
  const double d = x;
  a.sum_sq = __dadd_rn(a.sum_sq, __dmul_rn(d, d));
}

// Adds grad[0, n) of one chunk; 16-byte loads when `vector`.
template <int kDType>
__device__ __forceinline__ void AddChunk(Accum& a, const void* grad, int n, bool vector) {
  constexpr bool kF32 = kDType == static_cast<int>(DType::kFloat32);
  constexpr int kPerVec = kF32 ? 4 : 8;
  int first = 0;
  if (vector) {
    const int vectors = n / kPerVec;
    const uint4* src = static_cast<const uint4*>(grad);
    for (int i = static_cast<int>(threadIdx.x); i < vectors; i += kStatsThreads) {
      const uint4 w = __ldcs(src + i);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if constexpr (kF32) {
          Accumulate(a, __uint_as_float(words[k]));
        } else if constexpr (kDType == static_cast<int>(DType::kBFloat16)) {
          Accumulate(a, Bf16ToFloat(words[k] & 0xFFFFu));
          Accumulate(a, Bf16ToFloat(words[k] >> 16));
        } else {
          Accumulate(a, HalfToFloat(words[k] & 0xFFFFu));
          Accumulate(a, HalfToFloat(words[k] >> 16));
        }
      }
    }
    first = vectors * kPerVec;
  }
  for (int i = first + static_cast<int>(threadIdx.x); i < n; i += kStatsThreads) {
    if constexpr (kF32) {
      Accumulate(a, static_cast<const float*>(grad)[i]);
    } else if constexpr (kDType == static_cast<int>(DType::kBFloat16)) {
      Accumulate(a, Bf16ToFloat(static_cast<const uint16_t*>(grad)[i]));
    } else {
      Accumulate(a, HalfToFloat(static_cast<const uint16_t*>(grad)[i]));
    }
  }
}

// A fixed-shape tree over the block: the same inputs give the same bits.
__device__ GradPartial BlockReduce(double sum_sq, long long nonfinite, long long first_bad) {
  __shared__ double s_sum[kStatsWarps];
  __shared__ long long s_bad[kStatsWarps];
  __shared__ long long s_first[kStatsWarps];
  for (int offset = 16; offset > 0; offset >>= 1) {
    sum_sq = __dadd_rn(sum_sq, __shfl_down_sync(0xFFFFFFFFu, sum_sq, offset));
    nonfinite += __shfl_down_sync(0xFFFFFFFFu, nonfinite, offset);
    const long long other = __shfl_down_sync(0xFFFFFFFFu, first_bad, offset);
    first_bad = other < first_bad ? other : first_bad;
  }
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (threadIdx.x % 32 == 0) {
    s_sum[warp] = sum_sq;
    s_bad[warp] = nonfinite;
    s_first[warp] = first_bad;
  }
  __syncthreads();
  GradPartial r{0.0, 0, LLONG_MAX, 0};
  if (threadIdx.x == 0) {
    for (int w = 0; w < kStatsWarps; ++w) {
      r.sum_sq = __dadd_rn(r.sum_sq, s_sum[w]);
      r.nonfinite += s_bad[w];
      r.first_bad = s_first[w] < r.first_bad ? s_first[w] : r.first_bad;
    }
  }
  __syncthreads();  // the shared arrays may be reused by a second call
  return r;         // meaningful in thread 0 only
}

__global__ void __launch_bounds__(kStatsThreads) GradStatsKernel(const GradStatsLaunch a) {
  Accum acc;
  long long first_bad = LLONG_MAX;
  for (int64_t ci = blockIdx.x; ci < a.chunk_count; ci += gridDim.x) {
    const DeviceChunk chunk = a.chunks[ci];
    const DeviceTensor& t = a.tensors[chunk.tensor];
    if (t.flags & kTensorAbsent) continue;  // no gradient this step: nothing to count
    const int64_t left = t.numel - chunk.begin;
    const int n = static_cast<int>(left < kChunkElems ? left : kChunkElems);
    const bool vector = (t.flags & kTensorGradVector) != 0;
    const long long before = acc.nonfinite;
    switch (t.grad_dtype) {
      case static_cast<int>(DType::kBFloat16):
        AddChunk<static_cast<int>(DType::kBFloat16)>(
            acc, static_cast<const uint16_t*>(t.grad) + chunk.begin, n, vector);
        break;
      case static_cast<int>(DType::kFloat16):
        AddChunk<static_cast<int>(DType::kFloat16)>(
            acc, static_cast<const uint16_t*>(t.grad) + chunk.begin, n, vector);
        break;
      default:
        AddChunk<static_cast<int>(DType::kFloat32)>(
            acc, static_cast<const float*>(t.grad) + chunk.begin, n, vector);
        break;
    }
    if (acc.nonfinite != before && chunk.tensor < first_bad) first_bad = chunk.tensor;
  }

  const GradPartial mine = BlockReduce(acc.sum_sq, acc.nonfinite, first_bad);
  __shared__ bool s_last;
  if (threadIdx.x == 0) {
    a.partials[blockIdx.x] = mine;
    __threadfence();  // the partial is visible device-wide before the ticket says so
    const unsigned int done = atomicAdd(&a.table_stats->ticket, 1u);
    s_last = done == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;

  // The last block: every other block's partial is visible (they fenced before their ticket).
  __threadfence();
  Accum total;
  long long total_first = LLONG_MAX;
  for (int b = static_cast<int>(threadIdx.x); b < static_cast<int>(gridDim.x); b += kStatsThreads) {
    total.sum_sq = __dadd_rn(total.sum_sq, __ldcg(&a.partials[b].sum_sq));
    total.nonfinite += __ldcg(&a.partials[b].nonfinite);
    const long long f = __ldcg(&a.partials[b].first_bad);
    total_first = f < total_first ? f : total_first;
  }
  const GradPartial all = BlockReduce(total.sum_sq, total.nonfinite, total_first);
  if (threadIdx.x == 0) {
    a.table_stats->sum_sq = all.sum_sq;
    a.table_stats->nonfinite = all.nonfinite;
    a.table_stats->first_bad = all.first_bad == LLONG_MAX ? -1 : all.first_bad;
    a.table_stats->ticket = 0u;  // ready for the next launch (this block is the last user)
    a.header->sum_sq = __dadd_rn(a.header->sum_sq, all.sum_sq);
    a.header->nonfinite_count += all.nonfinite;
  }
}

}  // namespace

Result<int> GradStatsBlocksPerSm() {
  int blocks = 0;
  EMSA_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, reinterpret_cast<const void*>(&GradStatsKernel), kStatsThreads, 0));
  if (blocks < 1) return Status::Internal("the grad statistics kernel fits no block on an SM");
  return blocks;
}

Status LaunchGradStats(const GradStatsLaunch& launch, cudaStream_t stream) {
  if (launch.grid < 1) return Status::Internal("grad statistics launched with an empty grid");
  GradStatsLaunch arg = launch;
  void* args[] = {&arg};
  EMSA_CUDA_RETURN_IF_ERROR(cudaLaunchKernel(reinterpret_cast<const void*>(&GradStatsKernel),
                                             dim3(static_cast<unsigned>(launch.grid)),
                                             dim3(kStatsThreads), args, 0, stream));
  return CudaStatus(cudaGetLastError(), "grad statistics kernel launch");
}

}  // namespace cuda
}  // namespace emsa
