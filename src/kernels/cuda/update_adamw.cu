// update_adamw.cu — the AdamW instantiations of the fused update kernel (one file per optimizer
// so that the variants compile in parallel).
#include "kernels/cuda/update_kernel.cuh"

namespace emsa {
namespace cuda {

const UpdateKernelFn* AdamWUpdateKernels() {
  static const UpdateKernels<OptimizerKind::kAdamW> kernels;
  return kernels.fn;
}

}  // namespace cuda
}  // namespace emsa
