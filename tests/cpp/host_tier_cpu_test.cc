// The host tier's scheduling core on the CPU, no GPU (HostTier::CreateWithEngine with
// FakeCopyEngine, whose copies run on threads after random delays and whose events are kept
// honestly): the results bitwise equal to the CpuUpdater run directly; ordering (no update
// before its gradients are final and landed; no update over what an upload still reads; Wait(b)
// only once b's upload is enqueued); pacing (pieces ahead, the hold limit); failures of the
// engine reaching the next Wait, BeginStep and Synchronize; the measurements and the trace.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "emsa/cpu_update.h"
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
  void* Param(size_t i, DType d) {
    return d == DType::kFloat32 ? static_cast<void*>(master[i].data()) : param[i].data();
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

  // Bucket b's gradients for `step`, written on `stream` (after `late_us` there), then
  // submitted as final on it.
  Status Submit(size_t b, int step, cudaStream_t stream, int late_us) {
    std::vector<const void*> grads;
    for (size_t i = 0; i < cases_.size(); ++i) {
      if (static_cast<size_t>(cases_[i].bucket) != b) continue;
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

}  // namespace
}  // namespace emsa
