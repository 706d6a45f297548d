// update_launch.cu — picks the update kernel of a (optimizer, variant) and launches it.
#include <cuda_runtime.h>

#include <string>

#include "common/cuda_util.h"
#include "kernels/cuda/device_table.h"
#include "kernels/cuda/update_kernel.cuh"
#include "kernels/cuda/update_kernels.h"

namespace emsa {
namespace cuda {
namespace {

Result<UpdateKernelFn> Find(OptimizerKind optimizer, Variant variant) {
  const UpdateKernelFn* table = nullptr;
  switch (optimizer) {
    case OptimizerKind::kAdamW:
      table = AdamWUpdateKernels();
      break;
    case OptimizerKind::kAdam:
      table = AdamUpdateKernels();
      break;
    case OptimizerKind::kLion:
      table = LionUpdateKernels();
      break;
  }
  const int index = VariantIndex(variant);
  if (table == nullptr || index < 0 || index >= kVariants || table[index] == nullptr) {
    return Status::Internal("no update kernel for optimizer " +
                            std::to_string(static_cast<int>(optimizer)) + ", variant " +
                            std::to_string(index) + " (the table should have rejected it)");
  }
  return table[index];
}

}  // namespace

Result<int> UpdateBlocksPerSm(OptimizerKind optimizer, Variant variant) {
  EMSA_ASSIGN_OR_RETURN(UpdateKernelFn fn, Find(optimizer, variant));
  int blocks = 0;
  EMSA_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, reinterpret_cast<const void*>(fn), kUpdateThreads, 0));
  if (blocks < 1) {
    return Status::Internal("the update kernel fits no block of " + std::to_string(kUpdateThreads) +
                            " threads on an SM");
  }
  return blocks;
}

Status LaunchUpdate(OptimizerKind optimizer, Variant variant, const UpdateLaunch& launch,
                    cudaStream_t stream, const DeviceAccessWindow* window) {
  if (launch.chunk_count == 0) return Status::Ok();
  EMSA_ASSIGN_OR_RETURN(UpdateKernelFn fn, Find(optimizer, variant));
  UpdateLaunch arg = launch;
  void* args[] = {&arg};
  if (window == nullptr || window->bytes == 0) {
    EMSA_CUDA_RETURN_IF_ERROR(cudaLaunchKernel(reinterpret_cast<const void*>(fn),
                                               dim3(static_cast<unsigned>(launch.grid)),
                                               dim3(kUpdateThreads), args, 0, stream));
    return CudaStatus(cudaGetLastError(), "fused update kernel launch");
  }
  // Tier L0: this launch's accesses to the window persist in the L2 set-aside (hitProp), the
  // rest stream (missProp) so that they do not evict what persists.
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeAccessPolicyWindow;
  attribute.val.accessPolicyWindow.base_ptr = const_cast<void*>(window->base);
  attribute.val.accessPolicyWindow.num_bytes = window->bytes;
  attribute.val.accessPolicyWindow.hitRatio = window->hit_ratio;
  attribute.val.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
  attribute.val.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(launch.grid));
  config.blockDim = dim3(kUpdateThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  EMSA_CUDA_RETURN_IF_ERROR(cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(fn), args));
  return CudaStatus(cudaGetLastError(), "fused update kernel launch (L2 access window)");
}

}  // namespace cuda
}  // namespace emsa
