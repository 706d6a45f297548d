// stream_update.cu — LaunchStreamUpdate (stream_update.h): a grid-stride loop over one run, one
// element per thread per pass. The run's traffic is in HBM and small next to the PCIe copies of
// its moments that surround it, so the loop keeps to plain loads.
#include "common/cuda_util.h"
#include "kernels/cuda/stream_update.h"
#include "kernels/cuda/update_math.cuh"

namespace emsa {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;

template <bool kBf16>
__device__ __forceinline__ float LoadState(const void* s, int64_t i) {
  if constexpr (kBf16) return Bf16ToFloat(static_cast<const uint16_t*>(s)[i]);
  return static_cast<const float*>(s)[i];
}

template <bool kBf16>
__device__ __forceinline__ void StoreState(void* s, int64_t i, uint32_t bits) {
  if constexpr (kBf16) {
    static_cast<uint16_t*>(s)[i] = static_cast<uint16_t>(bits);
  } else {
    static_cast<uint32_t*>(s)[i] = bits;
  }
}

template <OptimizerKind kOpt, bool kBf16>
__global__ void __launch_bounds__(kThreads)
    StreamUpdateKernel(StepConsts c, Keys keys, bool stochastic, StreamRun run) {
  if (run.header != nullptr) {  // a gated step: the verdict as the release left it
    if (run.header->found_inf != 0) return;
    c.grad_scale *= run.header->grad_multiplier;  // +-1 times it: exactly the CPU's +-multiplier
  }
  const int64_t stride = int64_t{kThreads} * gridDim.x;
  const bool two = kOpt != OptimizerKind::kLion;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < run.count; i += stride) {
    const float m = LoadState<kBf16>(run.exp_avg, i);
    const float v = two ? LoadState<kBf16>(run.exp_avg_sq, i) : 0.0f;
    const uint32_t index = static_cast<uint32_t>(run.first + i);
    const Stored s = StepElement<kOpt, ParamKind::kF32, kBf16>(c, keys, stochastic, index,
                                                               run.param[i], run.grad[i], m, v);
    run.param[i] = BitsFloat(s.param);
    StoreState<kBf16>(run.exp_avg, i, s.exp_avg);
    if (two) StoreState<kBf16>(run.exp_avg_sq, i, s.exp_avg_sq);
  }
}

template <OptimizerKind kOpt>
Status Launch(DType state_dtype, bool stochastic, uint64_t seed, const DeviceGroupScalars& group,
              float grad_multiplier, const StreamRun& run, cudaStream_t stream) {
  const StepConsts c = MakeStepConsts<kOpt>(group, grad_multiplier);  // on the host, as the CPU
  const Keys keys = MakeKeys(seed, c.step, static_cast<uint32_t>(run.first >> 32));
  const int64_t blocks = (run.count + kThreads - 1) / kThreads;
  const dim3 grid(static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks));
  if (state_dtype == DType::kBFloat16) {
    StreamUpdateKernel<kOpt, true><<<grid, kThreads, 0, stream>>>(c, keys, stochastic, run);
  } else {
    StreamUpdateKernel<kOpt, false><<<grid, kThreads, 0, stream>>>(c, keys, stochastic, run);
  }
  return CudaStatus(cudaGetLastError(), "streamed-update kernel launch");
}

}  // namespace

Status LaunchStreamUpdate(OptimizerKind optimizer, DType state_dtype, bool stochastic,
                          uint64_t seed, const DeviceGroupScalars& group, float grad_multiplier,
                          const StreamRun& run, cudaStream_t stream) {
  if (run.count <= 0) return Status::Ok();
  switch (optimizer) {
    case OptimizerKind::kAdam:
      return Launch<OptimizerKind::kAdam>(state_dtype, stochastic, seed, group, grad_multiplier,
                                          run, stream);
    case OptimizerKind::kLion:
      return Launch<OptimizerKind::kLion>(state_dtype, stochastic, seed, group, grad_multiplier,
                                          run, stream);
    default:
      return Launch<OptimizerKind::kAdamW>(state_dtype, stochastic, seed, group, grad_multiplier,
                                           run, stream);
  }
}

}  // namespace cuda
}  // namespace emsa
