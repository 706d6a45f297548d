// grad_pointers.cu — points a table's tensors at new gradients (DeviceUpdateTable::
// SetGradPointers): one thread per tensor copies the staged pointer in and re-derives the
// tensor's flags, so a gradient that breaks the 16-byte alignment of the vector path takes the
// scalar path instead of a misaligned vector load, and a null gradient marks the tensor absent.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_util.h"
#include "kernels/cuda/device_table.h"

namespace emsa {
namespace cuda {
namespace {

constexpr int kSetGradsThreads = 128;
constexpr int64_t kSetGradsMaxBlocks = 1024;

__global__ void __launch_bounds__(kSetGradsThreads)
    SetGradsKernel(DeviceTensor* tensors, const void* const* grads, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{kSetGradsThreads} + threadIdx.x; i < count;
       i += int64_t{kSetGradsThreads} * gridDim.x) {
    DeviceTensor& t = tensors[i];
    const void* grad = grads[i];
    t.grad = grad;
    t.flags = TensorFlags(t.param, grad, t.exp_avg, t.exp_avg_sq, t.master, t.numel);
  }
}

}  // namespace

Status LaunchSetGrads(DeviceTensor* tensors, const void* const* grads, int64_t count,
                      cudaStream_t stream) {
  if (count <= 0) return Status::Ok();
  const int64_t blocks = (count + kSetGradsThreads - 1) / kSetGradsThreads;
  SetGradsKernel<<<static_cast<unsigned>(blocks < kSetGradsMaxBlocks ? blocks : kSetGradsMaxBlocks),
                   kSetGradsThreads, 0, stream>>>(tensors, grads, count);
  return CudaStatus(cudaGetLastError(), "SetGradPointers kernel launch");
}

}  // namespace cuda
}  // namespace emsa
