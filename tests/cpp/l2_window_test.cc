// Tests for sizing the persisting-L2 window (pure, everywhere) and applying it (GPU only).
#include "memory/l2_window.h"

#include <gtest/gtest.h>

#include <cstdint>

#include "common/cuda_util.h"
#include "emsa/device_arena.h"

namespace emsa {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// An H200 as measured (DESIGN.md): 60 MiB L2, 37.5 MiB persisting, 3.75 MiB reserve steps.
L2Limits H200() {
  L2Limits limits;
  limits.l2_bytes = 60 * kMiB;
  limits.max_persisting_bytes = 75 * kMiB / 2;
  limits.max_window_bytes = 128 * kMiB;
  limits.reserve_step_bytes = 15 * kMiB / 4;
  return limits;
}

const void* At(uint64_t address) { return reinterpret_cast<const void*>(address); }

TEST(L2WindowPlanTest, LargeRangeGetsThreeSixteenthsOfL2) {
  auto plan = PlanL2Window(H200(), At(0x7f0000000000), 100 * kMiB);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->reserve_bytes, 45 * kMiB / 4);  // 11.25 MiB = 3 steps = 3/16 of 60 MiB
  EXPECT_EQ(plan->base, 0x7f0000000000u);
  EXPECT_EQ(plan->window_bytes, 100 * kMiB);
  EXPECT_FLOAT_EQ(plan->hit_ratio, 11.25f / 100.0f);
}

TEST(L2WindowPlanTest, SmallRangeRoundsUpToAStepAndPersistsFully) {
  auto plan = PlanL2Window(H200(), At(0x1000), 5 * kMiB);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->reserve_bytes, 15 * kMiB / 2);  // two steps cover 5 MiB
  EXPECT_EQ(plan->window_bytes, 5 * kMiB);
  EXPECT_FLOAT_EQ(plan->hit_ratio, 1.0f);
}

TEST(L2WindowPlanTest, WindowIsCutToTheDeviceMaximum) {
  auto plan = PlanL2Window(H200(), At(0x1000), 300 * kMiB);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->window_bytes, 128 * kMiB);
  EXPECT_FLOAT_EQ(plan->hit_ratio, 11.25f / 128.0f);
}

TEST(L2WindowPlanTest, FractionAndPersistingMaximumBoundTheReserve) {
  L2WindowOptions all;
  all.max_l2_fraction = 1.0;
  auto plan = PlanL2Window(H200(), At(0x1000), 100 * kMiB, all);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->reserve_bytes, 75 * kMiB / 2);  // the persisting maximum, not 60 MiB

  // A cap between steps rounds down, never up past it: 0.2 of 60 MiB = 12 MiB -> 3 steps.
  L2WindowOptions fifth;
  fifth.max_l2_fraction = 0.2;
  plan = PlanL2Window(H200(), At(0x1000), 100 * kMiB, fifth);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->reserve_bytes, 45 * kMiB / 4);
}

TEST(L2WindowPlanTest, UnknownStepUsesTheExactSize) {
  L2Limits limits = H200();
  limits.reserve_step_bytes = 0;
  limits.max_window_bytes = 0;  // unknown: no cut
  auto plan = PlanL2Window(limits, At(0x1000), 5 * kMiB + 3);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->reserve_bytes, 5 * kMiB + 3);
  EXPECT_EQ(plan->window_bytes, 5 * kMiB + 3);
  EXPECT_FLOAT_EQ(plan->hit_ratio, 1.0f);
}

TEST(L2WindowPlanTest, NotAvailableCasesSayWhy) {
  L2Limits mig = H200();
  mig.max_persisting_bytes = 0;
  auto none = PlanL2Window(mig, At(0x1000), kMiB);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(none.status().message().find("MIG"), std::string::npos);

  L2WindowOptions tiny;
  tiny.max_l2_fraction = 0.05;  // 3 MiB, below one 3.75 MiB step
  auto below = PlanL2Window(H200(), At(0x1000), 100 * kMiB, tiny);
  ASSERT_FALSE(below.ok());
  EXPECT_EQ(below.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(below.status().message().find("step"), std::string::npos);
}

TEST(L2WindowPlanTest, RejectsBadArguments) {
  EXPECT_EQ(PlanL2Window(H200(), nullptr, kMiB).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanL2Window(H200(), At(0x1000), 0).status().code(), StatusCode::kInvalidArgument);
  for (const double fraction : {0.0, -0.5, 1.5}) {
    L2WindowOptions options;
    options.max_l2_fraction = fraction;
    EXPECT_EQ(PlanL2Window(H200(), At(0x1000), kMiB, options).status().code(),
              StatusCode::kInvalidArgument)
        << fraction;
  }
}

#if EMSA_HAVE_CUDA

TEST(L2WindowGpuTest, EnablesOnAnArenaRangeAndRestoresTheLimit) {
  if (!CudaDeviceUsable()) GTEST_SKIP() << "no usable CUDA device";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto limits = QueryL2Limits(0);
  ASSERT_TRUE(limits.ok()) << limits.status().ToString();
  if (limits->max_persisting_bytes == 0) GTEST_SKIP() << "no persisting L2 on this device";
  EXPECT_GT(limits->reserve_step_bytes, 0u) << "the driver did not round a 1-byte reserve";

  auto arena = DeviceArena::Create(64 * kMiB, 0);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  size_t before = 0;
  ASSERT_EQ(cudaDeviceGetLimit(&before, cudaLimitPersistingL2CacheSize), cudaSuccess);
  {
    auto l2 = L2Window::EnableFor(0, (*arena)->data(), (*arena)->size());
    ASSERT_TRUE(l2.ok()) << l2.status().ToString();
    const L2Window& window = **l2;
    EXPECT_GT(window.granted_bytes(), 0u);
    EXPECT_LE(window.granted_bytes(), limits->max_persisting_bytes);
    EXPECT_EQ(window.window().base_ptr, (*arena)->data());
    EXPECT_GT(window.window().hitRatio, 0.0f);
    EXPECT_LE(window.window().hitRatio, 1.0f);
    EXPECT_LE(window.window().hitRatio * static_cast<double>(window.window().num_bytes),
              static_cast<double>(window.granted_bytes()) * 1.0001);
    EXPECT_EQ(window.window().hitProp, cudaAccessPropertyPersisting);
    EXPECT_EQ(window.window().missProp, cudaAccessPropertyStreaming);

    // The driver accepts the window as a stream attribute too.
    const cudaLaunchAttribute attribute = window.launch_attribute();
    EXPECT_EQ(attribute.id, cudaLaunchAttributeAccessPolicyWindow);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSetAttribute(stream, cudaStreamAttributeAccessPolicyWindow, &attribute.val),
              cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  }
  size_t after = 1;
  ASSERT_EQ(cudaDeviceGetLimit(&after, cudaLimitPersistingL2CacheSize), cudaSuccess);
  EXPECT_EQ(after, before);
}

#endif  // EMSA_HAVE_CUDA

}  // namespace
}  // namespace emsa
