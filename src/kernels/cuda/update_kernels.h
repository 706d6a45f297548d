// update_kernels.h — the update kernels of each optimizer, indexed by VariantIndex().
#pragma once

#include "kernels/cuda/device_table.h"

namespace emsa {
namespace cuda {

using UpdateKernelFn = void (*)(const UpdateLaunch);

// kVariants entries each; null where a variant does not exist (fp32 param with a 16-bit grad).
const UpdateKernelFn* AdamWUpdateKernels();
const UpdateKernelFn* AdamUpdateKernels();
const UpdateKernelFn* LionUpdateKernels();
// The fp32 variant (fp32 param, grad and state) by bulk copies; sm_90 and later only, launched
// with BulkSmemBytes(optimizer) of dynamic shared memory (update_launch.cu).
UpdateKernelFn AdamWBulkKernel();
UpdateKernelFn AdamBulkKernel();
UpdateKernelFn LionBulkKernel();

}  // namespace cuda
}  // namespace emsa
