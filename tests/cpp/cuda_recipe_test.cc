// Tests for the device tier's training-recipe features (include/emsa/cuda_update.h): absent
// tensors (a null gradient in SetGradPointers), per-tensor slot steps, the split step (BeginStep,
// AccumulateGradStats per table, FinishGradStats, Update), stats_only tables, the loss scale read
// from device memory (SetUnscaleFrom) and found_inf written back (WriteFoundInf).
//
// The reference is the CPU updater (bitwise) with each tensor's own step, and float64 sums for
// the gradient statistics. Validation runs everywhere; the rest skips without a CUDA device.
// CudaRecipe.Small* are quick enough for compute-sanitizer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/cuda_util.h"
#include "emsa/cuda_update.h"
#include "status_test_support.h"
#if EMSA_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda_update_support.h"
#include "gpu_test_support.h"
#endif

namespace emsa {
namespace {

// ---- validation: no device needed --------------------------------------------------------------

TensorUpdate FakeTensor(int64_t numel, uintptr_t at) {
  TensorUpdate t;
  t.param = reinterpret_cast<void*>(at);
  t.grad = reinterpret_cast<void*>(at + 0x1000);
  t.exp_avg = reinterpret_cast<void*>(at + 0x2000);
  t.exp_avg_sq = reinterpret_cast<void*>(at + 0x3000);
  t.numel = numel;
  return t;
}

TEST(CudaRecipeValidation, SlotsAreCheckedBeforeTheDevice) {
  std::vector<TensorUpdate> t = {FakeTensor(10, 0x10000), FakeTensor(20, 0x20000),
                                 FakeTensor(0, 0x30000)};
  const DeviceTableOptions o;
  const auto create = [&](const std::vector<int64_t>& slots, const DeviceTableOptions& opt) {
    return DeviceUpdateTable::Create(t.data(), nullptr, t.size(), opt, slots.data()).status();
  };
  ExpectError(create({0, 2, 2}, o), StatusCode::kInvalidArgument, "slot 2 is given to two tensors");
  ExpectError(create({0, -1, 2}, o), StatusCode::kInvalidArgument, "slots[1] is -1");
  ExpectError(create({0, int64_t{1} << 31, 2}, o), StatusCode::kInvalidArgument,
              "slots[1] is 2147483648");
  DeviceTableOptions stats;
  stats.stats_only = true;
  ExpectError(create({0, 1, 2}, stats), StatusCode::kInvalidArgument, "stats_only");
  HyperParams h;
  ExpectError(DeviceScalars::Create(&h, 1, (size_t{1} << 31) + 1).status(),
              StatusCode::kInvalidArgument, "slot_count");
}

// A stats_only table needs only grad, numel and grad_dtype: null param and state pass validation
// (then the device check or the missing device decides); a null grad with elements does not.
TEST(CudaRecipeValidation, StatsOnlyNeedsOnlyGradients) {
  TensorUpdate t;
  t.numel = 10;
  t.grad_dtype = DType::kBFloat16;
  t.param_dtype = DType::kFloat32;  // a bf16 grad with an fp32 param: fine when only stats
  DeviceTableOptions o;
  o.stats_only = true;
  ExpectError(DeviceUpdateTable::Create(&t, nullptr, 1, o).status(), StatusCode::kInvalidArgument,
              "tensors[0].grad is null");
  t.grad = reinterpret_cast<void*>(0x10000);
  const Status s = DeviceUpdateTable::Create(&t, nullptr, 1, o).status();
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.message().find("param"), std::string::npos) << s.ToString();
  EXPECT_EQ(s.message().find("exp_avg"), std::string::npos) << s.ToString();
}

#if EMSA_HAVE_CUDA

using namespace cuda_test;  // NOLINT(google-build-using-namespace): the shared test helpers

// ---- helpers -----------------------------------------------------------------------------------

// Tensors of `sizes` (every 4th misaligned) in one slot table over their own scalars.
struct SlotTable {
  Case c;
  std::vector<Tensor> host;
  DeviceTensors mem;
  std::vector<TensorUpdate> dev;
  HyperParams hyper;
  std::unique_ptr<DeviceScalars> scalars;
  std::unique_ptr<DeviceUpdateTable> table;
};

// slots null: a table with group steps. The scalars get `slot_count` slots.
void MakeSlotTable(const Case& c, const std::vector<int64_t>& sizes, const int64_t* slots,
                   size_t slot_count, uint64_t seed, bool bulk_copy, SlotTable* out) {
  out->c = c;
  Rng rng(seed);
  for (size_t i = 0; i < sizes.size(); ++i) {
    out->host.push_back(MakeTensor(c, sizes[i], i % 4 == 3, 0, rng));
  }
  for (const Tensor& t : out->host) out->dev.push_back(out->mem.Upload(c, t));
  ASSERT_TRUE(out->mem.ok());
  out->hyper = GroupHyper(0, c.optimizer);
  auto scalars = DeviceScalars::Create(&out->hyper, 1, slot_count);
  ASSERT_TRUE(scalars.ok()) << scalars.status().ToString();
  DeviceTableOptions o;
  o.optimizer = c.optimizer;
  o.rounding = c.rounding;
  o.bulk_copy = bulk_copy;
  auto table = DeviceUpdateTable::Create(out->dev.data(), nullptr, out->dev.size(), o, slots);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  out->scalars = std::move(*scalars);
  out->table = std::move(*table);
}

// The CPU update of the present tensors of `state`, tensor i at steps[i], the absent ones as
// they were: the bitwise reference.
std::vector<Tensor> CpuPresent(const Case& c, std::vector<Tensor> state, const HyperParams& hyper,
                               const std::vector<int64_t>& steps, const std::vector<bool>& present,
                               float grad_multiplier, uint64_t seed) {
  std::vector<TensorUpdate> u;
  for (size_t i = 0; i < state.size(); ++i) {
    if (present[i]) u.push_back(HostUpdate(c, state[i], hyper, steps[i]));
  }
  return CpuRun(c, std::move(state), std::move(u), grad_multiplier, seed);
}

// One unchecked step: begin, then the table's update (slot tables advance their own steps).
void SlotStep(SlotTable& t, cudaStream_t stream) {
  ASSERT_OK(t.scalars->BeginStep(stream));
  ASSERT_OK(t.table->Update(*t.scalars, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_CUDA(cudaGetLastError());
}

// The table's gradient pointers with the tensors of `absent` set to null.
std::vector<const void*> GradsWithout(const SlotTable& t, const std::vector<bool>& absent) {
  std::vector<const void*> g(t.dev.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = absent[i] ? nullptr : t.dev[i].grad;
  return g;
}

std::vector<int64_t> SlotSteps(const DeviceScalars& s, cudaStream_t stream) {
  std::vector<int64_t> steps(s.slot_count());
  EXPECT_TRUE(s.ReadSlotSteps(steps.data(), steps.size(), stream).ok());
  return steps;
}

// The cases the recipe tests sweep: fp32 (the bulk-copy kernel on sm_90), bf16 with a master
// and bf16 stochastic states (rounding keys depend on the step), fp16 without a master, Lion.
std::vector<Case> RecipeCases() {
  return {
      {OptimizerKind::kAdamW, DType::kFloat32, DType::kFloat32, DType::kFloat32, false,
       Rounding::kNearest},
      {OptimizerKind::kAdamW, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, true,
       Rounding::kStochastic},
      {OptimizerKind::kAdam, DType::kFloat16, DType::kFloat32, DType::kFloat32, false,
       Rounding::kStochastic},
      {OptimizerKind::kLion, DType::kBFloat16, DType::kFloat32, DType::kBFloat16, false,
       Rounding::kStochastic},
  };
}

// ---- absent tensors and slot steps -------------------------------------------------------------

// Two steps with a different tensor absent each time, slots starting at different steps (one
// tensor of numel 0, never absent): absent tensors stay bitwise as they were and keep their step;
// the others match the CPU updater at their own advanced step. For both kernels (per-thread and,
// fp32 on sm_90, bulk copy: tensors of several chunks, so tiles of absent chunks sit between
// present ones in a block's walk).
TEST(CudaRecipe, SmallAbsentTensorsSkippedOthersAtTheirOwnStep) {
  SKIP_WITHOUT_DEVICE();
  const std::vector<int64_t> sizes = {70001, 4097, 0, 33, 65536, 1, 100003};
  const std::vector<int64_t> slots = {5, 0, 2, 6, 1, 4, 3};  // slot_count 8: slot 7 unused
  const std::vector<int64_t> start = {3, 0, 7, 1, 2, 9, 4, 11};
  for (const Case& c : RecipeCases()) {
    for (bool bulk : {true, false}) {
      SCOPED_TRACE(CaseName(c) + (bulk ? " bulk_copy" : " per-thread"));
      SlotTable t;
      MakeSlotTable(c, sizes, slots.data(), 8, 77, bulk, &t);
      if (HasFatalFailure()) return;
      Stream stream;
      ASSERT_OK(t.scalars->SetInputs(1.0f, 0.0f, 1234, stream.s));
      ASSERT_OK(t.scalars->SetSlotSteps(start.data(), start.size(), stream.s));
      EXPECT_EQ(SlotSteps(*t.scalars, stream.s), start);

      std::vector<Tensor> want = t.host;
      std::vector<int64_t> steps = start;
      const std::vector<std::vector<bool>> absent = {
          {false, true, false, false, true, false, false},
          {true, false, false, false, false, true, true}};
      for (size_t k = 0; k < absent.size(); ++k) {
        SCOPED_TRACE("step " + std::to_string(k + 1));
        std::vector<const void*> grads = GradsWithout(t, absent[k]);
        if (k == 1) grads[2] = nullptr;  // numel 0: never absent, its slot still advances
        ASSERT_OK(t.table->SetGradPointers(grads.data(), grads.size(), stream.s));
        SlotStep(t, stream.s);
        std::vector<int64_t> tensor_steps(sizes.size());
        std::vector<bool> present(sizes.size());
        for (size_t i = 0; i < sizes.size(); ++i) {
          present[i] = !absent[k][i];
          if (present[i]) ++steps[static_cast<size_t>(slots[i])];
          tensor_steps[i] = steps[static_cast<size_t>(slots[i])];
        }
        want = CpuPresent(c, want, t.hyper, tensor_steps, present, 1.0f, 1234);
        ExpectBitwise("absent tensors", c, DownloadAll(t.host, t.dev), want);
        EXPECT_EQ(SlotSteps(*t.scalars, stream.s), steps);
      }
      int device = 0, major = 0;
      ASSERT_CUDA(cudaGetDevice(&device));
      ASSERT_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
      const bool bulk_expected = bulk && c.param == DType::kFloat32 && major >= 9;
      EXPECT_EQ(t.table->bulk_copy_launches(), bulk_expected ? 1 : 0);
    }
  }
}

// A table whose slots all hold the group's step gives the bits of a table without slots, step
// after step (the per-step constants and the rounding keys come from the same step).
TEST(CudaRecipe, SmallSharedSlotStepMatchesGroupStepBitwise) {
  SKIP_WITHOUT_DEVICE();
  const std::vector<int64_t> sizes = {70001, 4097, 33, 1, 32768};
  const std::vector<int64_t> slots = {4, 3, 2, 1, 0};
  for (const Case& c : RecipeCases()) {
    SCOPED_TRACE(CaseName(c));
    SlotTable with, without;
    MakeSlotTable(c, sizes, slots.data(), slots.size(), 99, true, &with);
    MakeSlotTable(c, sizes, nullptr, 0, 99, true, &without);
    if (HasFatalFailure()) return;
    Stream stream;
    const std::vector<int64_t> six(slots.size(), 6);
    ASSERT_OK(with.scalars->SetSlotSteps(six.data(), six.size(), stream.s));
    ASSERT_OK(without.scalars->SetGroup(0, without.hyper, 6, stream.s));
    for (SlotTable* t : {&with, &without}) {
      ASSERT_OK(t->scalars->SetInputs(0.5f, 0.0f, 555, stream.s));
    }
    for (int step = 0; step < 3; ++step) {
      SlotStep(with, stream.s);
      ASSERT_OK(without.scalars->BeginStep(stream.s));
      ASSERT_OK(without.scalars->AdvanceSteps(stream.s));
      SlotStep(without, stream.s);
    }
    ExpectBitwise("slots vs group step", c, DownloadAll(with.host, with.dev),
                  DownloadAll(without.host, without.dev));
    EXPECT_EQ(SlotSteps(*with.scalars, stream.s), std::vector<int64_t>(slots.size(), 9));
    DeviceGroupScalars g;
    DeviceStepHeader h;
    ASSERT_OK(without.scalars->Read(&h, &g, stream.s));
    EXPECT_EQ(g.step, 9);
  }
}

// found_inf (an inf in a present gradient, with the statistics): nothing is written and no slot
// advances. An inf in an absent tensor's gradient memory is not read: the step goes on.
TEST(CudaRecipe, SmallFoundInfLeavesSlotsAndStateAlone) {
  SKIP_WITHOUT_DEVICE();
  const Case c = RecipeCases()[1];
  const std::vector<int64_t> sizes = {4097, 300, 70001};
  const std::vector<int64_t> slots = {0, 1, 2};
  SlotTable t;
  MakeSlotTable(c, sizes, slots.data(), 3, 5, true, &t);
  if (HasFatalFailure()) return;
  Stream stream;
  ASSERT_OK(t.scalars->SetInputs(1.0f, 1.0f, 9, stream.s));
  const uint16_t inf = 0x7F80;  // bf16 +inf
  ASSERT_CUDA(cudaMemcpy(static_cast<uint16_t*>(const_cast<void*>(t.dev[1].grad)) + 17, &inf, 2,
                         cudaMemcpyHostToDevice));
  const auto checked_step = [&](DeviceStepHeader* h) {
    ASSERT_OK(t.scalars->BeginStep(stream.s));
    ASSERT_OK(t.table->AccumulateGradStats(*t.scalars, stream.s));
    ASSERT_OK(t.scalars->FinishGradStats(stream.s));
    ASSERT_OK(t.table->Update(*t.scalars, stream.s));
    ASSERT_OK(t.scalars->Read(h, nullptr, stream.s));
  };
  const std::vector<Tensor> before = DownloadAll(t.host, t.dev);
  DeviceStepHeader h;
  checked_step(&h);
  EXPECT_NE(h.found_inf, 0);
  EXPECT_EQ(h.nonfinite_count, 1);
  ExpectBitwise("found_inf", c, DownloadAll(t.host, t.dev), before);
  EXPECT_EQ(SlotSteps(*t.scalars, stream.s), (std::vector<int64_t>{0, 0, 0}));

  // Tensor 1 absent: its inf is not read, the others update at step 1.
  const std::vector<const void*> grads = GradsWithout(t, {false, true, false});
  ASSERT_OK(t.table->SetGradPointers(grads.data(), grads.size(), stream.s));
  checked_step(&h);
  EXPECT_EQ(h.found_inf, 0);
  EXPECT_EQ(h.nonfinite_count, 0);
  const std::vector<Tensor> want =
      CpuPresent(c, before, t.hyper, {1, 0, 1}, {true, false, true}, h.grad_multiplier, 9);
  ExpectBitwise("tensor 1 absent", c, DownloadAll(t.host, t.dev), want);
  EXPECT_EQ(SlotSteps(*t.scalars, stream.s), (std::vector<int64_t>{1, 0, 1}));
}

// ---- the split step and clipping ---------------------------------------------------------------

// Statistics of two update tables and a stats_only table accumulated one by one (as buckets
// finish in backward): the header's sum of squares is the tables' sums added in order; the
// norm, clip coefficient and multiplier are the float64 formula of clip_grad_norm_ (and of the
// full step, which runs the same calls); the clipped update is the CPU update with that
// multiplier; absent tensors count nothing in any table.
TEST(CudaRecipe, SmallSplitStepStatisticsAndClipping) {
  SKIP_WITHOUT_DEVICE();
  const Case c = RecipeCases()[0];
  const std::vector<int64_t> sizes_a = {70001, 33, 4097}, sizes_b = {65536, 5};
  const std::vector<int64_t> slots_a = {0, 1, 2}, slots_b = {3, 4};
  SlotTable a, b;
  MakeSlotTable(c, sizes_a, slots_a.data(), 5, 11, true, &a);
  MakeSlotTable(c, sizes_b, slots_b.data(), 5, 12, true, &b);
  if (HasFatalFailure()) return;
  DeviceScalars& s = *a.scalars;  // one scalars object for both tables (b's own goes unused)

  // A stats_only table: bf16 gradients of host-tier tensors, only grad/numel/grad_dtype.
  const Case g16{OptimizerKind::kAdamW, DType::kBFloat16, DType::kBFloat16, DType::kFloat32, true,
                 Rounding::kStochastic};
  Rng rng(13);
  std::vector<Tensor> host_tier = {MakeTensor(g16, 9000, false, 0, rng),
                                   MakeTensor(g16, 77, true, 0, rng)};
  DeviceTensors mem;
  std::vector<TensorUpdate> grads_only;
  for (const Tensor& t : host_tier) {
    TensorUpdate full = mem.Upload(g16, t);
    TensorUpdate u;
    u.numel = full.numel;
    u.grad = full.grad;
    u.grad_dtype = DType::kBFloat16;
    grads_only.push_back(u);
  }
  ASSERT_TRUE(mem.ok());
  DeviceTableOptions so;
  so.stats_only = true;
  auto stats_table = DeviceUpdateTable::Create(grads_only.data(), nullptr, grads_only.size(), so);
  ASSERT_TRUE(stats_table.ok()) << stats_table.status().ToString();
  EXPECT_EQ((*stats_table)->launches_per_update(), 0);
  Stream stream;
  ExpectError((*stats_table)->Update(s, stream.s), StatusCode::kInvalidArgument, "stats_only");

  // a's tensor 1 absent.
  const std::vector<const void*> ga = GradsWithout(a, {false, true, false});
  ASSERT_OK(a.table->SetGradPointers(ga.data(), ga.size(), stream.s));
  const float unscale = 0.25f, max_norm = 0.05f;
  ASSERT_OK(s.SetInputs(unscale, max_norm, 31, stream.s));
  ASSERT_OK(s.BeginStep(stream.s));
  DeviceTableStats st[3];
  DeviceUpdateTable* tables[3] = {a.table.get(), b.table.get(), stats_table->get()};
  for (int k = 0; k < 3; ++k) {
    ASSERT_OK(tables[k]->AccumulateGradStats(s, stream.s));
    ASSERT_OK(tables[k]->ReadStats(&st[k], stream.s));
  }
  ASSERT_OK(s.FinishGradStats(stream.s));
  ASSERT_OK(a.table->Update(s, stream.s));
  ASSERT_OK(b.table->Update(s, stream.s));
  DeviceStepHeader h;
  ASSERT_OK(s.Read(&h, nullptr, stream.s));
  ASSERT_CUDA(cudaGetLastError());

  // float64 references (sums in another order: relative 1e-12).
  std::vector<Tensor> a_present = {a.host[0], a.host[2]};
  const double sa = GradSumSq(c, a_present), sb = GradSumSq(c, b.host);
  const double ss = GradSumSq(g16, host_tier);
  EXPECT_NEAR(st[0].sum_sq, sa, 1e-12 * sa);
  EXPECT_NEAR(st[1].sum_sq, sb, 1e-12 * sb);
  EXPECT_NEAR(st[2].sum_sq, ss, 1e-12 * ss);
  EXPECT_EQ(h.sum_sq, (0.0 + st[0].sum_sq + st[1].sum_sq) + st[2].sum_sq);
  const double norm = std::sqrt(h.sum_sq) * unscale;
  EXPECT_EQ(h.grad_norm, norm);
  const double coef = std::min(1.0, static_cast<double>(max_norm) / (norm + 1e-6));
  ASSERT_LT(coef, 1.0) << "the test means clipping to fire";
  EXPECT_EQ(h.clip_coef, static_cast<float>(coef));
  EXPECT_EQ(h.grad_multiplier,
            static_cast<float>(static_cast<double>(unscale) * static_cast<double>(h.clip_coef)));
  EXPECT_EQ(h.found_inf, 0);

  // The updates: the CPU's with grad_multiplier = the device's (unscale * clip_coef).
  const std::vector<Tensor> want_a =
      CpuPresent(c, a.host, a.hyper, {1, 0, 1}, {true, false, true}, h.grad_multiplier, 31);
  ExpectBitwise("table a clipped", c, DownloadAll(a.host, a.dev), want_a);
  const std::vector<Tensor> want_b =
      CpuPresent(c, b.host, b.hyper, {1, 1}, {true, true}, h.grad_multiplier, 31);
  ExpectBitwise("table b clipped", c, DownloadAll(b.host, b.dev), want_b);
  EXPECT_EQ(SlotSteps(s, stream.s), (std::vector<int64_t>{1, 0, 1, 1, 1}));

  // The stats_only table follows new gradients too: tensor 0 absent, an inf in tensor 1.
  const std::vector<const void*> gs = {nullptr, grads_only[1].grad};
  ASSERT_OK((*stats_table)->SetGradPointers(gs.data(), gs.size(), stream.s));
  const uint16_t inf = 0xFF80;  // bf16 -inf
  ASSERT_CUDA(cudaMemcpy(const_cast<void*>(grads_only[1].grad), &inf, 2, cudaMemcpyHostToDevice));
  ASSERT_OK(s.BeginStep(stream.s));
  ASSERT_OK((*stats_table)->AccumulateGradStats(s, stream.s));
  ASSERT_OK(s.FinishGradStats(stream.s));
  ASSERT_OK(s.Read(&h, nullptr, stream.s));
  EXPECT_EQ(h.nonfinite_count, 1);
  EXPECT_NE(h.found_inf, 0);
  ASSERT_OK((*stats_table)->ReadStats(&st[2], stream.s));
  EXPECT_EQ(st[2].first_nonfinite_tensor, 1);
}

// ---- the loss scale from device memory and found_inf back --------------------------------------

TEST(CudaRecipe, SmallUnscaleFromDeviceAndFoundInfOut) {
  SKIP_WITHOUT_DEVICE();
  const Case c = RecipeCases()[0];
  SlotTable t;
  MakeSlotTable(c, {4097, 33}, nullptr, 0, 21, true, &t);
  if (HasFatalFailure()) return;
  DeviceScalars& s = *t.scalars;
  Stream stream;
  float* dev = nullptr;  // [0] the scale, [1] found_inf out
  ASSERT_CUDA(cudaMalloc(&dev, 2 * sizeof(float)));
  const auto read_out = [&]() {
    float v = -1.0f;
    EXPECT_EQ(cudaMemcpy(&v, dev + 1, sizeof v, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  };

  // Good scales: grad_unscale is torch's scale.double().reciprocal().float().
  for (float scale : {65536.0f, 3.0f, 1.5e-3f}) {
    ASSERT_CUDA(cudaMemcpy(dev, &scale, sizeof scale, cudaMemcpyHostToDevice));
    ASSERT_OK(s.SetUnscaleFrom(dev, stream.s));
    ASSERT_OK(s.BeginStep(stream.s));
    DeviceStepHeader h;
    ASSERT_OK(s.Read(&h, nullptr, stream.s));
    EXPECT_EQ(h.grad_unscale, static_cast<float>(1.0 / static_cast<double>(scale))) << scale;
    EXPECT_EQ(h.grad_multiplier, h.grad_unscale);
    EXPECT_EQ(h.found_inf, 0);
    ASSERT_OK(s.WriteFoundInf(dev + 1, stream.s));
    ASSERT_CUDA(cudaStreamSynchronize(stream.s));
    EXPECT_EQ(read_out(), 0.0f);
  }

  // Unusable scales skip the step: nothing written, found_inf out is 1.
  const float bad[] = {0.0f, -2.0f, std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::denorm_min()};  // 1/denorm_min > FLT_MAX
  const std::vector<Tensor> before = DownloadAll(t.host, t.dev);
  for (float scale : bad) {
    ASSERT_CUDA(cudaMemcpy(dev, &scale, sizeof scale, cudaMemcpyHostToDevice));
    ASSERT_OK(s.SetUnscaleFrom(dev, stream.s));
    ASSERT_OK(s.BeginStep(stream.s));
    ASSERT_OK(t.table->AccumulateGradStats(s, stream.s));
    ASSERT_OK(s.FinishGradStats(stream.s));
    ASSERT_OK(s.AdvanceSteps(stream.s));
    ASSERT_OK(t.table->Update(s, stream.s));
    ASSERT_OK(s.WriteFoundInf(dev + 1, stream.s));
    DeviceStepHeader h;
    DeviceGroupScalars g;
    ASSERT_OK(s.Read(&h, &g, stream.s));
    EXPECT_TRUE(std::isnan(h.grad_unscale)) << scale;
    EXPECT_NE(h.found_inf, 0) << scale;
    EXPECT_EQ(g.step, 0) << scale;
    EXPECT_EQ(read_out(), 1.0f) << scale;
  }
  ExpectBitwise("bad loss scales", c, DownloadAll(t.host, t.dev), before);

  // SetInputs brings a usable unscale back.
  ASSERT_OK(s.SetInputs(1.0f, 0.0f, 0, stream.s));
  ASSERT_OK(s.BeginStep(stream.s));
  DeviceStepHeader h;
  ASSERT_OK(s.Read(&h, nullptr, stream.s));
  EXPECT_EQ(h.found_inf, 0);
  (void)cudaFree(dev);
}

// ---- slot steps: read, set, and misuse ---------------------------------------------------------

TEST(CudaRecipe, SmallSlotStepsReadSetAndMisuse) {
  SKIP_WITHOUT_DEVICE();
  const Case c = RecipeCases()[0];
  const std::vector<int64_t> slots = {2, 0};
  SlotTable t;
  MakeSlotTable(c, {100, 200}, slots.data(), 3, 3, true, &t);
  if (HasFatalFailure()) return;
  Stream stream;
  DeviceScalars& s = *t.scalars;
  EXPECT_EQ(t.table->slots_needed(), 3u);
  EXPECT_TRUE(t.table->has_slots());
  EXPECT_EQ(SlotSteps(s, stream.s), (std::vector<int64_t>{0, 0, 0}));
  const std::vector<int64_t> steps = {4, 5, 6};
  ASSERT_OK(s.SetSlotSteps(steps.data(), steps.size(), stream.s));
  EXPECT_EQ(SlotSteps(s, stream.s), steps);
  const std::vector<int64_t> negative = {1, -1, 0};
  ExpectError(s.SetSlotSteps(negative.data(), negative.size(), stream.s),
              StatusCode::kInvalidArgument, "steps[1] is -1");
  ExpectError(s.SetSlotSteps(steps.data(), 2, stream.s), StatusCode::kInvalidArgument,
              "count is 2");
  std::vector<int64_t> out(2);
  ExpectError(s.ReadSlotSteps(out.data(), out.size(), stream.s), StatusCode::kInvalidArgument,
              "count is 2");
  EXPECT_EQ(SlotSteps(s, stream.s), steps);  // refused calls changed nothing

  // Scalars with too few slots (or none) are refused by the slot table's Update.
  HyperParams h = t.hyper;
  auto few = DeviceScalars::Create(&h, 1, 2);
  ASSERT_TRUE(few.ok()) << few.status().ToString();
  ExpectError(t.table->Update(**few, stream.s), StatusCode::kInvalidArgument, "slot 2");
  auto none = DeviceScalars::Create(&h, 1);
  ASSERT_TRUE(none.ok());
  ExpectError(t.table->Update(**none, stream.s), StatusCode::kInvalidArgument, "slot_count");
  ExpectError(s.SetUnscaleFrom(nullptr, stream.s), StatusCode::kInvalidArgument,
              "device_scale is null");
  ExpectError(s.WriteFoundInf(nullptr, stream.s), StatusCode::kInvalidArgument,
              "device_dst is null");
}

#endif  // EMSA_HAVE_CUDA

}  // namespace
}  // namespace emsa
