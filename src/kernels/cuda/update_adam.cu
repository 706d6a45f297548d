// update_adam.cu — the Adam (L2 weight decay) instantiations of the fused update kernel (one file
// per optimizer so that the variants compile in parallel).
#include "kernels/cuda/update_kernel.cuh"

namespace emsa {
namespace cuda {

namespace {
const UpdateKernels<OptimizerKind::kAdam>& Kernels() {
  static const UpdateKernels<OptimizerKind::kAdam> kernels;
  return kernels;
}
}  // namespace

const UpdateKernelFn* AdamUpdateKernels() { return Kernels().fn; }
UpdateKernelFn AdamBulkKernel() { return Kernels().bulk; }

}  // namespace cuda
}  // namespace emsa
