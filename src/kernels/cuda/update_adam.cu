// update_adam.cu — the Adam (L2 weight decay) instantiations of the fused update kernel (one file
// per optimizer so that the variants compile in parallel).
#include "kernels/cuda/update_kernel.cuh"

namespace emsa {
namespace cuda {

const UpdateKernelFn* AdamUpdateKernels() {
  static const UpdateKernels<OptimizerKind::kAdam> kernels;
  return kernels.fn;
}

}  // namespace cuda
}  // namespace emsa
