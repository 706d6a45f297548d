// apply_delta.cu — param = param * decay + delta (emsa/kernels/cuda/apply_delta.h): 12 bytes per
// element of HBM traffic, float4 where both pointers share 16-byte alignment.
#include "common/cuda_util.h"
#include "kernels/cuda/apply_delta.h"

namespace emsa {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;

__device__ __forceinline__ float Apply(float p, float d, float decay) {
  return __fadd_rn(__fmul_rn(p, decay), d);  // no contraction into an FMA: the CPU's bits
}

__global__ void __launch_bounds__(kThreads)
    ApplyDeltaKernel(float* __restrict__ param, const float* __restrict__ delta, int64_t n,
                     float decay) {
  const int64_t stride = int64_t{kThreads} * gridDim.x;
  const int64_t first = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  // Elements before the first 16-byte boundary of param, then float4s, then the rest.
  const int64_t head = ((16 - reinterpret_cast<uintptr_t>(param) % 16) % 16) / 4;
  const int64_t lead = head < n ? head : n;
  const bool vector = (reinterpret_cast<uintptr_t>(param + lead) % 16) ==
                      (reinterpret_cast<uintptr_t>(delta + lead) % 16);
  if (!vector) {
    for (int64_t i = first; i < n; i += stride) param[i] = Apply(param[i], delta[i], decay);
    return;
  }
  for (int64_t i = first; i < lead; i += stride) param[i] = Apply(param[i], delta[i], decay);
  const int64_t vectors = (n - lead) / 4;
  float4* p4 = reinterpret_cast<float4*>(param + lead);
  const float4* d4 = reinterpret_cast<const float4*>(delta + lead);
  for (int64_t v = first; v < vectors; v += stride) {
    float4 p = p4[v];
    const float4 d = d4[v];
    p.x = Apply(p.x, d.x, decay);
    p.y = Apply(p.y, d.y, decay);
    p.z = Apply(p.z, d.z, decay);
    p.w = Apply(p.w, d.w, decay);
    p4[v] = p;
  }
  for (int64_t i = lead + vectors * 4 + first; i < n; i += stride) {
    param[i] = Apply(param[i], delta[i], decay);
  }
}

}  // namespace

Status LaunchApplyDelta(float* param, const float* delta, int64_t n, float decay,
                        cudaStream_t stream) {
  if (n <= 0) return Status::Ok();
  const int64_t work = (n + 3) / 4;
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  ApplyDeltaKernel<<<static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks), kThreads, 0,
                     stream>>>(param, delta, n, decay);
  return CudaStatus(cudaGetLastError(), "apply-delta kernel launch");
}

}  // namespace cuda
}  // namespace emsa
