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

UpdateKernelFn BulkKernel(OptimizerKind optimizer) {
  switch (optimizer) {
    case OptimizerKind::kAdamW:
      return AdamWBulkKernel();
    case OptimizerKind::kAdam:
      return AdamBulkKernel();
    case OptimizerKind::kLion:
      return LionBulkKernel();
  }
  return nullptr;
}

size_t BulkSmemBytes(OptimizerKind optimizer) {
  return optimizer == OptimizerKind::kLion ? BulkShape<OptimizerKind::kLion>::kSmemBytes
                                           : BulkShape<OptimizerKind::kAdamW>::kSmemBytes;
}

// The kernel a launch runs and the dynamic shared memory it needs.
struct Kernel {
  UpdateKernelFn fn = nullptr;
  size_t smem = 0;
};
Result<Kernel> KernelFor(OptimizerKind optimizer, Variant variant, bool bulk) {
  if (!bulk) {
    EMSA_ASSIGN_OR_RETURN(UpdateKernelFn fn, Find(optimizer, variant));
    return Kernel{fn, 0};
  }
  if (!BulkVariant(variant)) {
    return Status::Internal("the bulk-copy kernel was asked for a variant it does not serve");
  }
  return Kernel{BulkKernel(optimizer), BulkSmemBytes(optimizer)};
}

}  // namespace

Result<bool> BulkAvailable(OptimizerKind optimizer) {
  int device = 0, major = 0;
  EMSA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  EMSA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) return false;
  const void* fn = reinterpret_cast<const void*>(BulkKernel(optimizer));
  cudaFuncAttributes attr = {};
  EMSA_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, fn));
  if (attr.ptxVersion < 90) return false;
  EMSA_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(BulkSmemBytes(optimizer))));
  return true;
}

Result<int> UpdateBlocksPerSm(OptimizerKind optimizer, Variant variant, bool bulk) {
  EMSA_ASSIGN_OR_RETURN(Kernel k, KernelFor(optimizer, variant, bulk));
  int blocks = 0;
  EMSA_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, reinterpret_cast<const void*>(k.fn), kUpdateThreads, k.smem));
  if (blocks < 1) {
    return Status::Internal("the update kernel fits no block of " + std::to_string(kUpdateThreads) +
                            " threads on an SM");
  }
  return blocks;
}

Status LaunchUpdate(OptimizerKind optimizer, Variant variant, const UpdateLaunch& launch,
                    cudaStream_t stream, const DeviceAccessWindow* window) {
  if (launch.chunk_count == 0) return Status::Ok();
  EMSA_ASSIGN_OR_RETURN(Kernel k, KernelFor(optimizer, variant, launch.bulk != 0));
  const UpdateKernelFn fn = k.fn;
  const size_t smem = k.smem;
  UpdateLaunch arg = launch;
  void* args[] = {&arg};
  if (window == nullptr || window->bytes == 0) {
    EMSA_CUDA_RETURN_IF_ERROR(cudaLaunchKernel(reinterpret_cast<const void*>(fn),
                                               dim3(static_cast<unsigned>(launch.grid)),
                                               dim3(kUpdateThreads), args, smem, stream));
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
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  EMSA_CUDA_RETURN_IF_ERROR(cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(fn), args));
  return CudaStatus(cudaGetLastError(), "fused update kernel launch (L2 access window)");
}

}  // namespace cuda
}  // namespace emsa
