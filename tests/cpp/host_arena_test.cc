// Tests for include/emsa/host_arena.h: sizes, alignment, zero fill (serial and pooled), views.
#include "emsa/host_arena.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_util.h"
#include "common/thread_pool.h"

namespace emsa {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// Index of the first non-zero byte, or -1.
int64_t FirstNonZero(const void* data, uint64_t bytes) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (uint64_t i = 0; i < bytes; ++i) {
    if (p[i] != 0) return static_cast<int64_t>(i);
  }
  return -1;
}

TEST(HostArena, PageableIsAlignedSizedAndZeroed) {
  const uint64_t bytes = 5 * kMiB + 3;
  Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, /*want_pinned=*/false);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  const HostArena& a = **arena;
  EXPECT_EQ(a.kind(), HostArena::Kind::kPageable);
  EXPECT_EQ(a.size(), bytes);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % (2 * kMiB), 0u);
  EXPECT_EQ(FirstNonZero(a.data(), bytes), -1);
}

// Pages of [data, data + bytes) that are not resident in RAM.
int64_t NonResidentPages(const void* data, uint64_t bytes) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  if (mincore(const_cast<void*>(data), bytes, resident.data()) != 0) {
    ADD_FAILURE() << "mincore failed";
    return -1;
  }
  int64_t missing = 0;
  for (unsigned char r : resident) missing += (r & 1) ? 0 : 1;
  return missing;
}

// Creation must touch every page (no page faults later, during steps) and leave zeros, whether
// the fill runs on this thread or on a pool; memory the allocator hands back dirty must not
// leak through either.
TEST(HostArena, ZeroFilledAndResidentAtCreation) {
  ThreadPool pool(3);
  for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
    for (int round = 0; round < 3; ++round) {
      const uint64_t bytes = 9 * kMiB + 4097;
      Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, false, p);
      ASSERT_TRUE(arena.ok()) << arena.status().ToString();
      EXPECT_EQ(NonResidentPages((*arena)->data(), bytes), 0) << "round " << round;
      EXPECT_EQ(FirstNonZero((*arena)->data(), bytes), -1) << "round " << round;
      std::memset((*arena)->data(), 0xAB, bytes);
    }
  }
}

TEST(HostArena, PinnedRequestFallsBackWithoutADevice) {
  Result<std::unique_ptr<HostArena>> arena = HostArena::Create(3 * kMiB, /*want_pinned=*/true);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  // Pinned where a device is usable (the GPU host), pageable here; either way zeroed memory.
  const HostArena& a = **arena;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 4096, 0u);
  EXPECT_EQ(FirstNonZero(a.data(), a.size()), -1);
  std::memset(a.data(), 1, a.size());
#if EMSA_HAVE_CUDA
  const bool device_usable = CudaDeviceUsable();
#else
  const bool device_usable = false;
#endif
  EXPECT_EQ(a.kind(), device_usable ? HostArena::Kind::kPinned : HostArena::Kind::kPageable);
}

// Pinned memory is memory the device copies to and from directly (the pointer is registered
// host memory), zero-filled, and freed without error. GPU only.
TEST(HostArena, PinnedIsCopyableByTheDevice) {
#if EMSA_HAVE_CUDA
  if (!CudaDeviceUsable()) GTEST_SKIP() << "no usable CUDA device";
  {
    const uint64_t bytes = 5 * kMiB + 12;  // not a multiple of the huge page
    ThreadPool pool(2);
    Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, true, &pool);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    const HostArena& a = **arena;
    ASSERT_EQ(a.kind(), HostArena::Kind::kPinned);
    EXPECT_EQ(FirstNonZero(a.data(), bytes), -1);
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, a.data()), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost);
    auto* host = static_cast<unsigned char*>(a.data());
    for (uint64_t i = 0; i < bytes; ++i) host[i] = static_cast<unsigned char>(i * 7 + 1);
    void* dev = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, bytes), cudaSuccess);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    std::vector<unsigned char> expect(host, host + bytes);
    ASSERT_EQ(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::memset(host, 0, bytes);
    ASSERT_EQ(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(std::memcmp(host, expect.data(), bytes), 0);
    EXPECT_EQ(cudaFree(dev), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  }
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

TEST(HostArena, ViewsAreBoundsAndAlignmentChecked) {
  const uint64_t bytes = 4096 + 8;
  Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, false);
  ASSERT_TRUE(arena.ok());
  const HostArena& a = **arena;
  char* base = static_cast<char*>(a.data());

  float* all = a.View<float>(0, bytes / sizeof(float));
  ASSERT_EQ(static_cast<void*>(all), a.data());
  all[bytes / sizeof(float) - 1] = 3.5f;  // the last element is inside the arena
  EXPECT_EQ(a.View<double>(bytes - 8, 1), reinterpret_cast<double*>(base + bytes - 8));
  EXPECT_EQ(a.View<float>(bytes, 0), reinterpret_cast<float*>(base + bytes));  // empty, at end

  EXPECT_EQ(a.View<float>(0, bytes / sizeof(float) + 1), nullptr);  // one past the end
  EXPECT_EQ(a.View<double>(bytes - 4, 1), nullptr);                 // straddles the end
  EXPECT_EQ(a.View<float>(bytes + 4, 0), nullptr);                  // starts past the end
  EXPECT_EQ(a.View<float>(2, 1), nullptr);                          // misaligned
  EXPECT_EQ(a.View<float>(4, UINT64_MAX), nullptr);                 // count overflow
  EXPECT_EQ(a.View<float>(UINT64_MAX - 3, 1), nullptr);             // offset overflow
}

TEST(HostArena, BadSizesAreRejected) {
  for (uint64_t bytes : {uint64_t{0}, (uint64_t{1} << 50) + 1, UINT64_MAX}) {
    Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, false);
    ASSERT_FALSE(arena.ok()) << bytes;
    EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument) << bytes;
    EXPECT_NE(arena.status().message().find(std::to_string(bytes)), std::string::npos)
        << arena.status().message();
  }
}

// 1 PiB is a legal size but more than any machine has: the failure must be a value with the
// size in it, not a crash or a visit from the OOM killer during the zero fill.
TEST(HostArena, FailedAllocationIsOutOfMemoryWithTheSize) {
  const uint64_t bytes = uint64_t{1} << 50;
  Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, false);
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(arena.status().message().find(std::to_string(bytes)), std::string::npos)
      << arena.status().message();
}

}  // namespace
}  // namespace emsa
