// Tests for include/emsa/cuda_update.h and src/kernels/cuda: every optimizer x dtype combination
// against the CPU kernels (bitwise) and a float64 reference; odd tensor counts and sizes,
// misaligned tensors, several param groups; a bucket over 2^31 elements; bitwise repeatability;
// the found_inf skip; global norm and clipping; a captured CUDA graph; gradients moved by
// SetGradPointers; validation.
//
// Validation and the host run of the device arithmetic (CudaUpdateMath) run everywhere; the
// rest skip cleanly without a CUDA device. CudaUpdate.Small* are quick enough for
// compute-sanitizer (scripts/gpu-check runs them under memcheck and racecheck).
#include "emsa/cuda_update.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/cuda_util.h"
#include "emsa/cpu_update.h"
#include "kernels/cpu/numerics.h"
#include "status_test_support.h"
#if EMSA_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda_update_support.h"
#include "gpu_test_support.h"
#include "kernels/cuda/update_math.cuh"
#include "memory/l2_window.h"
#endif

namespace emsa {
namespace {

// ---- validation: no device needed --------------------------------------------------------------

void* Fake(uintptr_t a) { return reinterpret_cast<void*>(a); }

TensorUpdate FakeTensor(int64_t numel) {
  TensorUpdate t;
  t.param = Fake(0x10000);
  t.grad = Fake(0x20000);
  t.exp_avg = Fake(0x30000);
  t.exp_avg_sq = Fake(0x40000);
  t.numel = numel;
  return t;
}

TEST(CudaUpdateValidation, ScalarsRejectBadGroups) {
  HyperParams h[2];
  ExpectError(DeviceScalars::Create(h, 0).status(), StatusCode::kInvalidArgument, "group_count");
  ExpectError(DeviceScalars::Create(nullptr, 1).status(), StatusCode::kInvalidArgument, "hypers");
  h[1].lr = -1.0f;
  ExpectError(DeviceScalars::Create(h, 2).status(), StatusCode::kInvalidArgument, "hypers[1].lr");
  h[1] = HyperParams{};
  h[1].beta2 = 1.0f;
  ExpectError(DeviceScalars::Create(h, 2).status(), StatusCode::kInvalidArgument,
              "hypers[1].beta2");
  h[1] = HyperParams{};
  h[1].eps = 0.0f;
  ExpectError(DeviceScalars::Create(h, 2).status(), StatusCode::kInvalidArgument, "hypers[1].eps");
  h[1] = HyperParams{};
  h[1].weight_decay = NAN;
  ExpectError(DeviceScalars::Create(h, 2).status(), StatusCode::kInvalidArgument,
              "hypers[1].weight_decay");
}

TEST(CudaUpdateValidation, TableNamesTheBadTensor) {
  DeviceTableOptions o;
  std::vector<TensorUpdate> t = {FakeTensor(10), FakeTensor(10), FakeTensor(10)};
  const auto create = [&](const int32_t* groups = nullptr) {
    return DeviceUpdateTable::Create(t.data(), groups, t.size(), o).status();
  };
  t[1].numel = -1;
  ExpectError(create(), StatusCode::kInvalidArgument, "tensors[1].numel");
  t[1] = FakeTensor(10);
  t[2].grad = nullptr;
  ExpectError(create(), StatusCode::kInvalidArgument, "tensors[2].grad is null");
  t[2] = FakeTensor(10);
  t[0].exp_avg_sq = nullptr;
  ExpectError(create(), StatusCode::kInvalidArgument, "tensors[0].exp_avg_sq");
  t[0] = FakeTensor(10);
  t[1].state_dtype = DType::kFloat16;
  ExpectError(create(), StatusCode::kUnsupported, "tensors[1].state_dtype");
  t[1] = FakeTensor(10);
  t[1].param_dtype = DType::kFloat16;
  t[1].grad_dtype = DType::kBFloat16;
  ExpectError(create(), StatusCode::kUnsupported, "tensors[1].grad_dtype");
  t[1] = FakeTensor(10);
  t[1].master = static_cast<float*>(Fake(0x50000));
  ExpectError(create(), StatusCode::kInvalidArgument, "tensors[1].master");
  t[1] = FakeTensor(10);
  t[1].param_dtype = DType::kBFloat16;
  t[1].grad_dtype = DType::kBFloat16;
  o.rounding = Rounding::kNearest;
  ExpectError(create(), StatusCode::kInvalidArgument, "Rounding::kStochastic");
  o = DeviceTableOptions{};
  t[1] = FakeTensor(10);
  const int32_t groups[3] = {0, -2, 1};
  ExpectError(create(groups), StatusCode::kInvalidArgument, "groups[1]");
  o.optimizer = static_cast<OptimizerKind>(7);
  ExpectError(create(), StatusCode::kInvalidArgument, "options.optimizer");
  o = DeviceTableOptions{};
  ExpectError(DeviceUpdateTable::Create(nullptr, nullptr, 2, o).status(),
              StatusCode::kInvalidArgument, "tensors is null");
  // Lion keeps one moment: a null exp_avg_sq is fine (and then the device check decides).
  o.optimizer = OptimizerKind::kLion;
  t[0].exp_avg_sq = nullptr;
  const Status lion = create();
  EXPECT_FALSE(lion.ok());  // fake pointers: refused by the device check, or no device
  EXPECT_EQ(lion.message().find("exp_avg_sq"), std::string::npos) << lion.ToString();
}

// Valid input: a device checks the pointers (host addresses here: refused); no device or no
// CUDA build: kUnsupported, saying why.
TEST(CudaUpdateValidation, ValidInputNeedsADeviceAndDevicePointers) {
  std::vector<float> host(16);
  TensorUpdate t = FakeTensor(16);
  t.param = host.data();
  const Status s = DeviceUpdateTable::Create(&t, nullptr, 1, DeviceTableOptions{}).status();
  HyperParams h;
  const Status scalars = DeviceScalars::Create(&h, 1).status();
#if EMSA_HAVE_CUDA
  if (CudaDeviceUsable()) {
    ExpectError(s, StatusCode::kInvalidArgument, "tensors[0].param is not device memory");
    EXPECT_TRUE(scalars.ok()) << scalars.ToString();
    return;
  }
#endif
  ExpectError(s, StatusCode::kUnsupported, "DeviceUpdateTable::Create");
  ExpectError(scalars, StatusCode::kUnsupported, "DeviceScalars::Create");
}

#if EMSA_HAVE_CUDA

using namespace cuda_test;  // NOLINT(google-build-using-namespace): the shared test helpers

// float64 torch.optim arithmetic for one tensor, from the stored (dequantized) inputs; checks
// each output element within rtol of its own scale (the magnitude of the terms that make it).
void ExpectNearReference(const Case& c, const Tensor& in, const Tensor& out, const HyperParams& h,
                         int64_t step, double mult) {
  const double lr = h.lr, wd = h.weight_decay, b1 = h.beta1, b2 = h.beta2, eps = h.eps;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  const bool lion = c.optimizer == OptimizerKind::kLion;
  // Storage precision of each output: fp32 1e-6 (arithmetic), else one unit in the last place.
  const auto rtol = [](DType d) {
    return d == DType::kFloat32 ? 1e-6 : d == DType::kBFloat16 ? 0x1p-7 : 0x1p-10;
  };
  const DType p_out = c.master ? DType::kFloat32 : c.param;
  int reported = 0;
  for (int64_t i = 0; i < in.numel; ++i) {
    const double p0 =
        c.master ? ToFloat(DType::kFloat32, in.master, i) : ToFloat(c.param, in.param, i);
    double g = static_cast<double>(ToFloat(c.grad, in.grad, i)) * mult;
    if (h.maximize) g = -g;
    const double m0 = ToFloat(c.state, in.exp_avg, i);
    double p = p0, m = m0, v = 0.0, m_scale = 0.0, v_scale = 0.0;
    if (lion) {
      const double u = b1 * m0 + (1 - b1) * g;
      p = p0 * (1 - lr * wd) - lr * ((u > 0) - (u < 0));
      m = b2 * m0 + (1 - b2) * g;
      m_scale = b2 * std::fabs(m0) + (1 - b2) * std::fabs(g);
    } else {
      // Adam's L2 term: fp32 rounds g + wd*p relative to |g| + |wd*p|, not to the (possibly
      // cancelled) sum, so that is the scale its error is measured against.
      const double g_scale =
          std::fabs(g) + (c.optimizer == OptimizerKind::kAdam ? std::fabs(wd * p0) : 0.0);
      if (c.optimizer == OptimizerKind::kAdam) g += wd * p0;
      if (c.optimizer == OptimizerKind::kAdamW) p = p0 * (1 - lr * wd);
      const double v0 = ToFloat(c.state, in.exp_avg_sq, i);
      m = b1 * m0 + (1 - b1) * g;
      v = b2 * v0 + (1 - b2) * g * g;
      p -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
      m_scale = b1 * std::fabs(m0) + (1 - b1) * g_scale;
      v_scale = v;
    }
    const double got_p =
        c.master ? ToFloat(DType::kFloat32, out.master, i) : ToFloat(c.param, out.param, i);
    const double got_m = ToFloat(c.state, out.exp_avg, i);
    const double p_err = std::fabs(got_p - p) / ((rtol(p_out) + 1e-6) * std::fabs(p));
    const double m_err = std::fabs(got_m - m) / (rtol(c.state) * std::fabs(m) + 1e-6 * m_scale);
    double v_err = 0.0;
    if (!lion) {
      const double got_v = ToFloat(c.state, out.exp_avg_sq, i);
      v_err = std::fabs(got_v - v) / ((rtol(c.state) + 1e-6) * v_scale);
    }
    if (!(p_err <= 1.0 && m_err <= 1.0 && v_err <= 1.0) && reported++ < 5) {
      ADD_FAILURE() << CaseName(c) << " element " << i << " of " << in.numel
                    << ": error/tolerance p " << p_err << " (got " << got_p << ", want " << p
                    << "), m " << m_err << ", v " << v_err;
    }
  }
}

// ---- the kernels' arithmetic, run on the host: needs no device
// ------------------------------------

// cuda::StepElement over a whole tensor, as the kernels' scalar path runs it.
template <OptimizerKind kOpt, cuda::ParamKind kP, bool kStateBf16>
void EmulateTensor(const Case& c, Tensor* t, const DeviceGroupScalars& group, float mult,
                   uint64_t seed) {
  const cuda::StepConsts consts = cuda::MakeStepConsts<kOpt>(group, mult);
  const bool stochastic = c.rounding == Rounding::kStochastic;
  for (int64_t i = 0; i < t->numel; ++i) {
    const auto high = static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32);
    const cuda::Keys keys = cuda::MakeKeys(seed, consts.step, high);
    const float p =
        c.master ? ToFloat(DType::kFloat32, t->master, i) : ToFloat(c.param, t->param, i);
    const float g = ToFloat(c.grad, t->grad, i);
    const float m = ToFloat(c.state, t->exp_avg, i);
    const float v = t->exp_avg_sq.empty() ? 0.0f : ToFloat(c.state, t->exp_avg_sq, i);
    const cuda::Stored out = cuda::StepElement<kOpt, kP, kStateBf16>(
        consts, keys, stochastic, static_cast<uint32_t>(i), p, g, m, v);
    const size_t s_size = kStateBf16 ? 2 : 4;
    std::memcpy(t->exp_avg.data() + i * s_size, &out.exp_avg, s_size);  // little-endian
    if (!t->exp_avg_sq.empty()) {
      std::memcpy(t->exp_avg_sq.data() + i * s_size, &out.exp_avg_sq, s_size);
    }
    if (c.master) std::memcpy(t->master.data() + i * 4, &out.master, 4);
    const size_t p_size = DTypeSize(c.param);
    std::memcpy(t->param.data() + i * p_size, &out.param, p_size);
  }
}

template <OptimizerKind kOpt, cuda::ParamKind kP>
void EmulateParam(const Case& c, Tensor* t, const DeviceGroupScalars& g, float mult,
                  uint64_t seed) {
  if (c.state == DType::kBFloat16) {
    EmulateTensor<kOpt, kP, true>(c, t, g, mult, seed);
  } else {
    EmulateTensor<kOpt, kP, false>(c, t, g, mult, seed);
  }
}

template <OptimizerKind kOpt>
void EmulateOptimizer(const Case& c, Tensor* t, const DeviceGroupScalars& g, float mult,
                      uint64_t seed) {
  using cuda::ParamKind;
  if (c.param == DType::kFloat32) return EmulateParam<kOpt, ParamKind::kF32>(c, t, g, mult, seed);
  if (c.param == DType::kBFloat16) {
    if (c.master) return EmulateParam<kOpt, ParamKind::kBf16Master>(c, t, g, mult, seed);
    return EmulateParam<kOpt, ParamKind::kBf16>(c, t, g, mult, seed);
  }
  if (c.master) return EmulateParam<kOpt, ParamKind::kF16Master>(c, t, g, mult, seed);
  return EmulateParam<kOpt, ParamKind::kF16>(c, t, g, mult, seed);
}

std::vector<Tensor> Emulate(const Case& c, std::vector<Tensor> tensors,
                            const std::vector<HyperParams>& hypers,
                            const std::vector<int64_t>& steps, float mult, uint64_t seed) {
  for (Tensor& t : tensors) {
    const auto g = static_cast<size_t>(t.group);
    const DeviceGroupScalars group = ToDeviceScalars(hypers[g], steps[g]);
    switch (c.optimizer) {
      case OptimizerKind::kAdamW:
        EmulateOptimizer<OptimizerKind::kAdamW>(c, &t, group, mult, seed);
        break;
      case OptimizerKind::kAdam:
        EmulateOptimizer<OptimizerKind::kAdam>(c, &t, group, mult, seed);
        break;
      case OptimizerKind::kLion:
        EmulateOptimizer<OptimizerKind::kLion>(c, &t, group, mult, seed);
        break;
    }
  }
  return tensors;
}

struct Run {
  std::unique_ptr<DeviceScalars> scalars;
  std::unique_ptr<DeviceUpdateTable> table;
};

// Sets up scalars (groups at step `steps[g] - 1`, then advanced) and runs one Update.
void DeviceStep(const Case& c, const std::vector<TensorUpdate>& dev,
                const std::vector<int32_t>& groups, const std::vector<HyperParams>& hypers,
                const std::vector<int64_t>& steps, float grad_unscale, uint64_t seed,
                cudaStream_t stream) {
  auto scalars = DeviceScalars::Create(hypers.data(), hypers.size());
  ASSERT_TRUE(scalars.ok()) << scalars.status().ToString();
  DeviceTableOptions o;
  o.optimizer = c.optimizer;
  o.rounding = c.rounding;
  auto table = DeviceUpdateTable::Create(dev.data(), groups.data(), dev.size(), o);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  DeviceScalars& s = **scalars;
  for (size_t g = 0; g < hypers.size(); ++g)
    ASSERT_OK(s.SetGroup(g, hypers[g], steps[g] - 1, stream));
  ASSERT_OK(s.SetInputs(grad_unscale, 0.0f, seed, stream));
  ASSERT_OK(s.BeginStep(stream));
  ASSERT_OK(s.AdvanceSteps(stream));
  ASSERT_OK((*table)->Update(s, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_CUDA(cudaGetLastError());
  std::vector<DeviceGroupScalars> after(hypers.size());
  DeviceStepHeader header;
  ASSERT_OK(s.Read(&header, after.data(), stream));
  for (size_t g = 0; g < hypers.size(); ++g) EXPECT_EQ(after[g].step, steps[g]);
  EXPECT_EQ(header.grad_multiplier, grad_unscale);
}

// Runs one case over `sizes` (tensor i in group i % groups, every 5th misaligned) and checks
// the result against the CPU kernels (bitwise) and the float64 reference.
void CheckCase(const Case& c, const std::vector<int64_t>& sizes, int group_count, uint64_t seed) {
  SCOPED_TRACE(CaseName(c));
  Rng rng(seed);
  std::vector<Tensor> host;
  std::vector<int32_t> groups;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int32_t g = static_cast<int32_t>(i % static_cast<size_t>(group_count));
    host.push_back(MakeTensor(c, sizes[i], i % 5 == 4, g, rng));
    groups.push_back(g);
  }
  std::vector<HyperParams> hypers;
  std::vector<int64_t> steps;
  for (int g = 0; g < group_count; ++g) {
    hypers.push_back(GroupHyper(g, c.optimizer));
    steps.push_back(1 + 6 * g);  // step 1 (largest bias correction) and later ones
  }
  const float unscale = 0.5f;  // a loss scale of 2: exact, but the multiply is exercised
  const uint64_t sr_seed = rng.Next();

  DeviceTensors mem;
  std::vector<TensorUpdate> dev;
  for (const Tensor& t : host) dev.push_back(mem.Upload(c, t));
  ASSERT_TRUE(mem.ok());
  Stream stream;
  DeviceStep(c, dev, groups, hypers, steps, unscale, sr_seed, stream.s);
  if (testing::Test::HasFatalFailure()) return;

  const std::vector<Tensor> got = DownloadAll(host, dev);
  const std::vector<Tensor> want = CpuStep(c, host, hypers, steps, unscale, sr_seed);
  ExpectBitwise("vs CPU", c, got, want);
  for (size_t i = 0; i < host.size(); ++i) {
    const size_t g = static_cast<size_t>(host[i].group);
    ExpectNearReference(c, host[i], got[i], hypers[g], steps[g], unscale);
  }
}

// The device arithmetic (update_math.cuh) against the CPU kernels, on this machine: every
// combination, several groups (steps 1, 7, 13; maximize; weight decay), bitwise.
TEST(CudaUpdateMath, TranscriptionMatchesCpuKernelsBitwise) {
  uint64_t seed = 500;
  for (const Case& c : AllCases()) {
    SCOPED_TRACE(CaseName(c));
    Rng rng(++seed);
    std::vector<Tensor> host;
    const int64_t sizes[] = {1, 3, 4097, 1000, 77};
    for (size_t i = 0; i < 5; ++i) {
      host.push_back(MakeTensor(c, sizes[i], false, static_cast<int32_t>(i % 3), rng));
    }
    std::vector<HyperParams> hypers;
    std::vector<int64_t> steps;
    for (int g = 0; g < 3; ++g) {
      hypers.push_back(GroupHyper(g, c.optimizer));
      steps.push_back(1 + 6 * g);
    }
    const uint64_t sr_seed = rng.Next();
    const std::vector<Tensor> got = Emulate(c, host, hypers, steps, 0.5f, sr_seed);
    const std::vector<Tensor> want = CpuStep(c, host, hypers, steps, 0.5f, sr_seed);
    ExpectBitwise("emulated vs CPU", c, got, want);
    for (size_t i = 0; i < host.size(); ++i) {
      const auto g = static_cast<size_t>(host[i].group);
      ExpectNearReference(c, host[i], got[i], hypers[g], steps[g], 0.5);
    }
    if (HasFailure()) return;
  }
}

// The conversions and the hash, over every fp16 pattern and many random floats and bits,
// against numerics.h (NaN inputs excepted where only the payload may differ).
TEST(CudaUpdateMath, ConversionsAndHashMatchNumerics) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float a = cuda::HalfToFloat(h), b = cpu::HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(a)) << h;
      continue;
    }
    ASSERT_EQ(cuda::FloatBits(a), cuda::FloatBits(b)) << "half " << h;
  }
  Rng rng(77);
  for (int i = 0; i < 2000000; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng.Next());
    if (i % 4 == 1) bits = (bits & 0x8FFFFFFFu) | 0x30000000u;  // near fp16's range
    if (i % 4 == 2) bits = (bits & 0x83FFFFFFu) | 0x47000000u;  // near 65504 and past it
    const float f = cuda::BitsFloat(bits);
    const uint32_t r = static_cast<uint32_t>(rng.Next());
    ASSERT_EQ(cuda::Bf16Nearest(f), cpu::Bf16Nearest(f)) << std::hex << bits;
    ASSERT_EQ(cuda::Bf16Stochastic(f, r), cpu::Bf16Stochastic(f, r)) << std::hex << bits;
    if (std::isnan(f)) continue;
    ASSERT_EQ(cuda::HalfNearest(f), cpu::FloatToHalf(f, cpu::HalfRounding::kNearestEven))
        << std::hex << bits;
    ASSERT_EQ(cuda::HalfStochastic(f, r), cpu::HalfStochastic(f, r)) << std::hex << bits;
    ASSERT_EQ(cuda::HashIndex(bits, r), cpu::HashIndex(bits, r));
    const int64_t step = static_cast<int64_t>(r % 100000);
    const uint64_t seed = rng.Next();
    const uint32_t stream = 1 + (r & 1);
    ASSERT_EQ(cuda::StreamKey(seed, step, stream, bits >> 20),
              cpu::StreamKey(seed, step, stream, bits >> 20));
  }
}

TEST(CudaUpdate, SmallEveryCombinationMatchesCpuAndFloat64) {
  SKIP_WITHOUT_DEVICE();
  // Chunk edges (32768), vector tails (odd sizes), misaligned tensors (every 5th), 3 groups.
  const std::vector<int64_t> sizes = {1, 3, 4097, 32768, 32769, 70001, 8, 5, 2, 65536 + 12};
  uint64_t seed = 1000;
  for (const Case& c : AllCases()) {
    CheckCase(c, sizes, 3, ++seed);
    if (HasFatalFailure()) return;
  }
}

TEST(CudaUpdate, SmallManyTensorsInOneTable) {
  SKIP_WITHOUT_DEVICE();
  for (int count : {37, 101}) {
    Rng rng(static_cast<uint64_t>(count));
    std::vector<int64_t> sizes;
    for (int i = 0; i < count; ++i) sizes.push_back(1 + static_cast<int64_t>(rng.Next() % 9000));
    sizes[static_cast<size_t>(count / 2)] = 100003;  // several chunks among small tensors
    CheckCase({OptimizerKind::kAdamW, DType::kFloat32, DType::kFloat32, DType::kFloat32, false,
               Rounding::kStochastic},
              sizes, 4, 77 + static_cast<uint64_t>(count));
    CheckCase({OptimizerKind::kAdamW, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, false,
               Rounding::kStochastic},
              sizes, 2, 99 + static_cast<uint64_t>(count));
    if (HasFatalFailure()) return;
  }
}

TEST(CudaUpdate, SmallEmptyTensorsAndEmptyTable) {
  SKIP_WITHOUT_DEVICE();
  const Case c{OptimizerKind::kAdamW, DType::kFloat32, DType::kFloat32,
               DType::kFloat32,       false,           Rounding::kNearest};
  CheckCase(c, {0, 5, 0}, 1, 5);
  HyperParams h;
  auto scalars = DeviceScalars::Create(&h, 1);
  ASSERT_TRUE(scalars.ok()) << scalars.status().ToString();
  auto table = DeviceUpdateTable::Create(nullptr, nullptr, 0, DeviceTableOptions{});
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  EXPECT_EQ((*table)->launches_per_update(), 0);
  Stream stream;
  ASSERT_OK((*table)->Update(**scalars, stream.s));
  ASSERT_OK((*table)->AccumulateGradStats(**scalars, stream.s));
  ASSERT_CUDA(cudaStreamSynchronize(stream.s));
}

// One group-0 table and its scalars over `host`, uploaded (the Small* tests that run steps
// themselves).
struct SmallTable {
  DeviceTensors mem;
  std::vector<TensorUpdate> dev;
  std::unique_ptr<DeviceScalars> scalars;
  std::unique_ptr<DeviceUpdateTable> table;
};

void MakeSmallTable(const Case& c, const std::vector<Tensor>& host, SmallTable* out,
                    bool bulk_copy = true) {
  for (const Tensor& t : host) out->dev.push_back(out->mem.Upload(c, t));
  ASSERT_TRUE(out->mem.ok());
  HyperParams h = GroupHyper(0, c.optimizer);
  auto scalars = DeviceScalars::Create(&h, 1);
  ASSERT_TRUE(scalars.ok()) << scalars.status().ToString();
  DeviceTableOptions o;
  o.optimizer = c.optimizer;
  o.rounding = c.rounding;
  o.bulk_copy = bulk_copy;
  auto table = DeviceUpdateTable::Create(out->dev.data(), nullptr, out->dev.size(), o);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  out->scalars = std::move(*scalars);
  out->table = std::move(*table);
}

// `steps` unchecked steps (no gradient statistics, no clipping) of one table, with grad_unscale
// and seed as given.
void PlainSteps(DeviceScalars& s, DeviceUpdateTable& table, float grad_unscale, uint64_t seed,
                int steps, cudaStream_t stream) {
  ASSERT_OK(s.SetInputs(grad_unscale, 0.0f, seed, stream));
  for (int step = 0; step < steps; ++step) {
    ASSERT_OK(s.BeginStep(stream));
    ASSERT_OK(s.AdvanceSteps(stream));
    ASSERT_OK(table.Update(s, stream));
  }
}

TEST(CudaUpdate, SmallBitwiseRepeatable) {
  SKIP_WITHOUT_DEVICE();
  const Case c{OptimizerKind::kAdamW, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, false,
               Rounding::kStochastic};
  Rng rng(4242);
  std::vector<Tensor> host = {MakeTensor(c, 100000, false, 0, rng),
                              MakeTensor(c, 777, true, 0, rng)};
  std::vector<Tensor> results[2];
  double sums[2] = {0, 0};
  for (int run = 0; run < 2; ++run) {
    SmallTable t;
    MakeSmallTable(c, host, &t);
    if (HasFatalFailure()) return;
    Stream stream;
    DeviceScalars& s = *t.scalars;
    ASSERT_OK(s.SetInputs(1.0f, 1e9f, 99, stream.s));
    for (int step = 0; step < 3; ++step) {
      ASSERT_OK(s.BeginStep(stream.s));
      ASSERT_OK(t.table->AccumulateGradStats(s, stream.s));
      ASSERT_OK(s.FinishGradStats(stream.s));
      ASSERT_OK(s.AdvanceSteps(stream.s));
      ASSERT_OK(t.table->Update(s, stream.s));
    }
    DeviceStepHeader header;
    ASSERT_OK(s.Read(&header, nullptr, stream.s));
    sums[run] = header.sum_sq;
    results[run] = DownloadAll(host, t.dev);
  }
  EXPECT_EQ(std::memcmp(&sums[0], &sums[1], sizeof(double)), 0);
  ExpectBitwise("run 2 vs run 1", c, results[1], results[0]);
}

// fp32 tables take the bulk-copy kernel on sm_90 and later (DeviceTableOptions::bulk_copy), the
// per-thread kernel elsewhere or when asked: both give the same bits over tiles, partial tiles,
// chunk ends, misaligned tensors (the scalar path inside the bulk kernel) and several steps.
TEST(CudaUpdate, SmallBulkCopyAndPerThreadKernelsAgreeBitwise) {
  SKIP_WITHOUT_DEVICE();
  int device = 0, major = 0;
  ASSERT_CUDA(cudaGetDevice(&device));
  ASSERT_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  for (OptimizerKind opt : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kLion}) {
    const Case c{opt, DType::kFloat32, DType::kFloat32, DType::kFloat32, false, Rounding::kNearest};
    Rng rng(9090);
    std::vector<Tensor> host;
    for (int64_t n : {int64_t{300000}, int64_t{4097}, int64_t{1}, int64_t{3}, int64_t{1024},
                      int64_t{65536 + 1027}}) {
      host.push_back(MakeTensor(c, n, false, 0, rng));
    }
    host.push_back(MakeTensor(c, 5000, true, 0, rng));  // off 16 bytes: the scalar path
    std::vector<Tensor> results[2];                     // [bulk]
    for (int bulk = 0; bulk < 2; ++bulk) {
      SmallTable t;
      MakeSmallTable(c, host, &t, bulk == 1);
      if (HasFatalFailure()) return;
      EXPECT_EQ(t.table->bulk_copy_launches(), bulk == 1 && major >= 9 ? 1 : 0);
      Stream stream;
      PlainSteps(*t.scalars, *t.table, 0.5f, 1, 3, stream.s);
      if (HasFatalFailure()) return;
      ASSERT_CUDA(cudaStreamSynchronize(stream.s));
      results[bulk] = DownloadAll(host, t.dev);
    }
    ExpectBitwise(std::string("bulk copies vs per-thread, ") + CaseName(c), c, results[1],
                  results[0]);
    // and both are the CPU's bits (grad_unscale 0.5 multiplies every gradient)
    HyperParams h = GroupHyper(0, opt);
    std::vector<Tensor> want = host;
    for (int64_t step = 1; step <= 3; ++step) want = CpuStep(c, want, {h}, {step}, 0.5f, 0);
    ExpectBitwise(std::string("bulk copies vs CPU, ") + CaseName(c), c, results[1], want);
  }
}

// Tier L0: the same steps launched with a persisting-L2 access window over the first tensor's
// moments give the same bits as without; a bad window is refused.
TEST(CudaUpdate, SmallAccessWindowLeavesResultsBitwiseUnchanged) {
  SKIP_WITHOUT_DEVICE();
  const Case c{OptimizerKind::kAdamW, DType::kFloat32, DType::kFloat32,
               DType::kFloat32,       false,           Rounding::kStochastic};
  Rng rng(777);
  std::vector<Tensor> host = {MakeTensor(c, 300000, false, 0, rng),
                              MakeTensor(c, 4097, true, 0, rng)};
  std::vector<Tensor> results[2];
  for (int run = 0; run < 2; ++run) {
    SmallTable t;
    MakeSmallTable(c, host, &t);
    if (HasFatalFailure()) return;
    const std::vector<TensorUpdate>& dev = t.dev;
    DeviceUpdateTable& table = *t.table;
    std::unique_ptr<L2Window> window;
    if (run == 1) {
      int device = 0;
      ASSERT_CUDA(cudaGetDevice(&device));
      const uint64_t bytes = static_cast<uint64_t>(dev[0].numel) * 4;
      auto w = L2Window::EnableFor(device, dev[0].exp_avg, bytes);
      if (!w.ok()) GTEST_SKIP() << "no persisting L2 here: " << w.status().ToString();
      window = std::move(*w);
      const DeviceAccessWindow bad{nullptr, bytes, 0.5f};
      EXPECT_EQ(table.SetAccessWindow(bad).code(), StatusCode::kInvalidArgument);
      EXPECT_EQ(table.SetAccessWindow({dev[0].exp_avg, bytes, 1.5f}).code(),
                StatusCode::kInvalidArgument);
      ASSERT_OK(table.SetAccessWindow({dev[0].exp_avg, bytes, window->window().hitRatio}));
    }
    Stream stream;
    PlainSteps(*t.scalars, table, 1.0f, 5, 3, stream.s);
    if (HasFatalFailure()) return;
    ASSERT_CUDA(cudaStreamSynchronize(stream.s));
    results[run] = DownloadAll(host, dev);
    window.reset();
  }
  ExpectBitwise("with the L2 window vs without", c, results[1], results[0]);
}

TEST(CudaUpdate, SmallFoundInfSkipsEverything) {
  SKIP_WITHOUT_DEVICE();
  const Case c{OptimizerKind::kAdamW, DType::kFloat32, DType::kFloat32,
               DType::kFloat32,       false,           Rounding::kNearest};
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    Rng rng(31);
    std::vector<Tensor> host;
    for (int64_t n : {5000, 70000, 3}) host.push_back(MakeTensor(c, n, false, 0, rng));
    FromFloat(DType::kFloat32, &host[1].grad, 65537, bad);  // tensor 1, in its third chunk
    FromFloat(DType::kFloat32, &host[2].grad, 2, bad);
    DeviceTensors mem;
    std::vector<TensorUpdate> dev;
    for (const Tensor& t : host) dev.push_back(mem.Upload(c, t));
    ASSERT_TRUE(mem.ok());
    HyperParams h;
    auto scalars = DeviceScalars::Create(&h, 1);
    ASSERT_TRUE(scalars.ok());
    auto table = DeviceUpdateTable::Create(dev.data(), nullptr, dev.size(), DeviceTableOptions{});
    ASSERT_TRUE(table.ok()) << table.status().ToString();
    Stream stream;
    DeviceScalars& s = **scalars;
    ASSERT_OK(s.SetGroup(0, h, 4, stream.s));
    ASSERT_OK(s.SetInputs(1.0f, 1.0f, 0, stream.s));
    ASSERT_OK(s.BeginStep(stream.s));
    ASSERT_OK((*table)->AccumulateGradStats(s, stream.s));
    ASSERT_OK(s.FinishGradStats(stream.s));
    ASSERT_OK(s.AdvanceSteps(stream.s));
    ASSERT_OK((*table)->Update(s, stream.s));
    DeviceStepHeader header;
    DeviceGroupScalars group;
    ASSERT_OK(s.Read(&header, &group, stream.s));
    EXPECT_EQ(header.found_inf, 1);
    EXPECT_EQ(header.nonfinite_count, 2);
    EXPECT_EQ(group.step, 4) << "a skipped step must not count";
    DeviceTableStats stats;
    ASSERT_OK((*table)->ReadStats(&stats, stream.s));
    EXPECT_EQ(stats.nonfinite_count, 2);
    EXPECT_EQ(stats.first_nonfinite_tensor, 1);
    ExpectBitwise("after a skipped step", c, DownloadAll(host, dev), host);
  }
}

// Global norm over two tables (fp32 and bf16 grads), in double, against a long double sum; then
// the clipped update against the CPU with the device's multiplier.
TEST(CudaUpdate, SmallGlobalNormAndClipping) {
  SKIP_WITHOUT_DEVICE();
  const Case c32{OptimizerKind::kAdamW, DType::kFloat32, DType::kFloat32,
                 DType::kFloat32,       false,           Rounding::kNearest};
  const Case c16{OptimizerKind::kAdamW, DType::kBFloat16, DType::kBFloat16, DType::kFloat32, true,
                 Rounding::kNearest};
  Rng rng(8);
  std::vector<Tensor> h32 = {MakeTensor(c32, 123457, false, 0, rng),
                             MakeTensor(c32, 11, true, 0, rng)};
  std::vector<Tensor> h16 = {MakeTensor(c16, 54321, false, 0, rng)};
  long double sum = 0;
  for (const Tensor& t : h32) {
    for (int64_t i = 0; i < t.numel; ++i)
      sum += std::pow((long double)ToFloat(c32.grad, t.grad, i), 2);
  }
  for (const Tensor& t : h16) {
    for (int64_t i = 0; i < t.numel; ++i)
      sum += std::pow((long double)ToFloat(c16.grad, t.grad, i), 2);
  }
  DeviceTensors mem;
  std::vector<TensorUpdate> d32, d16;
  for (const Tensor& t : h32) d32.push_back(mem.Upload(c32, t));
  for (const Tensor& t : h16) d16.push_back(mem.Upload(c16, t));
  ASSERT_TRUE(mem.ok());
  HyperParams h;
  auto scalars = DeviceScalars::Create(&h, 1);
  ASSERT_TRUE(scalars.ok());
  DeviceTableOptions o;
  o.rounding = Rounding::kNearest;
  auto t32 = DeviceUpdateTable::Create(d32.data(), nullptr, d32.size(), o);
  auto t16 = DeviceUpdateTable::Create(d16.data(), nullptr, d16.size(), o);
  ASSERT_TRUE(t32.ok() && t16.ok());
  Stream stream;
  DeviceScalars& s = **scalars;

  // Poison the outputs, then set the inputs: a loss scale of 4, clip to a tenth of the norm.
  const double norm = std::sqrt(static_cast<double>(sum)) * 0.25;
  DeviceStepHeader* pinned = nullptr;
  ASSERT_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&pinned), sizeof *pinned, 0));
  std::unique_ptr<DeviceStepHeader, void (*)(DeviceStepHeader*)> free_pinned(
      pinned, [](DeviceStepHeader* p) { (void)cudaFreeHost(p); });
  *pinned = DeviceStepHeader{};
  pinned->grad_norm = NAN;
  pinned->clip_coef = NAN;
  pinned->sum_sq = NAN;
  pinned->grad_multiplier = NAN;
  pinned->grad_unscale = 0.25f;
  pinned->max_norm = static_cast<float>(norm / 10);
  ASSERT_OK(s.UploadHeader(pinned, stream.s));
  ASSERT_OK(s.BeginStep(stream.s));
  ASSERT_OK((*t32)->AccumulateGradStats(s, stream.s));
  ASSERT_OK((*t16)->AccumulateGradStats(s, stream.s));
  ASSERT_OK(s.FinishGradStats(stream.s));
  ASSERT_OK(s.AdvanceSteps(stream.s));
  ASSERT_OK((*t32)->Update(s, stream.s));
  ASSERT_OK((*t16)->Update(s, stream.s));
  DeviceStepHeader header;
  ASSERT_OK(s.Read(&header, nullptr, stream.s));
  EXPECT_NEAR(header.sum_sq, static_cast<double>(sum), 1e-12 * static_cast<double>(sum));
  EXPECT_NEAR(header.grad_norm, norm, 1e-12 * norm);
  EXPECT_EQ(header.nonfinite_count, 0);
  EXPECT_EQ(header.found_inf, 0);
  const double coef = std::min(1.0, (norm / 10) / (norm + 1e-6));
  EXPECT_NEAR(header.clip_coef, coef, 1e-6 * coef);
  EXPECT_EQ(header.grad_multiplier, static_cast<float>(0.25 * header.clip_coef));

  const std::vector<HyperParams> hypers = {h};
  const std::vector<int64_t> steps = {1};
  ExpectBitwise("clipped fp32", c32, DownloadAll(h32, d32),
                CpuStep(c32, h32, hypers, steps, header.grad_multiplier, 0));
  ExpectBitwise("clipped bf16+master", c16, DownloadAll(h16, d16),
                CpuStep(c16, h16, hypers, steps, header.grad_multiplier, 0));

  // Without clipping the multiplier is the unscale itself.
  pinned->max_norm = 0.0f;
  ASSERT_OK(s.UploadHeader(pinned, stream.s));
  ASSERT_OK(s.BeginStep(stream.s));
  ASSERT_OK((*t32)->AccumulateGradStats(s, stream.s));
  ASSERT_OK(s.FinishGradStats(stream.s));
  ASSERT_OK(s.Read(&header, nullptr, stream.s));
  EXPECT_EQ(header.clip_coef, 1.0f);
  EXPECT_EQ(header.grad_multiplier, 0.25f);
}

// Gradients at new addresses each step, as torch allocates them: the table follows
// SetGradPointers (the update and the gradient statistics), a gradient off a 16-byte boundary
// switches its tensor to the scalar path and back, a ring's worth of calls queued without a
// sync leaves the last pointers in place, and a rejected call changes nothing. (A null gradient
// is no longer rejected: it marks the tensor absent, cuda_recipe_test.cc.)
TEST(CudaUpdate, SmallSetGradPointersFollowsNewGradients) {
  SKIP_WITHOUT_DEVICE();
  const Case c{OptimizerKind::kAdamW, DType::kFloat32, DType::kFloat32,
               DType::kFloat32,       false,           Rounding::kNearest};
  const int64_t sizes[] = {4097, 70001, 0, 33};
  Rng rng(606);
  std::vector<Tensor> host;
  for (int64_t n : sizes) host.push_back(MakeTensor(c, n, false, 0, rng));
  DeviceTensors mem;
  std::vector<TensorUpdate> dev;
  for (const Tensor& t : host) dev.push_back(mem.Upload(c, t));
  // A second gradient for every tensor, elsewhere; tensor 1's one element off 16 bytes.
  std::vector<Tensor> other_host;
  std::vector<const void*> grads_a, grads_b;
  for (size_t i = 0; i < host.size(); ++i) {
    other_host.push_back(MakeTensor(c, sizes[i], i == 1, 0, rng));
    grads_a.push_back(dev[i].grad);
    grads_b.push_back(sizes[i] == 0 ? nullptr : mem.Upload(c, other_host.back()).grad);
  }
  ASSERT_TRUE(mem.ok());
  ASSERT_NE(reinterpret_cast<uintptr_t>(grads_b[1]) % 16, 0u) << "the test needs a misaligned grad";
  const std::vector<Tensor> original = host;
  const auto with_grads = [&](std::vector<Tensor> state, const std::vector<Tensor>& from) {
    for (size_t i = 0; i < state.size(); ++i) state[i].grad = from[i].grad;
    return state;
  };

  HyperParams h = GroupHyper(0, c.optimizer);
  auto scalars = DeviceScalars::Create(&h, 1);
  ASSERT_TRUE(scalars.ok()) << scalars.status().ToString();
  DeviceTableOptions o;
  o.rounding = c.rounding;
  auto made = DeviceUpdateTable::Create(dev.data(), nullptr, dev.size(), o);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  DeviceUpdateTable& table = **made;
  DeviceScalars& s = **scalars;
  Stream stream;
  // One checked step; returns the sum of squares the device saw.
  const auto step = [&]() {
    DeviceStepHeader header;
    EXPECT_TRUE(s.BeginStep(stream.s).ok());
    EXPECT_TRUE(table.AccumulateGradStats(s, stream.s).ok());
    EXPECT_TRUE(s.FinishGradStats(stream.s).ok());
    EXPECT_TRUE(s.AdvanceSteps(stream.s).ok());
    EXPECT_TRUE(table.Update(s, stream.s).ok());
    EXPECT_TRUE(s.Read(&header, nullptr, stream.s).ok());
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_EQ(header.found_inf, 0);
    return header.sum_sq;
  };
  // Every stream as the device holds it now; the gradients are read from Create's pointers.
  const auto state_now = [&]() { return DownloadAll(original, dev); };

  // Step 1 on the second gradients (one misaligned).
  ASSERT_OK(table.SetGradPointers(grads_b.data(), grads_b.size(), stream.s));
  double sum_sq = step();
  std::vector<Tensor> want = CpuStep(c, with_grads(original, other_host), {h}, {1}, 1.0f, 0);
  EXPECT_NEAR(sum_sq, GradSumSq(c, other_host), 1e-12 * GradSumSq(c, other_host))
      << "the gradient statistics did not read the new gradients";
  std::vector<Tensor> got = state_now();
  for (size_t i = 0; i < got.size(); ++i) got[i].grad = want[i].grad;  // not Create's grads
  ExpectBitwise("step 1 on the second gradients", c, got, want);

  // Rejected calls change nothing: the next step still reads the second gradients.
  std::vector<const void*> bad = grads_b;
  ExpectError(table.SetGradPointers(bad.data(), bad.size() - 1, stream.s),
              StatusCode::kInvalidArgument, "count is 3 but the table holds 4");
  bad = grads_b;
  bad[3] = static_cast<const char*>(grads_a[3]) + 2;
  ExpectError(table.SetGradPointers(bad.data(), bad.size(), stream.s), StatusCode::kInvalidArgument,
              "grads[3] is not aligned to its 4-byte elements");
  ExpectError(table.SetGradPointers(nullptr, bad.size(), stream.s), StatusCode::kInvalidArgument,
              "grads is null");
  ASSERT_OK(table.SetGradPointers(grads_b.data(), grads_b.size(), stream.s));  // unchanged: no-op
  sum_sq = step();
  want = CpuStep(c, want, {h}, {2}, 1.0f, 0);
  got = state_now();
  for (size_t i = 0; i < got.size(); ++i) got[i].grad = want[i].grad;
  ExpectBitwise("step 2 after rejected calls", c, got, want);

  // More calls than staging slots, queued without a sync, alternating; the last one (the first
  // gradients, all aligned: vector path again) must win.
  for (int k = 0; k < 3 * DeviceUpdateTable::kGradStagingSlots + 1; ++k) {
    const std::vector<const void*>& g = k % 2 == 0 ? grads_a : grads_b;
    ASSERT_OK(table.SetGradPointers(g.data(), g.size(), stream.s));
  }
  sum_sq = step();
  EXPECT_NEAR(sum_sq, GradSumSq(c, original), 1e-12 * GradSumSq(c, original));
  want = CpuStep(c, with_grads(want, original), {h}, {3}, 1.0f, 0);
  ExpectBitwise("step 3 back on the first gradients", c, state_now(), want);
}

// A whole step captured once, replayed with a new lr each time through pinned memory.
TEST(CudaUpdate, SmallCapturedGraphReplaysWithNewLr) {
  SKIP_WITHOUT_DEVICE();
  const Case c{OptimizerKind::kAdamW, DType::kFloat32, DType::kFloat32,
               DType::kFloat32,       false,           Rounding::kNearest};
  Rng rng(12);
  std::vector<Tensor> host = {MakeTensor(c, 40000, false, 0, rng),
                              MakeTensor(c, 999, true, 0, rng)};
  DeviceTensors mem;
  std::vector<TensorUpdate> dev;
  for (const Tensor& t : host) dev.push_back(mem.Upload(c, t));
  ASSERT_TRUE(mem.ok());
  HyperParams h = GroupHyper(0, c.optimizer);
  auto scalars = DeviceScalars::Create(&h, 1);
  ASSERT_TRUE(scalars.ok());
  auto table = DeviceUpdateTable::Create(dev.data(), nullptr, dev.size(), DeviceTableOptions{});
  ASSERT_TRUE(table.ok());
  DeviceScalars& s = **scalars;
  DeviceGroupScalars* pinned = nullptr;
  ASSERT_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&pinned), sizeof *pinned, 0));
  std::unique_ptr<DeviceGroupScalars, void (*)(DeviceGroupScalars*)> free_pinned(
      pinned, [](DeviceGroupScalars* p) { (void)cudaFreeHost(p); });
  Stream stream;

  // The graph copies the group (lr, step) in from pinned memory, then steps.
  cudaGraph_t graph = nullptr;
  // Global mode, as torch.cuda.graph captures by default: the strictest about what may run.
  ASSERT_CUDA(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal));
  Status captured = s.UploadGroups(pinned, stream.s);
  if (captured.ok()) captured = s.BeginStep(stream.s);
  if (captured.ok()) captured = s.AdvanceSteps(stream.s);
  if (captured.ok()) captured = (*table)->Update(s, stream.s);
  ASSERT_CUDA(cudaStreamEndCapture(stream.s, &graph));
  ASSERT_OK(captured);
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  std::vector<Tensor> want = host;
  const float lrs[3] = {1e-3f, 5e-4f, 2e-3f};
  for (int step = 1; step <= 3; ++step) {
    HyperParams hs = h;
    hs.lr = lrs[step - 1];
    *pinned = ToDeviceScalars(hs, step - 1);  // the graph's AdvanceSteps makes it `step`
    ASSERT_CUDA(cudaGraphLaunch(exec, stream.s));
    ASSERT_CUDA(cudaStreamSynchronize(stream.s));  // the pinned value is read at replay
    want = CpuStep(c, want, {hs}, {step}, 1.0f, 0);
  }
  ExpectBitwise("graph replays vs CPU", c, DownloadAll(host, dev), want);
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
}

// A bucket of more than 2^31 elements, one tensor itself longer than 2^31: chunk offsets and
// pointer arithmetic must be 64-bit. bf16 params and grads with an fp32 master and bf16 states
// (12 bytes an element, ~28 GB); slices at the start, across 2^31 and at the end are checked
// against the CPU (round-to-nearest, so a slice computes as the whole would).
TEST(CudaUpdate, BucketBeyond2Pow31Elements) {
  SKIP_WITHOUT_DEVICE();
  const Case c{OptimizerKind::kAdamW, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, true,
               Rounding::kNearest};
  const int64_t sizes[2] = {100000007, (int64_t{1} << 31) + 70001};
  const double bytes = 12.0 * static_cast<double>(sizes[0] + sizes[1]);
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (static_cast<double>(free_bytes) < bytes + 2e9) {
    GTEST_SKIP() << "needs " << bytes / 1e9 << " GB of free device memory, " << free_bytes / 1e9
                 << " GB free";
  }
  // Device buffers filled on the device from a few random host blocks, so the host stays small.
  struct Buf {
    void* p = nullptr;
    ~Buf() {
      if (p != nullptr) (void)cudaFree(p);
    }
  };
  Buf bufs[2][5];
  std::vector<TensorUpdate> dev(2);
  Rng rng(2024);
  constexpr int64_t kBlock = int64_t{1} << 20;
  for (int t = 0; t < 2; ++t) {
    const int64_t n = sizes[t];
    Tensor block = MakeTensor(c, kBlock, false, 0, rng);
    const std::vector<uint8_t>* streams[5] = {&block.param, &block.grad, &block.exp_avg,
                                              &block.exp_avg_sq, &block.master};
    const size_t elem[5] = {2, 2, 2, 2, 4};
    for (int k = 0; k < 5; ++k) {
      ASSERT_CUDA(cudaMalloc(&bufs[t][k].p, static_cast<size_t>(n) * elem[k]));
      // Copies of the block, then a shifted copy, so neighbouring blocks differ.
      for (int64_t at = 0; at < n; at += kBlock) {
        const int64_t len = std::min(kBlock, n - at);
        const int64_t shift = (at / kBlock) % 97;
        const int64_t first = std::min(len, kBlock - shift);
        char* dst = static_cast<char*>(bufs[t][k].p) + at * static_cast<int64_t>(elem[k]);
        ASSERT_CUDA(cudaMemcpy(dst, streams[k]->data() + shift * elem[k],
                               static_cast<size_t>(first) * elem[k], cudaMemcpyHostToDevice));
        if (first < len) {
          ASSERT_CUDA(cudaMemcpy(dst + first * static_cast<int64_t>(elem[k]), streams[k]->data(),
                                 static_cast<size_t>(len - first) * elem[k],
                                 cudaMemcpyHostToDevice));
        }
      }
    }
    dev[t].numel = n;
    dev[t].param_dtype = dev[t].grad_dtype = dev[t].state_dtype = DType::kBFloat16;
    dev[t].param = bufs[t][0].p;
    dev[t].grad = bufs[t][1].p;
    dev[t].exp_avg = bufs[t][2].p;
    dev[t].exp_avg_sq = bufs[t][3].p;
    dev[t].master = static_cast<float*>(bufs[t][4].p);
  }
  // Host copies of the slices before the step.
  struct Slice {
    int t;
    int64_t begin, n;
  };
  std::vector<Slice> slices;
  for (int t = 0; t < 2; ++t) {
    slices.push_back({t, 0, 4097});
    slices.push_back({t, sizes[t] - 70003, 70003});
  }
  slices.push_back({1, (int64_t{1} << 31) - 40000, 80000});
  const auto read_slice = [&](const Slice& sl) {
    Tensor out;
    out.numel = sl.n;
    const TensorUpdate& d = dev[static_cast<size_t>(sl.t)];
    const auto at = [&](const void* p, size_t e) {
      return static_cast<const char*>(p) + sl.begin * static_cast<int64_t>(e);
    };
    out.param = Download(at(d.param, 2), static_cast<size_t>(sl.n) * 2);
    out.grad = Download(at(d.grad, 2), static_cast<size_t>(sl.n) * 2);
    out.exp_avg = Download(at(d.exp_avg, 2), static_cast<size_t>(sl.n) * 2);
    out.exp_avg_sq = Download(at(d.exp_avg_sq, 2), static_cast<size_t>(sl.n) * 2);
    out.master = Download(at(d.master, 4), static_cast<size_t>(sl.n) * 4);
    return out;
  };
  std::vector<Tensor> before;
  for (const Slice& sl : slices) before.push_back(read_slice(sl));

  HyperParams h = GroupHyper(0, c.optimizer);
  auto scalars = DeviceScalars::Create(&h, 1);
  ASSERT_TRUE(scalars.ok());
  DeviceTableOptions o;
  o.rounding = c.rounding;
  auto table = DeviceUpdateTable::Create(dev.data(), nullptr, dev.size(), o);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  EXPECT_EQ((*table)->total_numel(), sizes[0] + sizes[1]);
  Stream stream;
  DeviceScalars& s = **scalars;
  ASSERT_OK(s.SetGroup(0, h, 2, stream.s));
  ASSERT_OK(s.BeginStep(stream.s));
  ASSERT_OK(s.AdvanceSteps(stream.s));
  ASSERT_OK((*table)->Update(s, stream.s));
  ASSERT_CUDA(cudaStreamSynchronize(stream.s));

  for (size_t k = 0; k < slices.size(); ++k) {
    const std::vector<Tensor> got = {read_slice(slices[k])};
    const std::vector<Tensor> want = CpuStep(c, {before[k]}, {h}, {3}, 1.0f, 0);
    ExpectBitwise("slice " + std::to_string(k), c, got, want);
  }
}

#endif  // EMSA_HAVE_CUDA

}  // namespace
}  // namespace emsa
