// cuda_update_support.h — what the device-tier GPU tests share (cuda_update_test.cc,
// cuda_recipe_test.cc): random host tensors in every dtype combination, their device copies, the
// CPU updater as the bitwise reference, and small RAII helpers. Include only where
// EMSA_HAVE_CUDA.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "emsa/cpu_update.h"
#include "emsa/cuda_update.h"
#include "kernels/cpu/numerics.h"

namespace emsa {
namespace cuda_test {

// splitmix64, a fresh seed per check.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double Signed(double lo, double hi) {                                       // +-[lo, hi)
    const double m = lo + (hi - lo) * Uniform();
    return (Next() & 1) ? m : -m;
  }

 private:
  uint64_t s_;
};

inline float ToFloat(DType d, const std::vector<uint8_t>& raw, int64_t i) {
  switch (d) {
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      return cpu::Bf16ToFloat(h);
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      return cpu::HalfToFloat(h);
    }
    default: {
      float f;
      std::memcpy(&f, raw.data() + 4 * i, 4);
      return f;
    }
  }
}

inline void FromFloat(DType d, std::vector<uint8_t>* raw, int64_t i, float x) {
  if (d == DType::kFloat32) {
    std::memcpy(raw->data() + 4 * i, &x, 4);
    return;
  }
  const uint16_t h = d == DType::kBFloat16 ? cpu::Bf16Nearest(x)
                                           : cpu::FloatToHalf(x, cpu::HalfRounding::kNearestEven);
  std::memcpy(raw->data() + 2 * i, &h, 2);
}

// One dtype combination.
struct Case {
  OptimizerKind optimizer;
  DType param;
  DType grad;
  DType state;
  bool master;
  Rounding rounding;
};

inline std::string CaseName(const Case& c) {
  return std::string(OptimizerName(c.optimizer)) + " p=" + DTypeName(c.param) +
         " g=" + DTypeName(c.grad) + " s=" + DTypeName(c.state) + (c.master ? " +master" : "") +
         (c.rounding == Rounding::kStochastic ? " sr" : " nearest");
}

// Every supported combination: 28 per optimizer.
inline std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (OptimizerKind o : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kLion}) {
    for (DType p : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      const bool low = p != DType::kFloat32;
      const std::vector<DType> grads =
          low ? std::vector<DType>{DType::kFloat32, p} : std::vector<DType>{DType::kFloat32};
      const std::vector<bool> masters =
          low ? std::vector<bool>{false, true} : std::vector<bool>{false};
      for (DType g : grads) {
        for (DType s : {DType::kFloat32, DType::kBFloat16}) {
          for (bool master : masters) {
            for (Rounding r : {Rounding::kNearest, Rounding::kStochastic}) {
              if (low && !master && r == Rounding::kNearest) continue;  // rejected by design
              cases.push_back({o, p, g, s, master, r});
            }
          }
        }
      }
    }
  }
  return cases;
}

// One tensor's host data (raw bytes in its dtypes) and its device copy.
struct Tensor {
  int64_t numel = 0;
  bool misaligned = false;  // device pointers one element past a 16-byte boundary
  int32_t group = 0;
  std::vector<uint8_t> param, grad, exp_avg, exp_avg_sq, master;
};

inline Tensor MakeTensor(const Case& c, int64_t numel, bool misaligned, int32_t group, Rng& rng) {
  Tensor t;
  t.numel = numel;
  t.misaligned = misaligned;
  t.group = group;
  const auto n = static_cast<size_t>(numel);
  t.param.resize(n * DTypeSize(c.param));
  t.grad.resize(n * DTypeSize(c.grad));
  t.exp_avg.resize(n * DTypeSize(c.state));
  if (c.optimizer != OptimizerKind::kLion) t.exp_avg_sq.resize(n * DTypeSize(c.state));
  if (c.master) t.master.resize(n * 4);
  for (int64_t i = 0; i < numel; ++i) {
    // Parameters away from zero (relative checks stay meaningful), small gradients, moments of
    // a run in progress.
    const float p = static_cast<float>(rng.Signed(0.5, 1.5));
    if (c.master) {
      FromFloat(DType::kFloat32, &t.master, i, p);
      // A pure output: poisoned, and every element must be written.
      const uint16_t nan = c.param == DType::kBFloat16 ? 0x7FC1 : 0x7E01;
      std::memcpy(t.param.data() + 2 * i, &nan, 2);
    } else {
      FromFloat(c.param, &t.param, i, p);
    }
    FromFloat(c.grad, &t.grad, i, static_cast<float>(rng.Signed(1e-4, 2e-2)));
    FromFloat(c.state, &t.exp_avg, i, static_cast<float>(rng.Signed(1e-5, 1e-2)));
    if (!t.exp_avg_sq.empty()) {
      FromFloat(c.state, &t.exp_avg_sq, i, static_cast<float>(1e-8 + 2e-4 * rng.Uniform()));
    }
  }
  return t;
}

// Device memory for a list of tensors, freed at the end of the test.
class DeviceTensors {
 public:
  ~DeviceTensors() {
    for (void* p : allocations_) (void)cudaFree(p);
  }
  // Uploads every stream; returns the TensorUpdate with device pointers.
  TensorUpdate Upload(const Case& c, const Tensor& t) {
    TensorUpdate u;
    u.numel = t.numel;
    u.param_dtype = c.param;
    u.grad_dtype = c.grad;
    u.state_dtype = c.state;
    u.param = Put(t.param, DTypeSize(c.param), t.misaligned);
    u.grad = Put(t.grad, DTypeSize(c.grad), t.misaligned);
    u.exp_avg = Put(t.exp_avg, DTypeSize(c.state), t.misaligned);
    u.exp_avg_sq =
        t.exp_avg_sq.empty() ? nullptr : Put(t.exp_avg_sq, DTypeSize(c.state), t.misaligned);
    u.master = t.master.empty() ? nullptr : static_cast<float*>(Put(t.master, 4, t.misaligned));
    return u;
  }
  bool ok() const { return ok_; }

 private:
  void* Put(const std::vector<uint8_t>& bytes, size_t elem, bool misaligned) {
    void* base = nullptr;
    if (cudaMalloc(&base, bytes.size() + 16) != cudaSuccess) {
      ok_ = false;
      return nullptr;
    }
    allocations_.push_back(base);
    char* p = static_cast<char*>(base) + (misaligned ? elem : 0);
    if (!bytes.empty() &&
        cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice) != cudaSuccess) {
      ok_ = false;
    }
    return p;
  }
  std::vector<void*> allocations_;
  bool ok_ = true;
};

inline std::vector<uint8_t> Download(const void* device, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  if (bytes > 0) {
    EXPECT_EQ(cudaMemcpy(out.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return out;
}

// Every stream of every tensor, as the device holds it now.
inline std::vector<Tensor> DownloadAll(const std::vector<Tensor>& like,
                                       const std::vector<TensorUpdate>& dev) {
  std::vector<Tensor> out(like.size());
  for (size_t i = 0; i < like.size(); ++i) {
    out[i].numel = like[i].numel;
    out[i].param = Download(dev[i].param, like[i].param.size());
    out[i].grad = Download(dev[i].grad, like[i].grad.size());
    out[i].exp_avg = Download(dev[i].exp_avg, like[i].exp_avg.size());
    out[i].exp_avg_sq = Download(dev[i].exp_avg_sq, like[i].exp_avg_sq.size());
    out[i].master = Download(dev[i].master, like[i].master.size());
  }
  return out;
}

// The first differing element of two byte streams of `elem`-byte elements, or -1.
inline int64_t FirstDiff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
                         size_t elem) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); i += elem) {
    if (std::memcmp(a.data() + i, b.data() + i, elem) != 0) return static_cast<int64_t>(i / elem);
  }
  return -1;
}

inline void ExpectBitwise(const std::string& what, const Case& c, const std::vector<Tensor>& got,
                          const std::vector<Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const std::string at =
        what + " tensor " + std::to_string(i) + " (numel " + std::to_string(got[i].numel) + ") ";
    EXPECT_EQ(FirstDiff(got[i].param, want[i].param, DTypeSize(c.param)), -1) << at << "param";
    EXPECT_EQ(FirstDiff(got[i].exp_avg, want[i].exp_avg, DTypeSize(c.state)), -1)
        << at << "exp_avg";
    EXPECT_EQ(FirstDiff(got[i].exp_avg_sq, want[i].exp_avg_sq, DTypeSize(c.state)), -1)
        << at << "exp_avg_sq";
    EXPECT_EQ(FirstDiff(got[i].master, want[i].master, 4), -1) << at << "master";
    EXPECT_EQ(FirstDiff(got[i].grad, want[i].grad, DTypeSize(c.grad)), -1) << at << "grad";
  }
}

// One host tensor as the CPU updater takes it (pointers into t).
inline TensorUpdate HostUpdate(const Case& c, Tensor& t, const HyperParams& hyper, int64_t step) {
  TensorUpdate u;
  u.numel = t.numel;
  u.param_dtype = c.param;
  u.grad_dtype = c.grad;
  u.state_dtype = c.state;
  u.param = t.param.data();
  u.grad = t.grad.data();
  u.exp_avg = t.exp_avg.data();
  u.exp_avg_sq = t.exp_avg_sq.empty() ? nullptr : t.exp_avg_sq.data();
  u.master = t.master.empty() ? nullptr : reinterpret_cast<float*>(t.master.data());
  u.hyper = &hyper;
  u.step = step;
  return u;
}

// The CPU updater over `u` (pointing into `tensors`), which it returns updated.
inline std::vector<Tensor> CpuRun(const Case& c, std::vector<Tensor> tensors,
                                  std::vector<TensorUpdate> u, float grad_multiplier,
                                  uint64_t seed) {
  auto updater = CpuUpdater::Create(CpuUpdaterOptions{});
  EXPECT_TRUE(updater.ok()) << updater.status().ToString();
  if (!updater.ok()) return tensors;
  StepOptions o;
  o.optimizer = c.optimizer;
  o.grad_multiplier = grad_multiplier;
  o.rounding = c.rounding;
  o.seed = seed;
  const Status s = (*updater)->Step(u.data(), u.size(), o);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return tensors;
}

// The CPU tier on host copies: the bitwise reference.
inline std::vector<Tensor> CpuStep(const Case& c, std::vector<Tensor> tensors,
                                   const std::vector<HyperParams>& hypers,
                                   const std::vector<int64_t>& steps, float grad_multiplier,
                                   uint64_t seed) {
  std::vector<TensorUpdate> u(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    Tensor& t = tensors[i];
    u[i] =
        HostUpdate(c, t, hypers[static_cast<size_t>(t.group)], steps[static_cast<size_t>(t.group)]);
  }
  return CpuRun(c, std::move(tensors), u, grad_multiplier, seed);
}

// A group's hyperparameters with every term exercised (decay, maximize on the odd ones).
inline HyperParams GroupHyper(int group, OptimizerKind o) {
  HyperParams h;
  h.lr = o == OptimizerKind::kLion ? 1e-4f * static_cast<float>(group + 1)
                                   : 1e-3f * static_cast<float>(group + 1);
  h.beta1 = 0.9f - 0.05f * static_cast<float>(group);
  h.beta2 = o == OptimizerKind::kLion ? 0.99f : 0.999f - 0.004f * static_cast<float>(group);
  h.eps = 1e-8f;
  h.weight_decay = 0.01f * static_cast<float>(group);
  h.maximize = group == 1;
  return h;
}

// A stream that destroys itself. Blocking, so the tests' synchronous cudaMemcpy uploads (legacy
// stream) are ordered before the work on it.
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { EXPECT_EQ(cudaStreamCreate(&s), cudaSuccess); }
  ~Stream() {
    if (s != nullptr) (void)cudaStreamDestroy(s);
  }
};

// Sum of squares of every gradient, as the device accumulates it (double).
inline double GradSumSq(const Case& c, const std::vector<Tensor>& tensors) {
  double sum = 0.0;
  for (const Tensor& t : tensors) {
    for (int64_t i = 0; i < t.numel; ++i) {
      const double g = ToFloat(c.grad, t.grad, i);
      sum += g * g;
    }
  }
  return sum;
}

}  // namespace cuda_test
}  // namespace emsa
