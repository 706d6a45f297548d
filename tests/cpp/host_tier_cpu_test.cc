// The host tier's scheduling core on the CPU, no GPU (HostTier::CreateWithEngine with
// FakeCopyEngine, whose copies run on threads after random delays and whose events are kept
// honestly): the results bitwise equal to the CpuUpdater run directly; ordering (no update
// before its gradients are final and landed; no update over what an upload still reads; Wait(b)
// only once b's upload is enqueued); pacing (pieces ahead, the hold limit); failures of the
// engine reaching the next Wait, BeginStep and Synchronize; the measurements and the trace.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "emsa/cpu_update.h"
#include "emsa/cuda_update.h"
#include "emsa/host_tier.h"
#include "fake_copy_engine.h"
#include "kernels/cpu/numerics.h"
#include "status_test_support.h"

#define EXPECT_STATUS_OK(expr)                                \
  do {                                                        \
    const ::emsa::Status st_ = (expr);                        \
    ASSERT_TRUE(st_.ok()) << #expr << ": " << st_.ToString(); \
  } while (0)

namespace emsa {
namespace {

float Random(uint32_t seed, int64_t i) {  // in (-1, 1), never zero
  uint32_t x = seed * 2654435761U + static_cast<uint32_t>(i);
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return (static_cast<float>(x >> 8) + 0.5f) / 8388608.0f - 1.0f;
}

std::unique_ptr<CpuUpdater> Updater() {
  CpuUpdaterOptions o;
  o.threads = 2;
  auto u = CpuUpdater::Create(o);
  EXPECT_TRUE(u.ok()) << u.status().ToString();
  return std::move(u).value();
}

struct Case {
  int64_t numel;
  DType dtype;
  int64_t bucket;
};

// The buffers of one side (the tier's or the reference's), one entry per tensor.
struct Side {
  std::vector<std::vector<float>> master, m, v;
  std::vector<std::vector<uint8_t>> param, grad;  // param: the master's bytes for fp32
  // The tier's side, as the front end binds it: a bf16 parameter is rounded over its gradient
  // staging, which its upload then reads (param unused).
  bool rounded_over_grad = false;
  void* Param(size_t i, DType d) {
    if (d == DType::kFloat32) return master[i].data();
    return rounded_over_grad ? grad[i].data() : param[i].data();
  }
};

class HostTierCpu : public ::testing::Test {
 protected:
  // Four buckets (bf16 with a master in bucket 1) of 256-element pieces.
  static std::vector<Case> Cases() {
    return {{256, DType::kFloat32, 3}, {512, DType::kFloat32, 3},  {256, DType::kBFloat16, 2},
            {768, DType::kFloat32, 2}, {1024, DType::kFloat32, 1}, {256, DType::kFloat32, 0},
            {256, DType::kBFloat16, 0}};
  }
  static constexpr size_t kBuckets = 4;
  static constexpr int64_t kPieces = 13;  // of 256 elements, none across two tensors

  void Build(int max_delay_us, const HostTierOptions& options) {
    host_tier_.reset();
    engine_ = std::make_unique<FakeCopyEngine>(max_delay_us);
    tier_ = Side{};
    tier_.rounded_over_grad = rounded_over_grad_;
    ref_ = Side{};
    device_params_.clear();
    device_grads_.clear();
    compute_ = engine_->NewStream();
    grads_stream_ = engine_->NewStream();
    d2h_ = engine_->NewStream();
    h2d_ = engine_->NewStream();
    cases_ = Cases();
    std::vector<HostTierTensor> tensors;
    for (size_t i = 0; i < cases_.size(); ++i) {
      const Case& c = cases_[i];
      const size_t n = static_cast<size_t>(c.numel), bytes = n * DTypeSize(c.dtype);
      std::vector<float> init(n);
      std::vector<uint8_t> pbytes(bytes);
      for (size_t k = 0; k < n; ++k) {
        init[k] = Random(100 + static_cast<uint32_t>(i), static_cast<int64_t>(k));
        if (c.dtype == DType::kBFloat16) {
          const uint16_t h = cpu::Bf16Nearest(init[k]);
          init[k] = cpu::Bf16ToFloat(h);
          std::memcpy(pbytes.data() + 2 * k, &h, 2);
        } else {
          std::memcpy(pbytes.data() + 4 * k, &init[k], 4);
        }
      }
      for (Side* s : {&tier_, &ref_}) {
        s->master.push_back(init);
        s->m.emplace_back(n, 0.0f);
        s->v.emplace_back(n, 0.0f);
        s->param.push_back(pbytes);
        s->grad.emplace_back(bytes, 0);
      }
      device_params_.push_back(pbytes);
      device_grads_.emplace_back(bytes, 0);
      HostTierTensor t;
      t.update = Update(tier_, i);
      t.bucket = c.bucket;
      t.device_param = device_params_[i].data();
      tensors.push_back(t);
    }
    auto tier = HostTier::CreateWithEngine(engine_.get(), updater_.get(), tensors.data(),
                                           tensors.size(), kBuckets, 1, d2h_, h2d_, options);
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    host_tier_ = std::move(tier).value();
  }

  TensorUpdate Update(Side& s, size_t i) {
    const Case& c = cases_[i];
    TensorUpdate u;
    u.param = s.Param(i, c.dtype);
    u.master = c.dtype == DType::kFloat32 ? nullptr : s.master[i].data();
    u.grad = s.grad[i].data();
    u.exp_avg = s.m[i].data();
    u.exp_avg_sq = s.v[i].data();
    u.numel = c.numel;
    u.param_dtype = u.grad_dtype = c.dtype;
    return u;
  }

  std::vector<uint8_t> Grads(int step, size_t i) const {
    const Case& c = cases_[i];
    std::vector<uint8_t> g(static_cast<size_t>(c.numel) * DTypeSize(c.dtype));
    for (int64_t k = 0; k < c.numel; ++k) {
      const float x = Random(1000 * static_cast<uint32_t>(step) + static_cast<uint32_t>(i), k);
      if (c.dtype == DType::kBFloat16) {
        const uint16_t h = cpu::Bf16Nearest(0.1f * x);
        std::memcpy(g.data() + 2 * k, &h, 2);
      } else {
        const float y = 0.1f * x;
        std::memcpy(g.data() + 4 * k, &y, 4);
      }
    }
    return g;
  }

  void ReferenceStep(int step, const HyperParams& hyper) {
    std::vector<TensorUpdate> u;
    for (size_t i = 0; i < cases_.size(); ++i) {
      const std::vector<uint8_t> g = Grads(step, i);
      std::memcpy(ref_.grad[i].data(), g.data(), g.size());
      u.push_back(Update(ref_, i));
      u.back().step = step;
      u.back().hyper = &hyper;
    }
    EXPECT_STATUS_OK(ref_updater_->Step(u.data(), u.size(), StepOptions{}));
  }

  // The reference's step for gradients of `seed`: tensor i (unless absent[i]) at step steps[i],
  // its gradients multiplied by `multiplier`.
  void ReferenceStepOf(int seed, const std::vector<int64_t>& steps, const HyperParams& hyper,
                       float multiplier, const std::vector<bool>& absent) {
    std::vector<TensorUpdate> u;
    for (size_t i = 0; i < cases_.size(); ++i) {
      if (absent[i]) continue;
      const std::vector<uint8_t> g = Grads(seed, i);
      std::memcpy(ref_.grad[i].data(), g.data(), g.size());
      u.push_back(Update(ref_, i));
      u.back().step = steps[i];
      u.back().hyper = &hyper;
    }
    StepOptions o;
    o.grad_multiplier = multiplier;
    EXPECT_STATUS_OK(ref_updater_->Step(u.data(), u.size(), o));
  }

  // Bucket b's gradients for `step`, written on `stream` (after `late_us` there), then
  // submitted as final on it; tensors with absent[i] get a null pointer.
  Status Submit(size_t b, int step, cudaStream_t stream, int late_us,
                const std::vector<bool>* absent = nullptr) {
    std::vector<const void*> grads;
    for (size_t i = 0; i < cases_.size(); ++i) {
      if (static_cast<size_t>(cases_[i].bucket) != b) continue;
      if (absent != nullptr && (*absent)[i]) {
        grads.push_back(nullptr);
        continue;
      }
      grads.push_back(device_grads_[i].data());
      std::vector<uint8_t> g = Grads(step, i);
      uint8_t* dst = device_grads_[i].data();
      engine_->Enqueue(stream, [g, dst, late_us] {
        if (late_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(late_us));
        std::memcpy(dst, g.data(), g.size());
      });
    }
    return host_tier_->Submit(b, grads.data(), grads.size(), stream);
  }

  // What the compute stream sees of bucket b's parameters, once it gets there.
  void Snapshot(size_t b, std::vector<std::vector<uint8_t>>* into) {
    for (size_t i = 0; i < cases_.size(); ++i) {
      if (static_cast<size_t>(cases_[i].bucket) != b) continue;
      std::vector<uint8_t>* out = &(*into)[i];
      const std::vector<uint8_t>* src = &device_params_[i];
      engine_->Enqueue(compute_, [out, src] { *out = *src; });
    }
  }
  // The reference's parameters as the device holds them.
  std::vector<uint8_t> RefParam(size_t i) {
    const size_t bytes = device_params_[i].size();
    const uint8_t* p = static_cast<const uint8_t*>(ref_.Param(i, cases_[i].dtype));
    return std::vector<uint8_t>(p, p + bytes);
  }

  // `steps` training steps as a framework runs them: each forward waits for its buckets' new
  // parameters (Wait) and reads them (a snapshot on the compute stream, which must be the
  // reference's after the steps before); backward writes the gradients on `grad_stream` (after
  // late_us) and submits them in gradient-ready order. hold_uploads: each step's uploads stay
  // shut until the next step's buckets are submitted (and the worker had time to update them).
  // Then everything bitwise against the CpuUpdater.
  void Train(int steps, cudaStream_t grad_stream, int late_us, bool hold_uploads = false) {
    HyperParams hyper;
    std::vector<std::vector<uint8_t>> seen(cases_.size());
    for (int s = 1; s <= steps; ++s) {
      std::vector<std::vector<uint8_t>> expected;
      for (size_t i = 0; i < cases_.size(); ++i) expected.push_back(RefParam(i));
      hyper.lr = 1e-2 * s;  // a scheduler
      ReferenceStep(s, hyper);
      for (size_t b = 0; b < kBuckets; ++b) {
        EXPECT_STATUS_OK(host_tier_->Wait(b, compute_));
        Snapshot(b, &seen);
      }
      const int64_t step = s;
      EXPECT_STATUS_OK(host_tier_->BeginStep(&hyper, &step, 1));
      if (hold_uploads) engine_->Hold(h2d_);  // behind the last step's uploads, before this one's
      for (size_t b = kBuckets; b-- > 0;) EXPECT_STATUS_OK(Submit(b, s, grad_stream, late_us));
      if (hold_uploads && s > 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        engine_->Release();  // the last step's uploads
      }
      EXPECT_STATUS_OK(host_tier_->WaitGradsCopied(grad_stream));
      Flush(compute_);
      for (size_t i = 0; i < cases_.size(); ++i) {
        EXPECT_TRUE(seen[i] == expected[i])
            << "tensor " << i << " as the forward of step " << s << " read it";
      }
    }
    if (hold_uploads) engine_->Release();
    EXPECT_STATUS_OK(host_tier_->Synchronize());
    ExpectEqualsReference();
  }

  // Blocks until everything enqueued on `stream` so far has run.
  void Flush(cudaStream_t stream) {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    engine_->Enqueue(stream, [&] {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }

  void ExpectEqualsReference() {
    for (size_t i = 0; i < cases_.size(); ++i) {
      EXPECT_TRUE(device_params_[i] == RefParam(i)) << "device parameter " << i;
      EXPECT_TRUE(tier_.m[i] == ref_.m[i]) << "exp_avg " << i;
      EXPECT_TRUE(tier_.v[i] == ref_.v[i]) << "exp_avg_sq " << i;
      if (cases_[i].dtype == DType::kBFloat16) {
        EXPECT_TRUE(tier_.master[i] == ref_.master[i]) << "master " << i;
      }
    }
  }

  // Everything of the tier a step may change: device parameters, moments, masters (the fp32
  // tensors' host copies among them), the bf16 staging.
  struct State {
    std::vector<std::vector<uint8_t>> device, param;
    std::vector<std::vector<float>> m, v, master;
    bool operator==(const State& o) const {
      return device == o.device && param == o.param && m == o.m && v == o.v && master == o.master;
    }
  };
  State TierState() const { return {device_params_, tier_.param, tier_.m, tier_.v, tier_.master}; }

  // One whole step with the tier's own counts: every bucket submitted (gradients of `seed`,
  // absent ones null), released as values when gated, then Synchronize.
  void TierStep(int seed, bool gated, float multiplier, bool found_inf,
                const std::vector<bool>* absent = nullptr) {
    EXPECT_STATUS_OK(host_tier_->BeginStepGated(&hypers_, 1, gated));
    for (size_t b = kBuckets; b-- > 0;) {
      EXPECT_STATUS_OK(Submit(b, seed, grads_stream_, 0, absent));
    }
    if (gated) EXPECT_STATUS_OK(host_tier_->ReleaseValues(multiplier, found_inf));
    EXPECT_STATUS_OK(host_tier_->Synchronize());
  }
  HyperParams hypers_;  // TierStep's
  // Build's: the tier's bf16 parameters rounded over their gradient staging (as the front end
  // binds them), so their next gradient copy waits for the upload that reads it.
  bool rounded_over_grad_ = true;

  std::vector<int64_t> Steps() const {
    std::vector<int64_t> steps(host_tier_->tensor_count(), -1);
    const Status st = host_tier_->ReadSteps(steps.data(), steps.size());
    EXPECT_TRUE(st.ok()) << st.ToString();
    return steps;
  }

  // The ways a tier is built for the gated tests: copies at Submit or paced, deltas or not.
  static std::vector<HostTierOptions> Variants() {
    std::vector<HostTierOptions> all;
    for (bool paced : {false, true}) {
      for (bool delta : {false, true}) {
        HostTierOptions o = paced ? Paced(delta) : HostTierOptions{};
        o.device_delta = delta;
        o.delta_staging_elements = 384;
        all.push_back(o);
      }
    }
    return all;
  }
  static std::string Name(const HostTierOptions& o) {
    return std::string(o.paced() ? "paced" : "at Submit") + (o.device_delta ? ", delta" : "");
  }

  static HostTierOptions Paced(bool device_delta) {
    HostTierOptions o;
    o.submit_in_backward = true;
    o.paced_copies = 2;
    o.pace_piece_elements = 256;
    o.device_delta = device_delta;
    o.delta_staging_elements = 384;  // the deltas go up in parts
    return o;
  }

  std::unique_ptr<CpuUpdater> updater_ = Updater(), ref_updater_ = Updater();
  std::vector<Case> cases_;
  Side tier_, ref_;
  std::vector<std::vector<uint8_t>> device_params_, device_grads_;
  std::unique_ptr<FakeCopyEngine> engine_;  // after the buffers its streams touch
  cudaStream_t compute_ = nullptr, grads_stream_ = nullptr, d2h_ = nullptr, h2d_ = nullptr;
  std::unique_ptr<HostTier> host_tier_;  // first to go
};

// Copies whole at Submit, after the compute stream's event: gradients written late on it are
// the ones updated (a copy or an update before it would take the last step's).
TEST_F(HostTierCpu, AtSubmitMatchesTheCpuUpdaterBitwise) {
  for (bool delta : {false, true}) {
    SCOPED_TRACE(delta ? "device delta" : "host copies uploaded");
    HostTierOptions o;
    o.device_delta = delta;
    o.delta_staging_elements = 384;
    Build(300, o);
    Train(4, compute_, 2000);
    host_tier_.reset();
  }
}

// Submitted from backward, copies paced by the worker, gradients written late.
TEST_F(HostTierCpu, PacedMatchesTheCpuUpdaterBitwise) {
  for (bool delta : {false, true}) {
    SCOPED_TRACE(delta ? "device delta" : "host copies uploaded");
    Build(300, Paced(delta));
    Train(4, compute_, 2000);
    host_tier_.reset();
  }
}

// Uploads slow, gradients final at once on a stream of their own: the worker's next update of a
// bucket must wait for its last upload (and, under device delta, the next gradient copy too,
// which overwrites the deltas it reads), or the forward reads the next step's values.
TEST_F(HostTierCpu, NoUpdateOverWhatAnUploadStillReads) {
  for (bool paced : {false, true}) {
    for (bool delta : {false, true}) {
      SCOPED_TRACE(std::string(paced ? "paced" : "at Submit") + (delta ? ", delta" : ""));
      HostTierOptions o = paced ? Paced(delta) : HostTierOptions{};
      o.device_delta = delta;
      o.delta_staging_elements = 384;
      Build(0, o);
      Train(3, grads_stream_, 0, /*hold_uploads=*/true);
      host_tier_.reset();
    }
  }
}

// Wait(b) returns once b's upload is enqueued: with slow gradient copies the worker is still
// busy when the forward asks, and a Wait that did not block would let the compute stream read
// the old parameters.
TEST_F(HostTierCpu, WaitReturnsOnlyOnceTheUploadIsEnqueued) {
  Build(2000, HostTierOptions{});
  HyperParams hyper;
  const int64_t step = 1;
  ReferenceStep(1, hyper);
  EXPECT_STATUS_OK(host_tier_->BeginStep(&hyper, &step, 1));
  for (size_t b = kBuckets; b-- > 0;) EXPECT_STATUS_OK(Submit(b, 1, grads_stream_, 0));
  std::vector<std::vector<uint8_t>> seen(cases_.size());
  for (size_t b = 0; b < kBuckets; ++b) {
    EXPECT_STATUS_OK(host_tier_->Wait(b, compute_));
    Snapshot(b, &seen);
  }
  Flush(compute_);
  for (size_t i = 0; i < cases_.size(); ++i) EXPECT_TRUE(seen[i] == RefParam(i)) << "tensor " << i;
  HostTierStepStats st;
  ASSERT_EQ(host_tier_->Stats(1, &st, 1), 1u);
  EXPECT_GE(st.wait_s, 0.0);
}

// Of the buckets whose gradients have landed, the worker takes the one the next forward needs
// first (the highest index), not the oldest. Step 2: the worker is held on bucket 0 (its
// step-1 upload is shut) while buckets 1, 2, 3 are submitted, oldest first, and land.
TEST_F(HostTierCpu, TakesWhatTheNextForwardNeedsFirst) {
  HostTierOptions o;
  o.device_delta = false;  // the gradient copies do not wait for the uploads
  rounded_over_grad_ = false;
  Build(0, o);
  HyperParams hyper;
  engine_->Hold(h2d_);
  for (int s = 1; s <= 2; ++s) {
    const int64_t step = s;
    ReferenceStep(s, hyper);
    EXPECT_STATUS_OK(host_tier_->BeginStep(&hyper, &step, 1));
    for (size_t b = 0; b < kBuckets; ++b) {
      EXPECT_STATUS_OK(Submit(b, s, grads_stream_, 0));
      if (s == 2 && b == 0) engine_->AwaitBlockedOn(h2d_);  // the worker holds bucket 0
    }
  }
  EXPECT_STATUS_OK(host_tier_->WaitGradsCopied(grads_stream_));
  Flush(grads_stream_);  // every gradient of step 2 has landed
  engine_->Release();
  EXPECT_STATUS_OK(host_tier_->Synchronize());
  std::vector<double> submit(kBuckets), start(kBuckets), end(kBuckets);
  ASSERT_EQ(host_tier_->Trace(submit.data(), start.data(), end.data(), kBuckets), kBuckets);
  EXPECT_LT(end[0], start[3]);
  EXPECT_LT(end[3], start[2]);
  EXPECT_LT(end[2], start[1]);
  ExpectEqualsReference();
}

// Pacing keeps at most paced_copies pieces copied beyond the one the CPU waits for; without it
// Submit enqueues them all at once.
TEST_F(HostTierCpu, PacingKeepsTheCopiesAFewPiecesAhead) {
  Build(200, Paced(false));
  Train(3, compute_, 0);
  EXPECT_EQ(engine_->copies_to_host(), 3 * kPieces);  // one copy per piece
  EXPECT_LE(engine_->max_copies_ahead(d2h_), 2);
  // Without pacing the same copies run further ahead (the check above can fail).
  Build(200, HostTierOptions{});
  HyperParams hyper;
  const int64_t step = 1;
  EXPECT_STATUS_OK(host_tier_->BeginStep(&hyper, &step, 1));
  engine_->Hold(d2h_);  // the worker's waits come once every copy is enqueued
  for (size_t b = kBuckets; b-- > 0;) EXPECT_STATUS_OK(Submit(b, 1, grads_stream_, 0));
  engine_->Release();
  EXPECT_STATUS_OK(host_tier_->Synchronize());
  EXPECT_GT(engine_->max_copies_ahead(d2h_), 2);
}

// Under pacing, a Submit that would hold more than paced_hold_bytes of gradients on the device
// enqueues its copies at once; the results are the same.
TEST_F(HostTierCpu, HoldLimitCopiesAtSubmit) {
  HostTierOptions o = Paced(false);
  o.paced_hold_bytes = 1024 * 4;  // bucket 1's gradients, exactly
  Build(0, o);
  HyperParams hyper;
  const int64_t step = 1;
  ReferenceStep(1, hyper);
  EXPECT_STATUS_OK(host_tier_->BeginStep(&hyper, &step, 1));
  engine_->Hold(compute_);  // no gradient is final: the worker copies nothing
  EXPECT_STATUS_OK(Submit(1, 1, compute_, 0));
  EXPECT_FALSE(host_tier_->BucketCopiesEnqueued(1));  // held for the worker
  EXPECT_EQ(engine_->copies_to_host(), 0);
  EXPECT_STATUS_OK(Submit(0, 1, compute_, 0));  // past the limit: copied at Submit
  EXPECT_TRUE(host_tier_->BucketCopiesEnqueued(0));
  EXPECT_EQ(engine_->copies_to_host(), 2);
  EXPECT_FALSE(host_tier_->BucketCopiesEnqueued(1));
  engine_->Release();
  EXPECT_STATUS_OK(Submit(3, 1, compute_, 0));
  EXPECT_STATUS_OK(Submit(2, 1, compute_, 0));
  EXPECT_STATUS_OK(host_tier_->WaitGradsCopied(compute_));
  for (size_t b = 0; b < kBuckets; ++b) EXPECT_TRUE(host_tier_->BucketCopiesEnqueued(b));
  EXPECT_EQ(host_tier_->copies_enqueued(), 4);
  EXPECT_STATUS_OK(host_tier_->Synchronize());
  ExpectEqualsReference();
}

// A failure in the worker's copies reaches the next Wait, BeginStep, Synchronize and Submit,
// and nothing blocks on it.
TEST_F(HostTierCpu, EngineFailuresReachTheNextCall) {
  for (FakeCopyEngine::Call call :
       {FakeCopyEngine::kCopyToDevice, FakeCopyEngine::kQuery, FakeCopyEngine::kSynchronize}) {
    for (bool paced : {false, true}) {
      SCOPED_TRACE(std::to_string(call) + (paced ? " paced" : ""));
      Build(100, paced ? Paced(false) : HostTierOptions{});
      HyperParams hyper;
      const int64_t step = 1;
      EXPECT_STATUS_OK(host_tier_->BeginStep(&hyper, &step, 1));
      engine_->FailNth(call, 2);
      Status waited;  // Submit itself answers the failure once the worker has had it
      for (size_t b = kBuckets; b-- > 0 && waited.ok();) waited = Submit(b, 1, grads_stream_, 0);
      for (size_t b = 0; b < kBuckets && waited.ok(); ++b) waited = host_tier_->Wait(b, compute_);
      ExpectError(waited, StatusCode::kCudaError, "injected by the test");
      ExpectError(host_tier_->Synchronize(), StatusCode::kCudaError, "injected");
      ExpectError(host_tier_->BeginStep(&hyper, &step, 1), StatusCode::kCudaError, "injected");
      ExpectError(Submit(0, 2, grads_stream_, 0), StatusCode::kCudaError, "injected");
      EXPECT_TRUE(host_tier_->BucketCopiesEnqueued(0));  // nothing more will read them
      host_tier_.reset();
    }
  }
}

// A failure on the caller's own thread (the copy Submit enqueues) is Submit's answer.
TEST_F(HostTierCpu, SubmitReturnsItsOwnCopyFailure) {
  Build(0, HostTierOptions{});
  HyperParams hyper;
  const int64_t step = 1;
  EXPECT_STATUS_OK(host_tier_->BeginStep(&hyper, &step, 1));
  engine_->FailNth(FakeCopyEngine::kCopyToHost, 1);
  ExpectError(Submit(3, 1, grads_stream_, 0), StatusCode::kCudaError, "injected");
}

// Each step's measurements, complete after Synchronize; the trace in order per bucket.
TEST_F(HostTierCpu, StatsAndTrace) {
  Build(300, Paced(true));
  Train(3, compute_, 500);
  HostTierStepStats st[4];
  ASSERT_EQ(host_tier_->Stats(1, st, 4), 3u);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(st[s].step, s + 1);
    EXPECT_EQ(st[s].buckets, static_cast<int64_t>(kBuckets));
    EXPECT_EQ(st[s].device_buckets, 0);
    EXPECT_TRUE(st[s].complete) << "step " << s + 1;
    EXPECT_GT(st[s].d2h_s, 0.0);  // copies were delayed: their events are apart
    EXPECT_GT(st[s].h2d_s, 0.0);
    EXPECT_GE(st[s].grad_wait_s, 0.0);
    EXPECT_GE(st[s].worker_s + 1e-9, st[s].cpu_s + st[s].grad_wait_s);
  }
  EXPECT_EQ(host_tier_->Stats(3, st, 4), 1u);
  std::vector<double> submit(kBuckets), start(kBuckets), end(kBuckets);
  ASSERT_EQ(host_tier_->Trace(submit.data(), start.data(), end.data(), kBuckets), kBuckets);
  for (size_t b = 0; b < kBuckets; ++b) {
    EXPECT_GE(submit[b], 0.0) << "bucket " << b;
    EXPECT_LE(submit[b], start[b]) << "bucket " << b;
    EXPECT_LE(start[b], end[b]) << "bucket " << b;
  }
}

// Device-updated tensors need CUDA's engine.
TEST_F(HostTierCpu, DeviceUpdateNeedsCuda) {
  engine_ = std::make_unique<FakeCopyEngine>();
  std::vector<float> buf(4 * 64);
  HostTierTensor t;
  t.update.param = buf.data();
  t.update.grad = buf.data() + 64;
  t.update.exp_avg = buf.data() + 128;
  t.update.exp_avg_sq = buf.data() + 192;
  t.update.numel = 64;
  t.device_param = buf.data();
  t.device_update = true;
  auto tier = HostTier::CreateWithEngine(engine_.get(), updater_.get(), &t, 1, 1, 1, nullptr,
                                         nullptr, HostTierOptions{});
  ExpectError(tier.status(), StatusCode::kUnsupported, "device_update");
}

// ---- gated steps, absent tensors, per-tensor step counts (issue 19) ----------------------------

// A gated step: Submit copies every bucket whole at once (even under pacing), the worker updates
// nothing before the release (the state stays bitwise as it was, however long the gradients have
// been on the host), then everything equals the CpuUpdater with the release's multiplier.
// Released as values, and from a step header in "device" memory whose copy is held back on its
// stream (the worker must wait for the copy's event, not only for the call).
TEST_F(HostTierCpu, GatedStepWaitsForTheRelease) {
  for (const HostTierOptions& o : Variants()) {
    for (bool from_header : {false, true}) {
      SCOPED_TRACE(Name(o) + (from_header ? ", header" : ", values"));
      Build(200, o);
      HyperParams hyper;
      const std::vector<bool> none(cases_.size(), false);
      ReferenceStepOf(1, std::vector<int64_t>(cases_.size(), 1), hyper, 0.375f, none);
      const State before = TierState();
      EXPECT_STATUS_OK(host_tier_->BeginStepGated(&hyper, 1, true));
      for (size_t b = kBuckets; b-- > 0;) EXPECT_STATUS_OK(Submit(b, 1, grads_stream_, 300));
      for (size_t b = 0; b < kBuckets; ++b) EXPECT_TRUE(host_tier_->BucketCopiesEnqueued(b));
      EXPECT_EQ(engine_->copies_to_host(), o.paced() ? kPieces : 7);  // each copy at once
      EXPECT_STATUS_OK(host_tier_->WaitGradsCopied(grads_stream_));
      Flush(grads_stream_);  // every gradient is on the host now
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // room for a wrong update
      EXPECT_TRUE(TierState() == before) << "updated before the release";
      DeviceStepHeader header;
      header.grad_multiplier = 0.375f;
      if (from_header) {
        engine_->Hold(compute_);
        EXPECT_STATUS_OK(host_tier_->Release(&header, compute_));
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        EXPECT_TRUE(TierState() == before) << "updated before the release's copy completed";
        engine_->Release();
      } else {
        EXPECT_STATUS_OK(host_tier_->ReleaseValues(0.375f, false));
      }
      EXPECT_STATUS_OK(host_tier_->Synchronize());
      ExpectEqualsReference();
      EXPECT_EQ(Steps(), std::vector<int64_t>(cases_.size(), 1));
      EXPECT_FALSE(host_tier_->last_skipped());
      HostTierStepStats st;
      ASSERT_EQ(host_tier_->Stats(1, &st, 1), 1u);
      EXPECT_TRUE(st.gated);
      EXPECT_FALSE(st.skipped);
      EXPECT_TRUE(st.complete);
      host_tier_.reset();
    }
  }
}

// found_inf: the step changes nothing (parameters on the device, moments, masters, host copies,
// step counts), and the next step updates as if it had never been (its counts + 1).
TEST_F(HostTierCpu, FoundInfSkipsTheStepBitwise) {
  for (const HostTierOptions& o : Variants()) {
    for (bool from_header : {false, true}) {
      SCOPED_TRACE(Name(o) + (from_header ? ", header" : ", values"));
      Build(200, o);
      HyperParams hyper;
      const std::vector<bool> none(cases_.size(), false);
      const int64_t one = 1;
      ReferenceStep(1, hyper);
      EXPECT_STATUS_OK(host_tier_->BeginStep(&hyper, &one, 1));  // ungated, group form
      for (size_t b = kBuckets; b-- > 0;) EXPECT_STATUS_OK(Submit(b, 1, grads_stream_, 0));
      EXPECT_STATUS_OK(host_tier_->Synchronize());
      const State after_one = TierState();
      EXPECT_STATUS_OK(host_tier_->BeginStepGated(&hyper, 1, true));
      for (size_t b = kBuckets; b-- > 0;) EXPECT_STATUS_OK(Submit(b, 2, grads_stream_, 0));
      // The release copies the header on a stream, later: it must outlive the Synchronize.
      DeviceStepHeader header;
      if (from_header) {
        header.found_inf = 1;
        EXPECT_STATUS_OK(host_tier_->Release(&header, compute_));
      } else {
        EXPECT_STATUS_OK(host_tier_->ReleaseValues(1.0f, true));
      }
      for (size_t b = 0; b < kBuckets; ++b) EXPECT_STATUS_OK(host_tier_->Wait(b, compute_));
      EXPECT_STATUS_OK(host_tier_->Synchronize());
      Flush(h2d_);
      EXPECT_TRUE(TierState() == after_one) << "a skipped step changed something";
      EXPECT_EQ(Steps(), std::vector<int64_t>(cases_.size(), 1));
      EXPECT_TRUE(host_tier_->last_skipped());
      HostTierStepStats st;
      ASSERT_EQ(host_tier_->Stats(2, &st, 1), 1u);
      EXPECT_TRUE(st.gated && st.skipped && st.complete);
      // Step 3 of the caller is the tensors' second update.
      ReferenceStepOf(3, std::vector<int64_t>(cases_.size(), 2), hyper, 1.0f, none);
      TierStep(3, true, 1.0f, false);
      ExpectEqualsReference();
      EXPECT_EQ(Steps(), std::vector<int64_t>(cases_.size(), 2));
      EXPECT_FALSE(host_tier_->last_skipped());
      host_tier_.reset();
    }
  }
}

// Absent tensors (a null gradient): not copied, updated or uploaded, their counts stay while the
// others advance; a bucket whose tensors are all absent is not submitted. The next step updates
// them at their own counts.
TEST_F(HostTierCpu, AbsentTensorsAreUntouchedAndKeepTheirSteps) {
  for (const HostTierOptions& o : Variants()) {
    for (bool gated : {false, true}) {
      SCOPED_TRACE(Name(o) + (gated ? ", gated" : ""));
      Build(200, o);
      HyperParams hyper;
      const std::vector<bool> none(cases_.size(), false);
      // Tensor 1 (bucket 3, after a present one), tensor 2 (bf16, bucket 2) and bucket 1 (its
      // only tensor, 4) absent in step 1.
      std::vector<bool> absent(cases_.size(), false);
      absent[1] = absent[2] = absent[4] = true;
      ReferenceStepOf(1, std::vector<int64_t>(cases_.size(), 1), hyper, 1.0f, absent);
      const int64_t copies_before = engine_->copies_to_host();
      EXPECT_STATUS_OK(host_tier_->BeginStepGated(&hyper, 1, gated));
      for (size_t b : {size_t{3}, size_t{2}, size_t{0}}) {
        EXPECT_STATUS_OK(Submit(b, 1, grads_stream_, 0, &absent));
      }
      if (gated) EXPECT_STATUS_OK(host_tier_->ReleaseValues(1.0f, false));
      EXPECT_STATUS_OK(host_tier_->Synchronize());
      ExpectEqualsReference();  // the absent ones included: untouched on both sides
      if (!o.paced()) EXPECT_EQ(engine_->copies_to_host() - copies_before, 4);  // present only
      const std::vector<int64_t> expected_steps = {1, 0, 0, 1, 0, 1, 1};
      EXPECT_EQ(Steps(), expected_steps);
      std::vector<int64_t> next(cases_.size());
      for (size_t i = 0; i < next.size(); ++i) next[i] = expected_steps[i] + 1;
      ReferenceStepOf(2, next, hyper, 1.0f, none);
      TierStep(2, gated, 1.0f, false);
      ExpectEqualsReference();
      EXPECT_EQ(Steps(), next);
      host_tier_.reset();
    }
  }
}

// The counts read and set (load_state_dict), the group form of BeginStep setting them, and their
// checks; ungated steps with the tier's counts equal the CpuUpdater at those steps.
TEST_F(HostTierCpu, PerTensorStepsReadAndSet) {
  Build(100, HostTierOptions{});
  HyperParams hyper;
  const std::vector<bool> none(cases_.size(), false);
  EXPECT_EQ(Steps(), std::vector<int64_t>(cases_.size(), 0));
  std::vector<int64_t> loaded = {4, 9, 1, 0, 7, 2, 3};
  EXPECT_STATUS_OK(host_tier_->SetSteps(loaded.data(), loaded.size()));
  EXPECT_EQ(Steps(), loaded);
  for (int s = 1; s <= 2; ++s) {
    for (int64_t& c : loaded) ++c;
    ReferenceStepOf(s, loaded, hyper, 1.0f, none);
    EXPECT_STATUS_OK(host_tier_->BeginStepGated(&hyper, 1, false));
    for (size_t b = kBuckets; b-- > 0;) EXPECT_STATUS_OK(Submit(b, s, grads_stream_, 0));
    ExpectError(host_tier_->SetSteps(loaded.data(), loaded.size()), StatusCode::kInvalidArgument,
                "during a step");
    EXPECT_STATUS_OK(host_tier_->Synchronize());
    ExpectEqualsReference();
    EXPECT_EQ(Steps(), loaded);
  }
  // The group form: every tensor at steps[g] - 1 before the step, steps[g] after it.
  const int64_t group_step = 12;
  ReferenceStepOf(3, std::vector<int64_t>(cases_.size(), 12), hyper, 1.0f, none);
  EXPECT_STATUS_OK(host_tier_->BeginStep(&hyper, &group_step, 1));
  EXPECT_EQ(Steps(), std::vector<int64_t>(cases_.size(), 11));
  EXPECT_STATUS_OK(host_tier_->SetSteps(Steps().data(), cases_.size()));  // no Submit yet: fine
  for (size_t b = kBuckets; b-- > 0;) EXPECT_STATUS_OK(Submit(b, 3, grads_stream_, 0));
  EXPECT_STATUS_OK(host_tier_->Synchronize());
  ExpectEqualsReference();
  EXPECT_EQ(Steps(), std::vector<int64_t>(cases_.size(), 12));
  const std::vector<int64_t> negative = {1, 1, -1, 1, 1, 1, 1};
  ExpectError(host_tier_->SetSteps(negative.data(), negative.size()), StatusCode::kInvalidArgument,
              "steps[2] is -1");
  ExpectError(host_tier_->SetSteps(negative.data(), 3), StatusCode::kInvalidArgument,
              "holds 7 tensors");
  std::vector<int64_t> out(3);
  ExpectError(host_tier_->ReadSteps(out.data(), out.size()), StatusCode::kInvalidArgument,
              "holds 7 tensors");
  EXPECT_EQ(Steps(), std::vector<int64_t>(cases_.size(), 12));  // nothing changed
}

// A gated step never released: BeginStep, Synchronize and Wait refuse (they would never
// return) and change nothing; the release afterwards still gives the right step. Release's own
// checks. options.gated makes the group form's steps gated.
TEST_F(HostTierCpu, UnreleasedGatedStepIsAnError) {
  for (bool by_option : {false, true}) {
    SCOPED_TRACE(by_option ? "options.gated" : "BeginStepGated");
    HostTierOptions o;
    o.gated = by_option;
    Build(100, o);
    HyperParams hyper;
    const int64_t one = 1;
    ExpectError(host_tier_->ReleaseValues(1.0f, false), StatusCode::kInvalidArgument, "not gated");
    ReferenceStep(1, hyper);
    if (by_option) {
      EXPECT_STATUS_OK(host_tier_->BeginStep(&hyper, &one, 1));
    } else {
      EXPECT_STATUS_OK(host_tier_->BeginStepGated(&hyper, 1, true));
    }
    for (size_t b = kBuckets; b-- > 0;) EXPECT_STATUS_OK(Submit(b, 1, grads_stream_, 0));
    const State before = TierState();
    ExpectError(host_tier_->BeginStepGated(&hyper, 1, false), StatusCode::kInvalidArgument,
                "gated step 1 before its release");
    ExpectError(host_tier_->BeginStep(&hyper, &one, 1), StatusCode::kInvalidArgument,
                "before its release");
    ExpectError(host_tier_->Synchronize(), StatusCode::kInvalidArgument, "before its release");
    ExpectError(host_tier_->Wait(0, compute_), StatusCode::kInvalidArgument, "before its release");
    ExpectError(host_tier_->ReleaseValues(std::nanf(""), false), StatusCode::kInvalidArgument,
                "must be finite");
    ExpectError(host_tier_->Release(nullptr, compute_), StatusCode::kInvalidArgument, "null");
    EXPECT_TRUE(TierState() == before);
    EXPECT_STATUS_OK(host_tier_->ReleaseValues(1.0f, false));
    ExpectError(host_tier_->ReleaseValues(1.0f, false), StatusCode::kInvalidArgument,
                "released already");
    EXPECT_STATUS_OK(host_tier_->Synchronize());
    ExpectEqualsReference();
    EXPECT_EQ(Steps(), std::vector<int64_t>(cases_.size(), 1));
    host_tier_.reset();
  }
}

// Destroying the tier in a gated step never released returns (the step is released as skipped)
// and leaves the state as it was, with copies delayed and some buckets not yet submitted.
TEST_F(HostTierCpu, DestructionWithAnUnreleasedStepDoesNotHang) {
  for (const HostTierOptions& o : Variants()) {
    SCOPED_TRACE(Name(o));
    Build(300, o);
    HyperParams hyper;
    const State before = TierState();
    EXPECT_STATUS_OK(host_tier_->BeginStepGated(&hyper, 1, true));
    for (size_t b : {size_t{3}, size_t{2}}) EXPECT_STATUS_OK(Submit(b, 1, grads_stream_, 200));
    host_tier_.reset();
    Flush(h2d_);
    EXPECT_TRUE(TierState() == before);
  }
}

}  // namespace
}  // namespace emsa
