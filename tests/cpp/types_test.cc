// Tests for include/emsa/types.h and status.h: names, parsing, byte sizes.
#include "emsa/types.h"

#include <gtest/gtest.h>

namespace emsa {
namespace {

TEST(Types, ParsesBudgets) {
  EXPECT_EQ(*ParseBytes("24GiB"), 24ull << 30);
  EXPECT_EQ(*ParseBytes(" 512 MiB "), 512ull << 20);
  EXPECT_EQ(*ParseBytes("1.5GiB"), 3ull << 29);
  EXPECT_EQ(*ParseBytes("1000000"), 1000000u);
  EXPECT_EQ(*ParseBytes("2KB"), 2000u);
  EXPECT_EQ(*ParseBytes("7B"), 7u);
  EXPECT_EQ(*ParseBytes("0"), 0u);
  for (const char* bad : {"", "GiB", "-1GiB", "12 parsecs", "inf", "nan", "2PiB", "5000TiB"}) {
    auto r = ParseBytes(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_FALSE(r.status().message().empty());
  }
}

TEST(Types, FormatsBytes) {
  EXPECT_EQ(FormatBytes(24ull << 30), "24.00 GiB");
  EXPECT_EQ(FormatBytes(3ull << 20), "3.00 MiB");
  EXPECT_EQ(FormatBytes(512), "512 B");
}

TEST(Types, DTypesAcceptTorchNamesAndRefuseOthers) {
  EXPECT_EQ(*ParseDType("torch.float32"), DType::kFloat32);
  EXPECT_EQ(*ParseDType("bf16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("half"), DType::kFloat16);
  for (const char* bad : {"float64", "torch.complex64", "int8", ""}) {
    auto r = ParseDType(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(r.status().message().find("float32, bfloat16 or float16"), std::string::npos);
  }
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_STREQ(DTypeName(DType::kFloat16), "float16");
}

TEST(Types, OptimizersAndTiers) {
  EXPECT_EQ(*ParseOptimizer("AdamW"), OptimizerKind::kAdamW);
  EXPECT_EQ(StateCount(OptimizerKind::kLion), 1);
  EXPECT_EQ(StateCount(OptimizerKind::kAdam), 2);
  EXPECT_FALSE(ParseOptimizer("sgd").ok());
  EXPECT_EQ(*ParseTier("l2"), Tier::kL2);
  EXPECT_FALSE(ParseTier("L3").ok());
}

TEST(Status, FormatsAndAnnotates) {
  Status s = Status::Infeasible("needs 3 GiB");
  EXPECT_EQ(s.ToString(), "Infeasible: needs 3 GiB");
  EXPECT_EQ(s.Annotate("plan").message(), "plan: needs 3 GiB");
  EXPECT_TRUE(Status::Ok().Annotate("x").ok());
  Result<int> r = Status::Ok();  // misuse becomes an Internal error, never a fake value
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace emsa
