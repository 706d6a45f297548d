// gpu_test_support.h — what the GPU tests share: skip without a device, and assertions on
// emsa::Status and CUDA results. Include only where EMSA_HAVE_CUDA.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "common/cuda_util.h"
#include "emsa/status.h"

#define SKIP_WITHOUT_DEVICE() \
  if (!::emsa::CudaDeviceUsable()) GTEST_SKIP() << "no usable CUDA device"

#define ASSERT_OK(expr)                                     \
  do {                                                      \
    const ::emsa::Status s_ = (expr);                       \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.ToString(); \
  } while (0)

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr
