// update_adamw.cu — the AdamW instantiations of the fused update kernel (one file per optimizer
// so that the variants compile in parallel).
#include "kernels/cuda/update_kernel.cuh"

namespace emsa {
namespace cuda {

namespace {
const UpdateKernels<OptimizerKind::kAdamW>& Kernels() {
  static const UpdateKernels<OptimizerKind::kAdamW> kernels;
  return kernels;
}
}  // namespace

const UpdateKernelFn* AdamWUpdateKernels() { return Kernels().fn; }
UpdateKernelFn AdamWBulkKernel() { return Kernels().bulk; }

}  // namespace cuda
}  // namespace emsa
