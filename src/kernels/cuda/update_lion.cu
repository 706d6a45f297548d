// update_lion.cu — the Lion instantiations of the fused update kernel (one file per optimizer
// so that the variants compile in parallel).
#include "kernels/cuda/update_kernel.cuh"

namespace emsa {
namespace cuda {

namespace {
const UpdateKernels<OptimizerKind::kLion>& Kernels() {
  static const UpdateKernels<OptimizerKind::kLion> kernels;
  return kernels;
}
}  // namespace

const UpdateKernelFn* LionUpdateKernels() { return Kernels().fn; }
UpdateKernelFn LionBulkKernel() { return Kernels().bulk; }

}  // namespace cuda
}  // namespace emsa
