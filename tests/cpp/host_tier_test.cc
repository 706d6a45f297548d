// Tests for include/emsa/host_tier.h: validation everywhere; on a device, the D2H -> CPU -> H2D
// pipeline against the CpuUpdater run directly on the same inputs (bitwise: the host tier is the
// CPU kernels plus copies), over several steps, buckets submitted out of order, two param groups,
// fp32 and bf16 parameters, odd sizes; the call-order errors; the measurements.
#include "emsa/host_tier.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/cuda_util.h"
#include "emsa/cpu_update.h"
#include "emsa/cuda_update.h"
#include "kernels/cpu/numerics.h"
#include "status_test_support.h"
#if EMSA_HAVE_CUDA
#include <cuda_runtime.h>

#include "gpu_test_support.h"
#include "kernels/cuda/apply_delta.h"
#endif

namespace emsa {
namespace {

std::unique_ptr<CpuUpdater> Updater() {
  CpuUpdaterOptions o;
  o.threads = 2;
  auto u = CpuUpdater::Create(o);
  EXPECT_TRUE(u.ok()) << u.status().ToString();
  return std::move(u).value();
}

TEST(HostTierValidation, NamesTheBadField) {
  auto updater = Updater();
  std::vector<float> buf(4 * 8);
  HostTierTensor t;
  t.update.param = buf.data();
  t.update.grad = buf.data() + 8;
  t.update.exp_avg = buf.data() + 16;
  t.update.exp_avg_sq = buf.data() + 24;
  t.update.numel = 8;
  t.device_param = buf.data();  // never dereferenced: validation fails or no device is used
  HostTierOptions o;
  const auto create = [&](size_t buckets = 1, size_t groups = 1) {
    return HostTier::Create(updater.get(), &t, 1, buckets, groups, nullptr, nullptr, o).status();
  };
#if EMSA_HAVE_CUDA
  t.bucket = 3;
  ExpectError(create(), StatusCode::kInvalidArgument, "tensors[0].bucket is 3");
  t.bucket = 0;
  t.group = 1;
  ExpectError(create(), StatusCode::kInvalidArgument, "tensors[0].group is 1");
  t.group = 0;
  t.update.exp_avg = nullptr;
  ExpectError(create(), StatusCode::kInvalidArgument, "tensors[0]");
  t.update.exp_avg = buf.data() + 16;
  t.device_param = nullptr;
  ExpectError(create(), StatusCode::kInvalidArgument, "tensors[0].device_param");
  t.device_param = buf.data();
  ExpectError(create(2), StatusCode::kInvalidArgument, "bucket 1 has no tensors");
  ExpectError(create(0), StatusCode::kInvalidArgument, "bucket_count");
  o.paced_copies = -1;
  ExpectError(create(), StatusCode::kInvalidArgument, "paced_copies is -1");
  o.paced_copies = 2;
  o.pace_piece_elements = 10;
  ExpectError(create(), StatusCode::kInvalidArgument, "pace_piece_elements is 10");
  o.pace_piece_elements = 1000;
  o.device_delta = true;
  o.delta_staging_elements = 10;
  ExpectError(create(), StatusCode::kInvalidArgument, "delta_staging_elements is 10");
  o.delta_staging_elements = 1000;
  o.stream_piece_elements = 10;
  ExpectError(create(), StatusCode::kInvalidArgument, "stream_piece_elements is 10");
  o.stream_piece_elements = 1000;
  o.stream_slots = 0;
  ExpectError(create(), StatusCode::kInvalidArgument, "stream_slots 0");
  o.stream_slots = 3;
  t.device_update = true;
  t.update.param_dtype = DType::kBFloat16;
  t.update.master = buf.data();
  ExpectError(create(), StatusCode::kInvalidArgument, "tensors[0].device_update needs an fp32");
  t.update.param_dtype = DType::kFloat32;
  t.update.master = nullptr;
  HostTierTensor two[2] = {t, t};
  two[1].device_update = false;
  ExpectError(HostTier::Create(updater.get(), two, 2, 1, 1, nullptr, nullptr, o).status(),
              StatusCode::kInvalidArgument, "tensors[1].device_update differs from the rest");
  t.device_update = false;
  ExpectError(HostTier::Create(nullptr, &t, 1, 1, 1, nullptr, nullptr, o).status(),
              StatusCode::kInvalidArgument, "updater");
#else
  ExpectError(create(), StatusCode::kUnsupported, "CUDA build");
#endif
}

#if EMSA_HAVE_CUDA

uint32_t Hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  return x ^ (x >> 16);
}

float Random(uint32_t seed, int64_t i) {  // in (-1, 1), never zero
  const uint32_t h = Hash(seed * 2654435761U + static_cast<uint32_t>(i));
  return (static_cast<float>(h >> 8) + 0.5f) / 8388608.0f - 1.0f;
}

using cpu::Bf16Nearest;
using cpu::Bf16ToFloat;

// One tensor of the test: pinned host state for the tier, plain host state for the reference.
struct Case {
  int64_t numel;
  DType dtype;
  int32_t group;
  int64_t bucket;
  bool device_update = false;  // HostTierTensor::device_update
};

class HostTierPipeline : public ::testing::Test {
 protected:
  struct Side {  // one copy of every buffer
    std::vector<float*> master, m, v;
    std::vector<void*> param_host, grad_host;
  };

  void SetUp() override {
    SKIP_WITHOUT_DEVICE();
    ASSERT_CUDA(cudaSetDevice(0));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&h2d_, cudaStreamNonBlocking));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&update_, cudaStreamNonBlocking));
  }

  void TearDown() override {
    tier_.reset();
    for (void* p : pinned_) (void)cudaFreeHost(p);
    for (void* p : device_) (void)cudaFree(p);
    for (cudaStream_t s : {compute_, d2h_, h2d_, update_}) {
      if (s != nullptr) (void)cudaStreamDestroy(s);
    }
  }

  void* Pinned(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), cudaSuccess);
    std::memset(p, 0, bytes);
    pinned_.push_back(p);
    return p;
  }
  void* Device(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    device_.push_back(p);
    return p;
  }

  // Builds both sides with the same initial parameters; the tier gets the pinned side.
  void Build(const std::vector<Case>& cases, size_t buckets, size_t groups,
             const HostTierOptions& options = {}) {
    cases_ = cases;
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      const size_t n = static_cast<size_t>(c.numel);
      const size_t pbytes = n * DTypeSize(c.dtype);
      std::vector<float> init(n);
      for (size_t k = 0; k < n; ++k) init[k] = Random(100 + static_cast<uint32_t>(i), k);
      std::vector<uint8_t> param_bytes(pbytes);
      for (size_t k = 0; k < n; ++k) {
        if (c.dtype == DType::kFloat32) {
          std::memcpy(param_bytes.data() + 4 * k, &init[k], 4);
        } else {
          // The master starts at the rounded parameter, as torch's copy does.
          const uint16_t h = Bf16Nearest(init[k]);
          init[k] = Bf16ToFloat(h);
          std::memcpy(param_bytes.data() + 2 * k, &h, 2);
        }
      }
      for (Side* side : {&tier_side_, &ref_side_}) {
        const bool pinned = side == &tier_side_;
        auto alloc = [&](size_t bytes) {
          if (pinned) return Pinned(bytes);
          owned_.emplace_back(bytes, 0);
          return static_cast<void*>(owned_.back().data());
        };
        float* master = static_cast<float*>(alloc(n * 4));
        std::memcpy(master, init.data(), n * 4);
        side->master.push_back(master);
        side->m.push_back(static_cast<float*>(alloc(n * 4)));
        side->v.push_back(static_cast<float*>(alloc(n * 4)));
        side->grad_host.push_back(alloc(pbytes));
        side->param_host.push_back(c.dtype == DType::kFloat32 ? master : alloc(pbytes));
      }
      void* dparam = Device(pbytes);
      ASSERT_CUDA(cudaMemcpy(dparam, param_bytes.data(), pbytes, cudaMemcpyHostToDevice));
      device_params_.push_back(dparam);
      device_grads_.push_back(Device(pbytes));
    }
    std::vector<HostTierTensor> tensors(cases.size());
    for (size_t i = 0; i < cases.size(); ++i) {
      tensors[i].update = Update(tier_side_, i);
      tensors[i].group = cases[i].group;
      tensors[i].bucket = cases[i].bucket;
      tensors[i].device_param = device_params_[i];
      tensors[i].device_update = cases[i].device_update;
      any_device_update_ = any_device_update_ || cases[i].device_update;
    }
    std::vector<bool> on_cpu(buckets, true);
    for (const Case& c : cases) on_cpu[static_cast<size_t>(c.bucket)] = !c.device_update;
    cpu_buckets_ = std::count(on_cpu.begin(), on_cpu.end(), true);
    auto tier = HostTier::Create(tier_updater_.get(), tensors.data(), tensors.size(), buckets,
                                 groups, d2h_, h2d_, options);
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    tier_ = std::move(tier).value();
  }

  TensorUpdate Update(const Side& side, size_t i) const {
    const Case& c = cases_[i];
    TensorUpdate u;
    u.param = side.param_host[i];
    u.grad = side.grad_host[i];
    u.exp_avg = side.m[i];
    u.exp_avg_sq = side.v[i];
    u.master = c.dtype == DType::kFloat32 ? nullptr : side.master[i];
    u.numel = c.numel;
    u.param_dtype = u.grad_dtype = c.dtype;
    return u;
  }

  // Fresh gradients on the device and in the reference's host buffers.
  void NewGrads(uint32_t step) {
    for (size_t i = 0; i < cases_.size(); ++i) {
      const Case& c = cases_[i];
      const size_t n = static_cast<size_t>(c.numel);
      std::vector<uint8_t> g(n * DTypeSize(c.dtype));
      for (size_t k = 0; k < n; ++k) {
        const float x = Random(1000 * step + static_cast<uint32_t>(i), k) * 0.1f;
        if (c.dtype == DType::kFloat32) {
          std::memcpy(g.data() + 4 * k, &x, 4);
        } else {
          const uint16_t h = Bf16Nearest(x);
          std::memcpy(g.data() + 2 * k, &h, 2);
        }
      }
      std::memcpy(ref_side_.grad_host[i], g.data(), g.size());
      if (!late_grads_) {
        ASSERT_CUDA(cudaMemcpy(device_grads_[i], g.data(), g.size(), cudaMemcpyHostToDevice));
        continue;
      }
      // Written on the compute stream behind a long copy: a tier copying before the compute
      // stream's event would read the last step's gradients.
      if (late_source_.size() <= i) late_source_.push_back(Pinned(g.size()));
      std::memcpy(late_source_[i], g.data(), g.size());
      if (late_scratch_ == nullptr) late_scratch_ = Device(kLateScratchBytes);
      ASSERT_CUDA(cudaMemcpyAsync(late_scratch_,
                                  static_cast<char*>(late_scratch_) + kLateScratchBytes / 2,
                                  kLateScratchBytes / 2, cudaMemcpyDeviceToDevice, compute_));
      ASSERT_CUDA(cudaMemcpyAsync(device_grads_[i], late_source_[i], g.size(),
                                  cudaMemcpyHostToDevice, compute_));
    }
  }
  static constexpr size_t kLateScratchBytes = size_t{512} << 20;
  bool late_grads_ = false;  // NewGrads writes them asynchronously on the compute stream
  void* late_scratch_ = nullptr;
  std::vector<void*> late_source_;

  void ReferenceStep(const HyperParams* hypers, const int64_t* steps) {
    std::vector<TensorUpdate> u;
    for (size_t i = 0; i < cases_.size(); ++i) {
      u.push_back(Update(ref_side_, i));
      u.back().step = steps[cases_[i].group];
      u.back().hyper = &hypers[cases_[i].group];
    }
    ASSERT_OK(ref_updater_->Step(u.data(), u.size(), StepOptions{}));
  }

  // The parameters first, as the compute stream sees them after its waits; then (once the
  // device updates' moments are back on the host) the moments.
  void ExpectDeviceEqualsReference(int step) {
    for (size_t i = 0; i < cases_.size(); ++i) {
      const size_t bytes = static_cast<size_t>(cases_[i].numel) * DTypeSize(cases_[i].dtype);
      std::vector<uint8_t> got(bytes);
      ASSERT_CUDA(cudaMemcpy(got.data(), device_params_[i], bytes, cudaMemcpyDeviceToHost));
      ASSERT_EQ(std::memcmp(got.data(), ref_side_.param_host[i], bytes), 0)
          << "tensor " << i << " differs from the CPU updater after step " << step;
    }
    if (any_device_update_) ASSERT_OK(tier_->Synchronize());
    for (size_t i = 0; i < cases_.size(); ++i) {
      const size_t bytes = static_cast<size_t>(cases_[i].numel) * 4;
      ASSERT_EQ(std::memcmp(tier_side_.m[i], ref_side_.m[i], bytes), 0)
          << "exp_avg of tensor " << i << " after step " << step;
      ASSERT_EQ(std::memcmp(tier_side_.v[i], ref_side_.v[i], bytes), 0)
          << "exp_avg_sq of tensor " << i << " after step " << step;
    }
  }
  bool any_device_update_ = false;
  int64_t cpu_buckets_ = 0;  // buckets the CPU updates (the stats count those)

  std::unique_ptr<CpuUpdater> tier_updater_ = Updater();
  std::unique_ptr<CpuUpdater> ref_updater_ = Updater();
  std::vector<Case> cases_;
  Side tier_side_, ref_side_;
  std::vector<std::vector<uint8_t>> owned_;
  std::vector<void*> pinned_, device_, device_params_, device_grads_;
  cudaStream_t compute_ = nullptr, d2h_ = nullptr, h2d_ = nullptr;
  cudaStream_t update_ = nullptr;  // for HostTierOptions::device_update_stream
  std::unique_ptr<HostTier> tier_;

  // Four steps of a scheduler and two groups (one resuming), buckets submitted in gradient-ready
  // order: after each, the device parameters equal the CpuUpdater's bitwise.
  // device_buckets: buckets 0 and 2 (fp32 only) are updated on the device instead.
  void RunStepsAgainstTheCpuUpdater(const HostTierOptions& options, bool device_buckets = false) {
    Build({{1, DType::kFloat32, 0, 2, device_buckets},
           {3, DType::kFloat32, 1, 2, device_buckets},
           {4097, DType::kBFloat16, 0, 1},
           {100003, DType::kFloat32, 1, 1},
           {1 << 20, DType::kFloat32, 0, 0, device_buckets}},
          3, 2, options);
    RunSteps();
  }
  void RunSteps();

  // Gated steps (issue 19) against the CpuUpdater: four steps, each released from a step header
  // that reaches the device only late on the compute stream (behind the late gradients), with
  // multipliers 0.5, then found_inf (the step changes nothing), 0.25, 1; the counts per tensor
  // (group 1 resuming at 4) advance only in the steps not skipped. by_values: released as values
  // instead. absent: tensors 1 (device-updated bucket 2 when device_buckets) and 2 (bf16, bucket
  // 1) have no gradient in step 3.
  void RunGatedSteps(const HostTierOptions& options, bool device_buckets, bool by_values,
                     bool absent);
  void ReferenceStepOf(const HyperParams* hypers, const std::vector<int64_t>& steps,
                       float multiplier, const std::vector<bool>& absent) {
    std::vector<TensorUpdate> u;
    for (size_t i = 0; i < cases_.size(); ++i) {
      if (absent[i]) continue;
      u.push_back(Update(ref_side_, i));
      u.back().step = steps[i];
      u.back().hyper = &hypers[cases_[i].group];
    }
    StepOptions o;
    o.grad_multiplier = multiplier;
    ASSERT_OK(ref_updater_->Step(u.data(), u.size(), o));
  }

  // Under device_delta: the fp32 tensors' host copies still hold their initial values.
  void ExpectHostParamsUntouched() {
    for (size_t i = 0; i < cases_.size(); ++i) {
      if (cases_[i].dtype != DType::kFloat32) continue;
      for (int64_t k = 0; k < cases_[i].numel; ++k) {
        ASSERT_EQ(tier_side_.master[i][k], Random(100 + static_cast<uint32_t>(i), k))
            << "tensor " << i << "'s host copy was written (element " << k << ")";
      }
    }
  }
};

void HostTierPipeline::RunSteps() {
  HyperParams hypers[2];
  hypers[1].weight_decay = 0.0;
  hypers[1].lr = 3e-3;
  int64_t steps[2] = {0, 4};  // group 1 resumes from a loaded state
  for (int s = 1; s <= 4; ++s) {
    ++steps[0];
    ++steps[1];
    hypers[0].lr = 1e-3 * s;  // a scheduler
    NewGrads(static_cast<uint32_t>(s));
    ReferenceStep(hypers, steps);
    ASSERT_OK(tier_->BeginStep(hypers, steps, 2));
    // Gradient-ready order is the reverse of the forward's: submit 2, 1, 0; wait 0, 1, 2.
    for (size_t b : {2u, 1u, 0u}) {
      std::vector<const void*> grads;
      for (size_t i = 0; i < cases_.size(); ++i) {
        if (static_cast<size_t>(cases_[i].bucket) == b) grads.push_back(device_grads_[i]);
      }
      ASSERT_OK(tier_->Submit(b, grads.data(), grads.size(), compute_));
    }
    ASSERT_OK(tier_->WaitGradsCopied(compute_));
    for (size_t b : {0u, 1u, 2u}) ASSERT_OK(tier_->Wait(b, compute_));
    ASSERT_CUDA(cudaStreamSynchronize(compute_));  // only the waits order the uploads before it
    ExpectDeviceEqualsReference(s);
  }
  ASSERT_OK(tier_->Synchronize());
  HostTierStepStats stats[8];
  const size_t n = tier_->Stats(1, stats, 8);
  ASSERT_EQ(n, 4u);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(stats[i].step, static_cast<int64_t>(i + 1));
    EXPECT_EQ(stats[i].buckets, cpu_buckets_);
    EXPECT_EQ(stats[i].device_buckets, 3 - cpu_buckets_);
    EXPECT_EQ(stats[i].stream_up_s > 0.0, cpu_buckets_ < 3);  // the GPU path's copies up
    EXPECT_TRUE(stats[i].complete) << "step " << i + 1;
    EXPECT_EQ(stats[i].d2h_s > 0.0, cpu_buckets_ > 0);
    EXPECT_EQ(stats[i].cpu_s > 0.0, cpu_buckets_ > 0);
    EXPECT_EQ(stats[i].h2d_s > 0.0, cpu_buckets_ > 0);
    EXPECT_GE(stats[i].grad_wait_s, 0.0);
    // The worker's span holds its CPU updates and its waits, disjoint, on one clock.
    EXPECT_GE(stats[i].worker_s + 1e-9, stats[i].cpu_s + stats[i].grad_wait_s);
  }
  EXPECT_EQ(tier_->Stats(3, stats, 8), 2u);
}

void HostTierPipeline::RunGatedSteps(const HostTierOptions& options, bool device_buckets,
                                     bool by_values, bool absent) {
  late_grads_ = true;
  RunStepsAgainstTheCpuUpdater(options, device_buckets);  // four ungated steps first
  HyperParams hypers[2];
  hypers[1].weight_decay = 0.0;
  hypers[1].lr = 3e-3;
  auto scalars = DeviceScalars::Create(hypers, 2);
  ASSERT_TRUE(scalars.ok()) << scalars.status().ToString();
  std::vector<int64_t> counts(cases_.size());
  ASSERT_OK(tier_->ReadSteps(counts.data(), counts.size()));
  for (size_t i = 0; i < cases_.size(); ++i) {
    EXPECT_EQ(counts[i], cases_[i].group == 0 ? 4 : 8) << "tensor " << i << " after 4 steps";
  }
  const float multipliers[4] = {0.5f, 1.0f, 0.25f, 1.0f};
  for (int s = 1; s <= 4; ++s) {
    const bool skip = s == 2;
    std::vector<bool> missing(cases_.size(), false);
    if (absent && s == 3) missing[1] = missing[2] = true;
    hypers[0].lr = 2e-3 * s;
    NewGrads(static_cast<uint32_t>(100 + s));
    if (!skip) {
      for (size_t i = 0; i < cases_.size(); ++i) counts[i] += missing[i] ? 0 : 1;
      ReferenceStepOf(hypers, counts, multipliers[s - 1], missing);
    }
    ASSERT_OK(tier_->BeginStepGated(hypers, 2, true));
    for (size_t b : {2u, 1u, 0u}) {
      std::vector<const void*> grads;
      for (size_t i = 0; i < cases_.size(); ++i) {
        if (static_cast<size_t>(cases_[i].bucket) != b) continue;
        grads.push_back(missing[i] ? nullptr : device_grads_[i]);
      }
      ASSERT_OK(tier_->Submit(b, grads.data(), grads.size(), compute_));
      // Gated: the CPU-updated buckets' copies are enqueued whole at Submit (no pacing); the
      // device-updated ones only after the release.
      EXPECT_EQ(tier_->BucketCopiesEnqueued(b), !(device_buckets && b != 1)) << "bucket " << b;
    }
    if (by_values) {
      ASSERT_OK(tier_->ReleaseValues(multipliers[s - 1], skip));
    } else {
      auto* header = static_cast<DeviceStepHeader*>(Pinned(sizeof(DeviceStepHeader)));
      *header = DeviceStepHeader{};
      header->grad_multiplier = multipliers[s - 1];
      header->found_inf = skip ? 1 : 0;
      ASSERT_OK((*scalars)->UploadHeader(header, compute_));  // late: behind the gradients
      ASSERT_OK(tier_->Release((*scalars)->device_header(), compute_));
    }
    ASSERT_OK(tier_->WaitGradsCopied(compute_));
    for (size_t b : {0u, 1u, 2u}) ASSERT_OK(tier_->Wait(b, compute_));
    ASSERT_CUDA(cudaStreamSynchronize(compute_));
    ExpectDeviceEqualsReference(4 + s);
    ASSERT_OK(tier_->Synchronize());
    std::vector<int64_t> got(cases_.size());
    ASSERT_OK(tier_->ReadSteps(got.data(), got.size()));
    EXPECT_EQ(got, counts) << "step " << 4 + s;
    EXPECT_EQ(tier_->last_skipped(), skip);
    HostTierStepStats st;
    ASSERT_EQ(tier_->Stats(4 + s, &st, 1), 1u);
    EXPECT_TRUE(st.gated);
    EXPECT_EQ(st.skipped, skip);
  }
  for (size_t b = 0; b < 3; ++b) EXPECT_TRUE(tier_->BucketCopiesEnqueued(b)) << b;
}

// Gated steps on the CPU path, copies at Submit, device deltas (the defaults after backward).
TEST_F(HostTierPipeline, GatedStepsReleasedFromTheDeviceHeaderMatchBitwise) {
  RunGatedSteps(HostTierOptions{}, false, false, false);
}

// Submitted from backward with pacing configured: gated steps copy whole at Submit anyway.
TEST_F(HostTierPipeline, GatedPacedStepsCopyWholeAndMatchBitwise) {
  HostTierOptions options;
  options.submit_in_backward = true;
  options.paced_copies = 2;
  options.pace_piece_elements = 1000;
  RunGatedSteps(options, false, false, true);
}

// Device-updated buckets under a gate, streamer (paced) path: their runs are enqueued only after
// the release, their kernels wait for it on the GPU and read the verdict from the tier's copy of
// the header (a step after a skipped one must not see the skip); absent tensors in step 3.
TEST_F(HostTierPipeline, GatedDeviceUpdatedBucketsWaitForTheRelease) {
  HostTierOptions options;
  options.stream_piece_elements = 1000;
  options.submit_in_backward = true;
  options.paced_copies = 2;
  options.pace_piece_elements = 5000;
  options.device_update_stream = update_;
  RunGatedSteps(options, true, false, true);
}

// The same without the streamer: Submit defers the runs, the release enqueues them.
TEST_F(HostTierPipeline, GatedDeviceUpdatedBucketsWithoutStreamer) {
  HostTierOptions options;
  options.stream_piece_elements = 4096;
  options.stream_slots = 2;
  RunGatedSteps(options, true, false, true);
}

// Released as values: the device-updated runs get the multiplier as a launch argument and a
// skipped step enqueues none; without the streamer and with it.
TEST_F(HostTierPipeline, GatedStepsReleasedByValuesMatchBitwise) {
  HostTierOptions options;
  options.stream_piece_elements = 1000;
  RunGatedSteps(options, true, true, true);
}

TEST_F(HostTierPipeline, GatedPacedStepsReleasedByValuesMatchBitwise) {
  HostTierOptions options;
  options.stream_piece_elements = 1000;
  options.submit_in_backward = true;
  RunGatedSteps(options, true, true, true);
}

// A gated step with device-updated buckets never released: Wait and WaitGradsCopied refuse,
// and destroying the tier returns without enqueuing them (nothing changed).
TEST_F(HostTierPipeline, UnreleasedGatedDeviceStepIsRefusedAndDestroyedCleanly) {
  HostTierOptions options;
  options.stream_piece_elements = 1000;
  options.submit_in_backward = true;
  Build({{1000, DType::kFloat32, 0, 0, true}, {64, DType::kFloat32, 0, 1}}, 2, 1, options);
  HyperParams h;
  ASSERT_OK(tier_->BeginStepGated(&h, 1, true));
  for (size_t b : {1u, 0u}) {
    const void* grads[1] = {device_grads_[b]};
    ASSERT_OK(tier_->Submit(b, grads, 1, compute_));
  }
  ExpectError(tier_->Wait(0, compute_), StatusCode::kInvalidArgument, "before its release");
  ExpectError(tier_->WaitGradsCopied(compute_), StatusCode::kInvalidArgument, "before its release");
  EXPECT_FALSE(tier_->BucketCopiesEnqueued(0));
  tier_.reset();
  ASSERT_CUDA(cudaDeviceSynchronize());
  for (size_t i = 0; i < 2; ++i) {
    std::vector<float> got(static_cast<size_t>(cases_[i].numel));
    ASSERT_CUDA(cudaMemcpy(got.data(), device_params_[i], got.size() * 4, cudaMemcpyDeviceToHost));
    ASSERT_EQ(std::memcmp(got.data(), ref_side_.param_host[i], got.size() * 4), 0) << i;
    ASSERT_EQ(std::memcmp(tier_side_.m[i], ref_side_.m[i], got.size() * 4), 0) << i;
  }
}

// The CPU updates every parameter's host copy, which is uploaded; copies whole at Submit.
TEST_F(HostTierPipeline, MatchesTheCpuUpdaterBitwiseOverSteps) {
  HostTierOptions options;
  options.device_delta = false;
  RunStepsAgainstTheCpuUpdater(options);
}

// The product defaults with buckets submitted from backward: paced copies of 4 Mi-element
// pieces (each bucket here is one piece), device deltas.
TEST_F(HostTierPipeline, DefaultsInBackwardMatchTheCpuUpdaterBitwise) {
  late_grads_ = true;
  HostTierOptions options;
  options.submit_in_backward = true;
  RunStepsAgainstTheCpuUpdater(options);
  ExpectHostParamsUntouched();
  EXPECT_EQ(tier_->copies_enqueued(), 12);  // 3 buckets x 4 steps
}

// device_delta: the fp32 tensors' updates are written over their gradients on the host and
// applied on the device through a staging buffer of 1000 floats (the 1 Mi tensor in 1049 parts,
// copy then kernel, reusing it); the bf16 tensor with its master takes the ordinary path. The
// device parameters are the CpuUpdater's bits; the host copies of the fp32 parameters were
// never written.
TEST_F(HostTierPipeline, DeviceDeltasMatchTheCpuUpdaterBitwise) {
  HostTierOptions options;
  options.device_delta = true;
  options.delta_staging_elements = 1000;
  RunStepsAgainstTheCpuUpdater(options);
  ExpectHostParamsUntouched();
}

// Pacing: the worker copies gradients down 1000 elements at a time, 2 (or 1) pieces ahead of the
// CPU and into the next bucket it takes; the gradients become final on the compute stream only
// after a long copy there, so a copy that did not wait for them would read the previous step's.
// The same bits; every bucket's copies are reported enqueued by the end of each step.
TEST_F(HostTierPipeline, PacedGradientCopiesMatchTheCpuUpdaterBitwise) {
  late_grads_ = true;
  HostTierOptions options;
  options.submit_in_backward = true;
  options.paced_copies = 2;
  options.pace_piece_elements = 1000;
  options.device_delta = false;
  RunStepsAgainstTheCpuUpdater(options);
  for (size_t b = 0; b < 3; ++b) EXPECT_TRUE(tier_->BucketCopiesEnqueued(b)) << b;
  EXPECT_EQ(tier_->copies_enqueued(), 12);  // 3 buckets x 4 steps
}

// One piece ahead: each copy is enqueued only when the CPU has finished the piece before it.
TEST_F(HostTierPipeline, PacedOnePieceAheadMatchesTheCpuUpdaterBitwise) {
  late_grads_ = true;
  HostTierOptions options;
  options.submit_in_backward = true;
  options.paced_copies = 1;
  options.pace_piece_elements = 1000;
  options.device_delta = false;
  RunStepsAgainstTheCpuUpdater(options);
}

TEST_F(HostTierPipeline, PacedCopiesWithDeviceDeltasMatchBitwise) {
  late_grads_ = true;
  HostTierOptions options;
  options.submit_in_backward = true;
  options.paced_copies = 3;
  options.pace_piece_elements = 5000;
  options.device_delta = true;
  options.delta_staging_elements = 3000;
  RunStepsAgainstTheCpuUpdater(options);
  ExpectHostParamsUntouched();
}

// device_update: buckets 0 and 2 are updated on the device, their moments brought up from the
// pinned host arena and sent back through 3 staging slots of 1000 elements (the 1 Mi tensor in
// 1049 runs, the slots reused in turn), the gradients final only late on the compute stream;
// bucket 1 (bf16 with master, fp32) on the CPU with paced copies and device deltas, as the
// PyTorch front end runs it. Parameters and moments are the CpuUpdater's bits after every step.
TEST_F(HostTierPipeline, DeviceUpdatedBucketsMatchTheCpuUpdaterBitwise) {
  late_grads_ = true;
  HostTierOptions options;
  options.stream_piece_elements = 1000;
  options.submit_in_backward = true;
  options.paced_copies = 2;
  options.pace_piece_elements = 5000;
  options.device_delta = true;
  options.device_update_stream = update_;  // the caller's: the tier must not destroy it
  RunStepsAgainstTheCpuUpdater(options, true);
  EXPECT_EQ(tier_->update_stream(), update_);
  EXPECT_EQ(tier_->copies_enqueued(), 12);  // 3 buckets x 4 steps, device updates included
  for (size_t b = 0; b < 3; ++b) EXPECT_TRUE(tier_->BucketCopiesEnqueued(b)) << b;
  tier_.reset();
  EXPECT_EQ(cudaStreamQuery(update_), cudaSuccess);  // still a valid stream
}

// One slot: every run waits for the one before it to be back on the host.
TEST_F(HostTierPipeline, DeviceUpdatesThroughOneSlotMatchTheCpuUpdaterBitwise) {
  late_grads_ = true;
  HostTierOptions options;
  options.stream_piece_elements = 4096;
  options.stream_slots = 1;
  options.device_delta = false;
  RunStepsAgainstTheCpuUpdater(options, true);
  EXPECT_NE(tier_->update_stream(), nullptr);  // its own
}

// A hold of 20000 bytes: bucket 2's two tiny tensors wait for the worker's paced copies, buckets
// 1 and 0 (400 KB, 4 MiB of gradients) would pass it and are copied at Submit, in the same step.
TEST_F(HostTierPipeline, PacedCopiesPastTheHoldAreCopiedAtSubmit) {
  late_grads_ = true;
  HostTierOptions options;
  options.submit_in_backward = true;
  options.paced_copies = 2;
  options.pace_piece_elements = 1000;
  options.paced_hold_bytes = 20000;
  options.device_delta = false;
  RunStepsAgainstTheCpuUpdater(options);
  EXPECT_EQ(tier_->copies_enqueued(), 12);
}

// Without pacing Submit enqueues the copies itself: reported at once. The defaults pace only
// buckets submitted from backward, so after backward (submit_in_backward false) this is them.
TEST_F(HostTierPipeline, UnpacedCopiesAreEnqueuedBySubmit) {
  Build({{64, DType::kFloat32, 0, 0}, {64, DType::kFloat32, 0, 1}}, 2, 1);
  HyperParams h;
  int64_t step = 1;
  ASSERT_OK(tier_->BeginStep(&h, &step, 1));
  const void* grads[1] = {device_grads_[1]};
  ASSERT_OK(tier_->Submit(1, grads, 1, compute_));
  EXPECT_TRUE(tier_->BucketCopiesEnqueued(1));
  EXPECT_EQ(tier_->copies_enqueued(), 1);
  EXPECT_FALSE(tier_->BucketCopiesEnqueued(7));
  ASSERT_OK(tier_->Synchronize());
}

TEST_F(HostTierPipeline, RefusesCallsOutOfOrder) {
  Build({{64, DType::kFloat32, 0, 0}, {64, DType::kFloat32, 0, 1}}, 2, 1);
  const void* grads[1] = {device_grads_[0]};
  ExpectError(tier_->Submit(0, grads, 1, compute_), StatusCode::kInvalidArgument,
              "before the first BeginStep");
  HyperParams h;
  int64_t step = 0;
  ExpectError(tier_->BeginStep(&h, &step, 1), StatusCode::kInvalidArgument, "steps[0] is 0");
  step = 1;
  ExpectError(tier_->BeginStep(&h, &step, 2), StatusCode::kInvalidArgument, "needs 1 groups");
  ASSERT_OK(tier_->BeginStep(&h, &step, 1));
  ExpectError(tier_->Submit(0, grads, 2, compute_), StatusCode::kInvalidArgument,
              "holds 1 tensors; got 2");
  ExpectError(tier_->Submit(5, grads, 1, compute_), StatusCode::kInvalidArgument,
              "bucket 5 does not exist");
  ASSERT_OK(tier_->Submit(0, grads, 1, compute_));
  ExpectError(tier_->Submit(0, grads, 1, compute_), StatusCode::kInvalidArgument,
              "submitted already");
  // A bucket never submitted: Wait has nothing to wait for.
  ASSERT_OK(tier_->Wait(1, compute_));
  ASSERT_OK(tier_->Wait(0, compute_));
  ASSERT_OK(tier_->Synchronize());
}

// The device half of device_delta on its own: p = p * decay + delta for every combination of
// the two pointers' misalignment (0..3 floats past 16 bytes: the vector path when they agree,
// the scalar one when not) and sizes around the vector width, against the host's float
// arithmetic (no FMA), every element checked, the neighbours untouched.
TEST(HostTierApplyDelta, MatchesTheHostForEveryAlignmentAndSize) {
  SKIP_WITHOUT_DEVICE();
  ASSERT_CUDA(cudaSetDevice(0));
  constexpr int64_t kPad = 8;
  const float decay = 0.99997f;
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{4}, int64_t{5}, int64_t{4097},
                    (int64_t{1} << 20) + 3}) {
    const size_t total = static_cast<size_t>(n + 2 * kPad);
    std::vector<float> p0(total), d0(total);
    for (size_t k = 0; k < total; ++k) {
      p0[k] = Random(7, static_cast<int64_t>(k));
      d0[k] = Random(8, static_cast<int64_t>(k)) * 1e-3f;
    }
    float* param = nullptr;
    float* delta = nullptr;
    ASSERT_CUDA(cudaMalloc(&param, total * sizeof(float)));
    ASSERT_CUDA(cudaMalloc(&delta, total * sizeof(float)));
    for (int64_t po = 0; po < 4; ++po) {
      for (int64_t dof = 0; dof < 4; ++dof) {
        ASSERT_CUDA(cudaMemcpy(param, p0.data(), total * sizeof(float), cudaMemcpyHostToDevice));
        ASSERT_CUDA(cudaMemcpy(delta, d0.data(), total * sizeof(float), cudaMemcpyHostToDevice));
        ASSERT_OK(cuda::LaunchApplyDelta(param + po, delta + dof, n, decay, nullptr));
        std::vector<float> got(total);
        ASSERT_CUDA(cudaMemcpy(got.data(), param, total * sizeof(float), cudaMemcpyDeviceToHost));
        for (int64_t k = 0; k < static_cast<int64_t>(total); ++k) {
          float want = p0[static_cast<size_t>(k)];
          if (k >= po && k < po + n) {
            volatile float decayed = want * decay;
            want = decayed + d0[static_cast<size_t>(k - po + dof)];
          }
          ASSERT_EQ(cpu::FloatBits(got[static_cast<size_t>(k)]), cpu::FloatBits(want))
              << "n " << n << ", param +" << po << ", delta +" << dof << ", element " << k;
        }
      }
    }
    ASSERT_CUDA(cudaFree(param));
    ASSERT_CUDA(cudaFree(delta));
  }
}

#endif  // EMSA_HAVE_CUDA

}  // namespace
}  // namespace emsa
