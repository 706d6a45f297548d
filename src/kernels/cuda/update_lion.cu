// update_lion.cu — the Lion instantiations of the fused update kernel (one file per optimizer
// so that the variants compile in parallel).
#include "kernels/cuda/update_kernel.cuh"

namespace emsa {
namespace cuda {

const UpdateKernelFn* LionUpdateKernels() {
  static const UpdateKernels<OptimizerKind::kLion> kernels;
  return kernels.fn;
}

}  // namespace cuda
}  // namespace emsa
