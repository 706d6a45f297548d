// Tests for include/emsa/cpu_update.h and src/kernels/cpu: every optimizer x dtype combination
// on every ISA this CPU has, against a float64 reference; ISAs, thread counts and repeated runs
// bitwise equal; the finite check, validation, zero-size tensors, stochastic rounding's bias and
// determinism, the bf16/fp16 conversions against F16C hardware, and no allocation in Step.
#include "emsa/cpu_update.h"

#include <cpuid.h>
#include <gtest/gtest.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/numerics.h"
#include "status_test_support.h"

// ---- allocation counting: the only replacement of global operator new in the test binary -------
namespace {
std::atomic<bool> g_count_allocations{false};
std::atomic<int64_t> g_allocations{0};
void* CountedAlloc(std::size_t n, std::size_t align) {
  if (g_count_allocations.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  if (n == 0) n = 1;
  void* p = align <= alignof(std::max_align_t)
                ? std::malloc(n)
                : std::aligned_alloc(align, (n + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace
// Every form is replaced, so whatever allocates (std::stable_sort's buffer uses the nothrow form)
// is freed by the matching free(): a partial replacement mixes allocators, which ASan reports.
void* operator new(std::size_t n) { return CountedAlloc(n, 0); }
void* operator new[](std::size_t n) { return CountedAlloc(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return CountedAlloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return CountedAlloc(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return CountedAlloc(n, 0);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  try {
    return CountedAlloc(n, static_cast<std::size_t>(a));
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t& t) noexcept {
  return operator new(n, a, t);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

namespace emsa {
namespace {

using cpu::Bf16Nearest;
using cpu::Bf16ToFloat;
using cpu::FloatToHalf;
using cpu::HalfRounding;
using cpu::HalfToFloat;

// ---- data --------------------------------------------------------------------------------------

// splitmix64: fast, and the same stream everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double Uniform(double lo, double hi) { return lo + (hi - lo) * (Next() >> 11) * 0x1p-53; }
  // Magnitude in [lo, hi), random sign: never zero.
  double Signed(double lo, double hi) { return (Next() & 1 ? -1 : 1) * Uniform(lo, hi); }

 private:
  uint64_t s_;
};

uint16_t Bits16(float x, DType d) {
  return d == DType::kBFloat16 ? Bf16Nearest(x) : FloatToHalf(x, HalfRounding::kNearestEven);
}

// numel elements of one dtype, starting `offset` elements past an 8-byte aligned address.
class Buffer {
 public:
  Buffer() = default;
  Buffer(DType dtype, int64_t n, int offset)
      : dtype_(dtype),
        n_(n),
        offset_(offset),
        storage_((static_cast<size_t>(n + offset) * DTypeSize(dtype) + 7) / 8 + 1) {}
  void* data() { return n_ == 0 ? nullptr : Bytes() + offset_ * DTypeSize(dtype_); }
  int64_t size() const { return n_; }
  DType dtype() const { return dtype_; }

  double Get(int64_t i) const {
    if (dtype_ == DType::kFloat32) return At<float>(i);
    const uint16_t h = At<uint16_t>(i);
    return dtype_ == DType::kBFloat16 ? Bf16ToFloat(h) : HalfToFloat(h);
  }
  void Set(int64_t i, float x) {
    if (dtype_ == DType::kFloat32) {
      Put(i, x);
    } else {
      Put(i, Bits16(x, dtype_));
    }
  }
  uint32_t Raw(int64_t i) const {
    return dtype_ == DType::kFloat32 ? cpu::FloatBits(At<float>(i)) : At<uint16_t>(i);
  }
  // Index of the first element whose bits differ, or -1.
  int64_t FirstDiff(const Buffer& o) const {
    for (int64_t i = 0; i < n_; ++i) {
      if (Raw(i) != o.Raw(i)) return i;
    }
    return -1;
  }

 private:
  char* Bytes() { return reinterpret_cast<char*>(storage_.data()); }
  const char* Bytes() const { return reinterpret_cast<const char*>(storage_.data()); }
  template <class T>
  T At(int64_t i) const {
    T v;
    std::memcpy(&v, Bytes() + (offset_ + i) * sizeof(T), sizeof(T));
    return v;
  }
  template <class T>
  void Put(int64_t i, T v) {
    std::memcpy(Bytes() + (offset_ + i) * sizeof(T), &v, sizeof(T));
  }

  DType dtype_ = DType::kFloat32;
  int64_t n_ = 0;
  int offset_ = 0;
  std::vector<uint64_t> storage_;
};

struct Combo {
  OptimizerKind opt;
  DType param;
  bool master;
  DType grad;
  DType state;
  Rounding rounding;
};

const char* Short(DType d) {
  return d == DType::kFloat32 ? "f32" : d == DType::kBFloat16 ? "bf16" : "f16";
}

std::string ComboName(const Combo& c) {
  return std::string(OptimizerName(c.opt)) + "_p" + Short(c.param) + (c.master ? "m" : "") + "_g" +
         Short(c.grad) + "_s" + Short(c.state) +
         (c.rounding == Rounding::kStochastic ? "_sr" : "_rn");
}

// Every supported combination, with rounding varied only where something is rounded by it.
std::vector<Combo> AllCombos() {
  std::vector<Combo> out;
  const std::pair<DType, bool> params[] = {{DType::kFloat32, false},
                                           {DType::kBFloat16, true},
                                           {DType::kFloat16, true},
                                           {DType::kBFloat16, false},
                                           {DType::kFloat16, false}};
  for (OptimizerKind opt : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kLion})
    for (auto [param, master] : params)
      for (DType grad : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
        for (DType state : {DType::kFloat32, DType::kBFloat16})
          for (Rounding r : {Rounding::kNearest, Rounding::kStochastic}) {
            const bool low_param = param != DType::kFloat32 && !master;
            if (low_param && r == Rounding::kNearest) continue;  // rejected by design
            if (!low_param && state == DType::kFloat32 && r == Rounding::kNearest) continue;
            out.push_back({opt, param, master, grad, state, r});
          }
  return out;
}

struct Tensors {
  std::vector<Buffer> param, grad, m, v, master;
};

// Sizes from the brief, each starting 1..3 elements past alignment; two hyperparameter groups
// (the second takes torch.lerp's other branch, weight >= 0.5, and maximizes).
struct Batch {
  Combo combo;
  std::vector<int64_t> sizes;
  std::vector<HyperParams> hyper;
  std::vector<int64_t> steps;
  Tensors t;

  Batch(const Combo& c, std::vector<int64_t> sz, uint64_t seed) : combo(c), sizes(std::move(sz)) {
    hyper.resize(2);
    hyper[0] = HyperParams{1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, false};
    hyper[1] = HyperParams{3e-3f, 0.3f, 0.2f, 1e-6f, 0.05f, true};
    for (size_t k = 0; k < sizes.size(); ++k) {
      const int64_t n = sizes[k];
      const int off = static_cast<int>(k % 3) + 1;
      steps.push_back(1 + 3 * static_cast<int64_t>(k));
      t.param.emplace_back(c.param, n, off);
      t.grad.emplace_back(c.grad, n, off);
      t.m.emplace_back(c.state, n, off);
      t.v.emplace_back(c.state, c.opt == OptimizerKind::kLion ? 0 : n, off);
      t.master.emplace_back(DType::kFloat32, c.master ? n : 0, off);
      Generate(seed, k, [&](int64_t i, Rng& rng) {
        const float p = static_cast<float>(rng.Signed(0.1, 1.0));
        t.param[k].Set(i, p);
        if (c.master) t.master[k].Set(i, p);
        t.m[k].Set(i, static_cast<float>(rng.Signed(1e-3, 0.1)));
        if (c.opt != OptimizerKind::kLion) {
          t.v[k].Set(i, static_cast<float>(rng.Uniform(1e-4, 1e-2)));
        }
      });
    }
    FreshGrads(seed ^ 0x5555);
  }

  void FreshGrads(uint64_t seed) {
    for (size_t k = 0; k < sizes.size(); ++k) {
      Generate(seed, k, [&](int64_t i, Rng& rng) {
        t.grad[k].Set(i, static_cast<float>(rng.Signed(0.01, 1.0)));
      });
    }
  }

  // Calls fn(i, rng) for every element of tensor k, in parallel; each block of elements has its
  // own stream, so the data does not depend on the thread count.
  template <typename Fn>
  void Generate(uint64_t seed, size_t k, Fn&& fn) {
    constexpr int64_t kBlock = 4096;
    DataPool().ParallelFor(sizes[k], kBlock, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; block += kBlock) {
        Rng rng(seed * 0x100000001B3ull + k * 0x9E3779B9ull + static_cast<uint64_t>(block));
        for (int64_t i = block; i < std::min(end, block + kBlock); ++i) fn(i, rng);
      }
    });
  }

  static ThreadPool& DataPool() {
    static ThreadPool pool;
    return pool;
  }

  std::vector<TensorUpdate> Updates() {
    std::vector<TensorUpdate> out(sizes.size());
    for (size_t k = 0; k < sizes.size(); ++k) {
      TensorUpdate& u = out[k];
      u.param = t.param[k].data();
      u.grad = t.grad[k].data();
      u.exp_avg = t.m[k].data();
      u.exp_avg_sq = t.v[k].data();
      u.master = static_cast<float*>(t.master[k].data());
      u.numel = sizes[k];
      u.param_dtype = combo.param;
      u.grad_dtype = combo.grad;
      u.state_dtype = combo.state;
      u.step = steps[k];
      u.hyper = &hyper[k % 2];
    }
    return out;
  }

  StepOptions Options() const {
    StepOptions o;
    o.optimizer = combo.opt;
    o.grad_multiplier = 0.75f;
    o.rounding = combo.rounding;
    o.seed = 1234;
    return o;
  }

  Status Step(CpuUpdater& u, const StepOptions& o, StepReport* report = nullptr) {
    std::vector<TensorUpdate> ups = Updates();
    Status s = u.Step(ups.data(), ups.size(), o, report);
    if (s.ok()) {
      for (int64_t& st : steps) ++st;
    }
    return s;
  }
};

// The first element whose bits differ between two sets of buffers, as "name of tensor k at i:
// x vs y", or "".
std::string FirstDiff(const char* name, const std::vector<Buffer>& x,
                      const std::vector<Buffer>& y) {
  for (size_t k = 0; k < x.size(); ++k) {
    const int64_t i = x[k].FirstDiff(y[k]);
    if (i >= 0) {
      return std::string(name) + " of tensor " + std::to_string(k) + " at " + std::to_string(i) +
             ": " + std::to_string(x[k].Get(i)) + " vs " + std::to_string(y[k].Get(i));
    }
  }
  return "";
}

// The same over all of a batch's buffers.
std::string FirstDiff(const Tensors& a, const Tensors& b) {
  for (const std::string& diff :
       {FirstDiff("param", a.param, b.param), FirstDiff("grad", a.grad, b.grad),
        FirstDiff("exp_avg", a.m, b.m), FirstDiff("exp_avg_sq", a.v, b.v),
        FirstDiff("master", a.master, b.master)}) {
    if (!diff.empty()) return diff;
  }
  return "";
}

// ---- the float64 reference with a running fp32 error bound ------------------------------------
//
// Each value carries x, the exact result in double, and e, a first-order bound on how far an
// fp32 evaluation in the kernel's operation order can be from x: every fp32 operation adds half
// an ulp (u|result|, u = 2^-24) and propagates its inputs' bounds; constants the kernel rounds
// from double to float start with u|c|. Where no operands cancel, e stays a few u|x|, well under
// 1e-6|x|, and the test demands plain 1e-6 relative error. Where a sum's terms cancel, fp32 can
// only be accurate to a few ulps of the terms, not of the small sum; there e is the honest
// bound and the test allows 2e. A wrong constant, operation or order exceeds both.
constexpr double kU = 0x1p-24;

struct Err {
  double x = 0.0, e = 0.0;
};
inline Err In(double x) { return {x, 0.0}; }               // exact input
inline Err K(double c) { return {c, kU * std::fabs(c)}; }  // double constant rounded to float once
inline Err Rnd(double x, double e) { return {x, e + kU * std::fabs(x)}; }
inline Err operator+(Err a, Err b) { return Rnd(a.x + b.x, a.e + b.e); }
inline Err operator-(Err a, Err b) { return Rnd(a.x - b.x, a.e + b.e); }
inline Err operator*(Err a, Err b) {
  return Rnd(a.x * b.x, std::fabs(a.x) * b.e + std::fabs(b.x) * a.e + a.e * b.e);
}
inline Err operator/(Err a, Err b) {
  const double q = a.x / b.x;
  return Rnd(q, (a.e + std::fabs(q) * b.e) / (std::fabs(b.x) - b.e));
}
inline Err Sqrt(Err a) {
  const double r = std::sqrt(a.x);
  return Rnd(r, a.e / (r + std::sqrt(std::max(a.x - a.e, 0.0))));
}
inline Err Neg(Err a) { return {-a.x, a.e}; }

// The same arithmetic on plain doubles: the fast first pass (see CheckStep).
template <class T>
T Cst(const Err& c);
template <>
inline Err Cst<Err>(const Err& c) {
  return c;
}
template <>
inline double Cst<double>(const Err& c) {
  return c.x;
}
inline double Sqrt(double a) { return std::sqrt(a); }
inline double ValueOf(double a) { return a; }
inline double ValueOf(const Err& a) { return a.x; }
inline double BoundOf(double) { return 0.0; }
inline double BoundOf(const Err& a) { return a.e; }

// torch.lerp's weight as the kernel holds it: w, or -(1 - w) in the w >= 0.5 form.
struct RefLerp {
  Err coef;
  bool from_end;
};
RefLerp MakeRefLerp(double beta) {
  const Err w = K(1.0 - beta);
  if (std::fabs(w.x) < 0.5) return {w, false};
  return {Neg(In(1.0) - w), true};
}
// torch.lerp in the branch the kernel takes (the exact value is the same in both).
template <class T>
T Lerp(T start, T end, const RefLerp& l) {
  return (l.from_end ? end : start) + (end - start) * Cst<T>(l.coef);
}

template <class T>
struct Expected {
  T p[3];
  int candidates = 1;  // Lion: several when sign(c) is within its bound of zero
  T m, v;
};

// One tensor's step constants, as the kernel rounds them (computed once per tensor).
struct RefConsts {
  OptimizerKind opt;
  RefLerp lerp1, lerp2;
  Err scale, decay, wd, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
  double neg_lr;
};

RefConsts MakeRefConsts(OptimizerKind opt, const HyperParams& h, int64_t step, float mult) {
  const double lr = h.lr, wd = h.weight_decay, b1 = h.beta1, b2 = h.beta2;
  const double t = static_cast<double>(step);
  RefConsts c;
  c.opt = opt;
  c.lerp1 = MakeRefLerp(b1);
  c.lerp2 = MakeRefLerp(b2);
  c.scale = In(h.maximize ? -mult : mult);
  c.decay = K(1.0 - lr * wd);
  c.wd = In(wd);
  c.beta2 = In(b2);
  c.one_minus_beta2 = K(1.0 - b2);
  c.bc2_sqrt = K(std::sqrt(1.0 - std::pow(b2, t)));
  c.eps = In(h.eps);
  c.neg_step = K(-(lr / (1.0 - std::pow(b1, t))));
  c.neg_lr = -lr;
  return c;
}

template <class T>
Expected<T> Reference(const RefConsts& c, double p, double g, double m, double v) {
  Expected<T> out;
  T G = T{g} * Cst<T>(c.scale);
  T P{p}, M{m};
  if (c.opt == OptimizerKind::kLion) {
    const T update = Lerp(M, G, c.lerp1);
    P = P * Cst<T>(c.decay);
    const double u = ValueOf(update);
    if (std::fabs(u) <= 2 * BoundOf(update)) {
      out.candidates = 3;
      for (int k = 0; k < 3; ++k) out.p[k] = P + T{c.neg_lr * (k - 1)};
    } else {
      out.p[0] = P + T{c.neg_lr * (u > 0 ? 1.0 : -1.0)};
    }
    out.m = Lerp(M, G, c.lerp2);
    return out;
  }
  if (c.opt == OptimizerKind::kAdam) G = G + Cst<T>(c.wd) * P;
  T V{v};
  if (c.opt == OptimizerKind::kAdamW) P = P * Cst<T>(c.decay);
  M = Lerp(M, G, c.lerp1);
  V = V * Cst<T>(c.beta2) + (Cst<T>(c.one_minus_beta2) * G) * G;
  const T denom = Sqrt(V) / Cst<T>(c.bc2_sqrt) + Cst<T>(c.eps);
  out.p[0] = P + (Cst<T>(c.neg_step) * M) / denom;
  out.m = M;
  out.v = V;
  return out;
}

// Relative rounding of a store: 0 for fp32; one ulp (stochastic) or half (nearest) otherwise.
double StoreRel(DType d, bool stochastic) {
  if (d == DType::kFloat32) return 0.0;
  const double ulp = d == DType::kBFloat16 ? 0x1p-7 : 0x1p-10;
  return stochastic ? ulp : ulp / 2;
}

template <class T>
bool Close(double out, const T& ref, double store_rel) {
  const double x = ValueOf(ref);
  double tol = std::max(1e-6 * std::fabs(x), 2 * BoundOf(ref));
  if (store_rel > 0) tol += store_rel * (std::fabs(x) + tol) + 0x1p-24;
  return std::fabs(out - x) <= tol;
}

// Compares one step of every tensor against the reference, in parallel over `pool`; returns
// the number of bad elements and reports the first few.
int64_t CheckStep(ThreadPool& pool, const Batch& b, const Tensors& before, const Tensors& after,
                  const std::vector<int64_t>& steps_before) {
  const Combo& c = b.combo;
  const bool sr = c.rounding == Rounding::kStochastic;
  const bool lion = c.opt == OptimizerKind::kLion;
  const double m_rel = StoreRel(c.state, sr);
  const double p_rel = c.master ? 0.0 : StoreRel(c.param, true);
  std::atomic<int64_t> bad{0};
  auto report = [&](size_t k, int64_t i, const char* what, double got, double want) {
    if (bad.fetch_add(1) < 5) {
      ADD_FAILURE() << ComboName(c) << " tensor " << k << " (numel " << b.sizes[k] << ") element "
                    << i << " " << what << ": got " << got << " want " << want;
    }
  };
  for (size_t k = 0; k < b.sizes.size(); ++k) {
    const RefConsts consts = MakeRefConsts(c.opt, b.hyper[k % 2], steps_before[k], 0.75f);
    pool.ParallelFor(b.sizes[k], 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const double p_in = c.master ? before.master[k].Get(i) : before.param[k].Get(i);
        const double g = before.grad[k].Get(i), m = before.m[k].Get(i);
        const double v = lion ? 0.0 : before.v[k].Get(i);
        const double p_out = c.master ? after.master[k].Get(i) : after.param[k].Get(i);
        const double m_out = after.m[k].Get(i), v_out = lion ? 0.0 : after.v[k].Get(i);
        // Bit i set: output i (param, exp_avg, exp_avg_sq) is outside its tolerance.
        auto failures = [&](const auto& e) {
          bool p_ok = false;
          for (int j = 0; j < e.candidates; ++j) p_ok = p_ok || Close(p_out, e.p[j], p_rel);
          return (p_ok ? 0u : 1u) | (Close(m_out, e.m, m_rel) ? 0u : 2u) |
                 (lion || Close(v_out, e.v, m_rel) ? 0u : 4u);
        };
        // Plain 1e-6 relative error in double first; only where that fails (operands that
        // cancel) is the error bound worth computing.
        if (failures(Reference<double>(consts, p_in, g, m, v)) != 0) {
          const Expected<Err> e = Reference<Err>(consts, p_in, g, m, v);
          const unsigned f = failures(e);
          if (f & 1u) report(k, i, c.master ? "master" : "param", p_out, e.p[0].x);
          if (f & 2u) report(k, i, "exp_avg", m_out, e.m.x);
          if (f & 4u) report(k, i, "exp_avg_sq", v_out, e.v.x);
        }
        if (c.master && after.param[k].Raw(i) != Bits16(static_cast<float>(p_out), c.param)) {
          report(k, i, "param != rounded master", after.param[k].Get(i), p_out);
        }
      }
    });
  }
  return bad.load();
}

// ---- updaters per ISA ---------------------------------------------------------------------------

bool Supported(SimdLevel level) { return DetectSimdLevel() >= level; }

std::unique_ptr<CpuUpdater> MakeUpdater(SimdLevel level, int threads) {
  CpuUpdaterOptions o;
  o.max_simd = level;
  o.threads = threads;
  auto r = CpuUpdater::Create(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return nullptr;
  EXPECT_EQ(r.value()->simd(), level);
  return std::move(r).value();
}

const std::vector<int64_t> kSizes = {1, 3, 17, 4097, (int64_t{1} << 20) + 5};
const SimdLevel kLevels[] = {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512};

// ---- against the reference, every ISA x combination ---------------------------------------------

class CpuUpdateReference : public testing::TestWithParam<std::tuple<SimdLevel, Combo>> {};

TEST_P(CpuUpdateReference, MatchesFloat64ReferenceEveryStep) {
  const auto [level, combo] = GetParam();
  if (!Supported(level)) GTEST_SKIP() << SimdLevelName(level) << " not supported by this CPU";
  auto updater = MakeUpdater(level, 2);
  ASSERT_NE(updater, nullptr);
  Batch b(combo, kSizes, 42);
  Tensors before;  // reused: its buffers keep their pages from step to step
  for (int step = 0; step < 3; ++step) {
    b.FreshGrads(100 + step);
    before = b.t;
    const std::vector<int64_t> steps = b.steps;
    ASSERT_TRUE(b.Step(*updater, b.Options()).ok());
    ASSERT_EQ(CheckStep(Batch::DataPool(), b, before, b.t, steps), 0) << "step " << step;
  }
}

std::string ParamName(const testing::TestParamInfo<std::tuple<SimdLevel, Combo>>& info) {
  return std::string(SimdLevelName(std::get<0>(info.param))) + "_" +
         ComboName(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(All, CpuUpdateReference,
                         testing::Combine(testing::ValuesIn(kLevels),
                                          testing::ValuesIn(AllCombos())),
                         ParamName);

// ---- bitwise: every ISA and thread count agree --------------------------------------------------

// Values that exercise the rounding edges: fp16 overflow and subnormals, bf16 ties, huge and
// tiny gradients, and (last step only) non-finite ones. Each element gets at most one NaN
// source: where two NaNs meet, x86 returns the first operand's, and the compiler may commute
// operands differently per ISA, so only then could NaN payloads legitimately differ.
void InjectSpecials(Batch& b, size_t k, bool nonfinite) {
  const float params[] = {65500.0f, 65519.0f, 7e-6f, 3e-8f, 1.00390625f, -1.5e-5f};
  const float grads[] = {1e30f, -1e30f, 1e-30f, 0.0f, INFINITY, NAN};
  for (int j = 0; j < 6; ++j) {
    b.t.param[k].Set(7 * j, params[j]);
    if (b.combo.master) b.t.master[k].Set(7 * j, params[j]);
    if (nonfinite || std::isfinite(grads[j])) b.t.grad[k].Set(7 * j + 3, grads[j]);
  }
}

class CpuUpdateBitwise : public testing::TestWithParam<Combo> {};

TEST_P(CpuUpdateBitwise, IsasAndThreadCountsAgree) {
  Batch start(GetParam(), kSizes, 7);
  InjectSpecials(start, 3, false);
  // The gradients of each step, made once and copied into every run.
  std::vector<std::vector<Buffer>> grads;
  for (int step = 0; step < 2; ++step) {
    Batch g = start;
    g.FreshGrads(500 + step);
    InjectSpecials(g, 3, step == 1);
    grads.push_back(g.t.grad);
  }
  Tensors first;
  std::string first_name;
  Batch b = start;  // reset from `start` for every run, reusing its buffers' pages
  for (SimdLevel level : kLevels) {
    if (!Supported(level)) continue;
    for (int threads : {1, 2, 3}) {
      auto updater = MakeUpdater(level, threads);
      ASSERT_NE(updater, nullptr);
      b.t = start.t;
      b.steps = start.steps;
      for (int step = 0; step < 2; ++step) {
        b.t.grad = grads[static_cast<size_t>(step)];
        ASSERT_TRUE(b.Step(*updater, b.Options()).ok());
      }
      const std::string name = std::string(SimdLevelName(level)) + "/" + std::to_string(threads);
      if (first_name.empty()) {
        first = b.t;
        first_name = name;
      } else {
        EXPECT_EQ(FirstDiff(first, b.t), "") << name << " differs from " << first_name;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, CpuUpdateBitwise, testing::ValuesIn(AllCombos()),
                         [](const testing::TestParamInfo<Combo>& info) {
                           return ComboName(info.param);
                         });

TEST(CpuUpdate, RepeatedRunsAreBitwiseEqual) {
  const Combo c{OptimizerKind::kAdamW, DType::kFloat32,  false,
                DType::kFloat32,       DType::kBFloat16, Rounding::kStochastic};
  auto updater = MakeUpdater(DetectSimdLevel(), 2);
  Batch a(c, kSizes, 3);
  Batch b = a;
  ASSERT_TRUE(a.Step(*updater, a.Options()).ok());
  ASSERT_TRUE(b.Step(*updater, b.Options()).ok());
  EXPECT_EQ(FirstDiff(a.t, b.t), "");
}

// StepRange over consecutive pieces (cut inside tensors, across tensors, at the batch's end)
// writes the same bits as one Step, for every combination, including stochastic rounding (whose
// stream follows each element's index within its tensor, not within the piece).
TEST(CpuUpdate, StepRangePiecesEqualOneStepBitwise) {
  auto updater = MakeUpdater(DetectSimdLevel(), 3);
  for (const Combo& c : AllCombos()) {
    Batch whole(c, kSizes, 21);
    Batch pieces = whole;
    ASSERT_TRUE(whole.Step(*updater, whole.Options()).ok());
    std::vector<TensorUpdate> ups = pieces.Updates();
    int64_t total = 0;
    for (int64_t n : kSizes) total += n;
    int64_t first = 0;
    for (int64_t want : {int64_t{10}, int64_t{4160}, int64_t{300000}, total}) {
      const int64_t last = CpuUpdater::Aligned(ups.data(), ups.size(), want);
      const Status st = updater->StepRange(ups.data(), ups.size(), pieces.Options(), first, last);
      ASSERT_TRUE(st.ok()) << ComboName(c) << ": " << st.ToString();
      first = last;
    }
    ASSERT_EQ(first, total);
    EXPECT_EQ(FirstDiff(whole.t, pieces.t), "") << ComboName(c);
  }
}

// Guided self-scheduling (the default) deals the same elements to whichever thread claims them
// first: the same bits as equal shares, for Step and for StepRange.
TEST(CpuUpdate, GuidedSchedulingWritesTheSameBits) {
  const Combo c{OptimizerKind::kAdamW, DType::kBFloat16, true,
                DType::kFloat32,       DType::kBFloat16, Rounding::kStochastic};
  auto reference = MakeUpdater(DetectSimdLevel(), 3);
  ASSERT_TRUE(reference->SetGuidedScheduling(0).ok());  // equal shares
  Batch want(c, kSizes, 41);
  const Batch start = want;
  ASSERT_TRUE(want.Step(*reference, want.Options()).ok());
  int64_t total = 0;
  for (int64_t n : kSizes) total += n;
  for (int threads : {2, 3, 5}) {
    for (int64_t min_elements : {int64_t{64}, int64_t{1000}, int64_t{1} << 22}) {
      auto updater = MakeUpdater(DetectSimdLevel(), threads);
      ASSERT_TRUE(updater->SetGuidedScheduling(min_elements).ok());
      Batch whole = start;
      ASSERT_TRUE(whole.Step(*updater, whole.Options()).ok());
      EXPECT_EQ(FirstDiff(want.t, whole.t), "") << threads << " threads, " << min_elements;
      Batch ranged = start;
      std::vector<TensorUpdate> ups = ranged.Updates();
      const int64_t mid = CpuUpdater::Aligned(ups.data(), ups.size(), total / 2);
      ASSERT_TRUE(updater->StepRange(ups.data(), ups.size(), ranged.Options(), 0, mid).ok());
      ASSERT_TRUE(updater->StepRange(ups.data(), ups.size(), ranged.Options(), mid, total).ok());
      EXPECT_EQ(FirstDiff(want.t, ranged.t), "") << threads << " threads, " << min_elements;
    }
  }
  auto updater = MakeUpdater(DetectSimdLevel(), 2);
  ExpectError(updater->SetGuidedScheduling(63), StatusCode::kInvalidArgument, "at least 64");
  ExpectError(updater->SetGuidedScheduling(-1), StatusCode::kInvalidArgument, "at least 64");
}

// TensorUpdate::delta: the update's change to an fp32 parameter is written out instead of the
// parameter, which is not read. p * (1 - lr*wd) + delta, each operation rounded, must be the
// parameter the ordinary update stores, and the moments the same bits; on every ISA, for AdamW
// and Lion, fp32 and bf16 state, the delta in its own buffer or in place of an fp32 gradient.
TEST(CpuUpdate, DeltaKernelsGiveTheParameterTheOrdinaryUpdateStores) {
  for (SimdLevel level : kLevels) {
    if (!Supported(level)) continue;
    auto updater = MakeUpdater(level, 3);
    ASSERT_NE(updater, nullptr);
    for (OptimizerKind opt : {OptimizerKind::kAdamW, OptimizerKind::kLion}) {
      for (DType state : {DType::kFloat32, DType::kBFloat16}) {
        for (DType grad : {DType::kFloat32, DType::kBFloat16}) {
          const Combo c{opt, DType::kFloat32, false, grad, state, Rounding::kStochastic};
          const std::string name = std::string(SimdLevelName(level)) + " " + ComboName(c);
          Batch want(c, kSizes, 77);
          const Batch start = want;
          ASSERT_TRUE(want.Step(*updater, want.Options()).ok()) << name;
          Batch got = start;
          std::vector<TensorUpdate> ups = got.Updates();
          std::vector<Buffer> own;  // a delta buffer per tensor unless it goes in the gradient
          for (size_t k = 0; k < ups.size(); ++k) {
            own.emplace_back(DType::kFloat32, kSizes[k], 1);
            ups[k].delta = grad == DType::kFloat32 ? static_cast<float*>(got.t.grad[k].data())
                                                   : static_cast<float*>(own[k].data());
            if (k % 2 == 0) ups[k].param = nullptr;  // not read: null is fine
          }
          ASSERT_TRUE(updater->Step(ups.data(), ups.size(), got.Options()).ok()) << name;
          EXPECT_EQ(FirstDiff("exp_avg", want.t.m, got.t.m), "") << name;
          EXPECT_EQ(FirstDiff("exp_avg_sq", want.t.v, got.t.v), "") << name;
          EXPECT_EQ(FirstDiff("param", start.t.param, got.t.param), "") << name;
          for (size_t k = 0; k < ups.size(); ++k) {
            const float decay = cpu::MakeUpdateArgs(ups[k], got.Options()).decay;
            for (int64_t i = 0; i < kSizes[k]; ++i) {
              volatile float decayed = static_cast<float>(start.t.param[k].Get(i)) * decay;
              const float p = decayed + ups[k].delta[i];
              ASSERT_EQ(cpu::FloatBits(p), want.t.param[k].Raw(i))
                  << name << " tensor " << k << " element " << i;
            }
          }
        }
      }
    }
  }
}

// TensorUpdate::grad may be param itself (same dtype): the host tier rounds a 16-bit parameter
// with a master over its gradient staging, which its upload then reads. Every element's gradient
// is read before its parameter is written, so the moments, the master and the rounded parameter
// (now where the gradient was) are the bits of the update with a buffer of its own; every ISA,
// each optimizer, bf16 and fp16 parameters, fp32 and bf16 state.
TEST(CpuUpdate, ParameterRoundedOverItsGradientGivesTheSameBits) {
  for (SimdLevel level : kLevels) {
    if (!Supported(level)) continue;
    auto updater = MakeUpdater(level, 3);
    ASSERT_NE(updater, nullptr);
    for (OptimizerKind opt : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kLion}) {
      for (DType param : {DType::kBFloat16, DType::kFloat16}) {
        for (DType state : {DType::kFloat32, DType::kBFloat16}) {
          const Combo c{opt, param, true, param, state, Rounding::kNearest};
          const std::string name = std::string(SimdLevelName(level)) + " " + ComboName(c);
          Batch want(c, kSizes, 91);
          Batch got = want;
          ASSERT_TRUE(want.Step(*updater, want.Options()).ok()) << name;
          std::vector<TensorUpdate> ups = got.Updates();
          for (TensorUpdate& u : ups) u.param = const_cast<void*>(u.grad);
          ASSERT_TRUE(updater->Step(ups.data(), ups.size(), got.Options()).ok()) << name;
          EXPECT_EQ(FirstDiff("exp_avg", want.t.m, got.t.m), "") << name;
          EXPECT_EQ(FirstDiff("exp_avg_sq", want.t.v, got.t.v), "") << name;
          EXPECT_EQ(FirstDiff("master", want.t.master, got.t.master), "") << name;
          EXPECT_EQ(FirstDiff("rounded param", want.t.param, got.t.grad), "") << name;
        }
      }
    }
  }
}

// A parameter written over a gradient of another dtype would mix element sizes: refused.
TEST(CpuUpdate, ParameterOverAGradientOfAnotherDtypeIsRejected) {
  auto updater = MakeUpdater(DetectSimdLevel(), 2);
  const Combo c{OptimizerKind::kAdamW, DType::kBFloat16, true,
                DType::kFloat32,       DType::kFloat32,  Rounding::kNearest};
  Batch b(c, {64, 100}, 5);
  const Batch before = b;
  std::vector<TensorUpdate> ups = b.Updates();
  ups[1].param = const_cast<void*>(ups[1].grad);
  ExpectError(updater->Step(ups.data(), ups.size(), b.Options()), StatusCode::kInvalidArgument,
              "only in its own dtype");
  EXPECT_EQ(FirstDiff(before.t, b.t), "");
}

TEST(CpuUpdate, DeltaIsRejectedWhereItCannotHoldTheUpdateAndNothingChanges) {
  auto updater = MakeUpdater(DetectSimdLevel(), 2);
  struct Case {
    Combo combo;
    bool in_grad;
    const char* message;
  };
  const Case cases[] = {
      {{OptimizerKind::kAdam, DType::kFloat32, false, DType::kFloat32, DType::kFloat32,
        Rounding::kStochastic},
       false,
       "use AdamW or Lion"},
      {{OptimizerKind::kAdamW, DType::kBFloat16, true, DType::kFloat32, DType::kFloat32,
        Rounding::kStochastic},
       false,
       "fp32 parameters only"},
      {{OptimizerKind::kAdamW, DType::kFloat32, false, DType::kBFloat16, DType::kFloat32,
        Rounding::kStochastic},
       true,
       "only an fp32 gradient can hold the delta"},
  };
  for (const Case& k : cases) {
    Batch b(k.combo, {64, 100}, 5);
    const Batch before = b;
    Buffer own(DType::kFloat32, 100, 0);
    std::vector<TensorUpdate> ups = b.Updates();
    ups[1].delta = k.in_grad ? static_cast<float*>(const_cast<void*>(ups[1].grad))
                             : static_cast<float*>(own.data());
    ExpectError(updater->Step(ups.data(), ups.size(), b.Options()), StatusCode::kInvalidArgument,
                k.message);
    EXPECT_EQ(FirstDiff(before.t, b.t), "") << k.message;
  }
}

TEST(CpuUpdate, StepRangeRejectsBadRangesAndChangesNothing) {
  const Combo c{OptimizerKind::kAdamW, DType::kFloat32, false,
                DType::kFloat32,       DType::kFloat32, Rounding::kStochastic};
  auto updater = MakeUpdater(DetectSimdLevel(), 2);
  Batch b(c, {100, 200}, 5);
  const Tensors before = b.t;
  std::vector<TensorUpdate> ups = b.Updates();
  StepOptions o = b.Options();
  // Aligned: tensor starts and multiples of 64 within a tensor; the batch's end.
  EXPECT_EQ(CpuUpdater::Aligned(ups.data(), ups.size(), 99), 64);
  EXPECT_EQ(CpuUpdater::Aligned(ups.data(), ups.size(), 100), 100);
  EXPECT_EQ(CpuUpdater::Aligned(ups.data(), ups.size(), 170), 164);
  EXPECT_EQ(CpuUpdater::Aligned(ups.data(), ups.size(), 1000), 300);
  const auto expect_bad = [&](int64_t first, int64_t last, const std::string& needle) {
    ExpectError(updater->StepRange(ups.data(), ups.size(), o, first, last),
                StatusCode::kInvalidArgument, needle);
  };
  expect_bad(0, 99, "multiple of 64");
  expect_bad(64, 301, "not within the batch's 300 elements");
  expect_bad(100, 64, "not within");
  o.check_finite = true;
  expect_bad(0, 100, "GradStats");
  EXPECT_EQ(FirstDiff(before, b.t), "");
}

// ---- stochastic rounding ------------------------------------------------------------------------

TEST(CpuUpdate, StochasticRoundingDependsOnSeedAndStepOnly) {
  const Combo c{OptimizerKind::kAdamW, DType::kBFloat16, false,
                DType::kFloat32,       DType::kBFloat16, Rounding::kStochastic};
  auto updater = MakeUpdater(DetectSimdLevel(), 2);
  const Batch start(c, {4097}, 11);
  auto run = [&](uint64_t seed, int64_t step) {
    Batch b = start;
    b.steps[0] = step;
    StepOptions o = b.Options();
    o.seed = seed;
    EXPECT_TRUE(b.Step(*updater, o).ok());
    return b.t;
  };
  EXPECT_EQ(FirstDiff(run(1, 5), run(1, 5)), "");
  EXPECT_NE(FirstDiff(run(1, 5), run(2, 5)), "") << "seed does not change the rounding";
  // Another step also changes the bias correction; the roundings must differ regardless.
  EXPECT_NE(FirstDiff(run(1, 5), run(1, 6)), "");
}

// A value between two bf16 neighbours, stored by many elements: the mean of the stored values
// must be the value, within a few standard errors of the binomial rounding.
void ExpectUnbiased(const Buffer& stored, double value, const char* what) {
  const double lo =
      Bf16ToFloat(static_cast<uint16_t>(cpu::FloatBits(static_cast<float>(value)) >> 16));
  const double ulp = std::ldexp(1.0, std::ilogb(lo) - 7);
  const double p = (value - lo) / ulp;
  ASSERT_GT(p, 0.05);
  ASSERT_LT(p, 0.95);
  double sum = 0.0;
  int64_t other = 0;
  for (int64_t i = 0; i < stored.size(); ++i) {
    const double x = stored.Get(i);
    if (x != lo && x != lo + ulp) ++other;
    sum += (x - lo) / ulp;
  }
  EXPECT_EQ(other, 0) << what << ": values outside the two neighbours";
  const double n = static_cast<double>(stored.size());
  const double sigma = std::sqrt(p * (1 - p) / n);
  EXPECT_NEAR(sum / n, p, 5 * sigma) << what;
  EXPECT_GT(std::fabs(sum / n - p), 0.0) << what << ": suspiciously exact";
}

TEST(CpuUpdate, StochasticRoundingIsUnbiasedOnEveryIsa) {
  constexpr int64_t n = 1 << 16;
  for (SimdLevel level : kLevels) {
    if (!Supported(level)) continue;
    SCOPED_TRACE(SimdLevelName(level));
    auto updater = MakeUpdater(level, 2);
    // Lion with beta2 = 0: exp_avg = lerp(m, g, 1) = g exactly, so it stores exactly x.
    {
      Combo c{OptimizerKind::kLion, DType::kFloat32,  false,
              DType::kFloat32,      DType::kBFloat16, Rounding::kStochastic};
      Batch b(c, {n}, 1);
      const float x = cpu::BitsFloat(0x3F804CCDu);  // 1 + 0.3 bf16 ulp
      for (int64_t i = 0; i < n; ++i) b.t.grad[0].Set(i, x);
      b.hyper[0].beta2 = 0.0f;
      StepOptions o = b.Options();
      o.grad_multiplier = 1.0f;
      ASSERT_TRUE(b.Step(*updater, o).ok());
      ExpectUnbiased(b.t.m[0], x, "exp_avg");
    }
    // Adam with beta2 = 0 and no decay: exp_avg_sq becomes g*g, one fp32 product.
    {
      Combo c{OptimizerKind::kAdam, DType::kFloat32,  false,
              DType::kFloat32,      DType::kBFloat16, Rounding::kStochastic};
      Batch b(c, {n}, 2);
      const float g = 1.1f;
      for (int64_t i = 0; i < n; ++i) b.t.grad[0].Set(i, g);
      b.hyper[0].beta2 = 0.0f;
      b.hyper[0].weight_decay = 0.0f;
      StepOptions o = b.Options();
      o.grad_multiplier = 1.0f;
      ASSERT_TRUE(b.Step(*updater, o).ok());
      volatile float gv = g;
      ExpectUnbiased(b.t.v[0], static_cast<double>(gv * gv), "exp_avg_sq");
    }
  }
}

TEST(CpuNumerics, HalfStochasticIsUnbiased) {
  // Between two fp16 neighbours in the normal and the subnormal range, and just past 65504.
  for (float x : {1.0f + 0.37f * 0x1p-10f, 3.3e-6f, -5.1e-7f, 65510.0f}) {
    const uint16_t t = FloatToHalf(x, HalfRounding::kTowardZero);
    const double lo = HalfToFloat(t);
    const double hi = (t & 0x7FFF) == 0x7BFF ? std::copysign(65536.0, x) : HalfToFloat(t + 1);
    const double p = (x - lo) / (hi - lo);
    double sum = 0.0;
    constexpr int kN = 1 << 18;
    for (uint32_t i = 0; i < kN; ++i) {
      const uint16_t h = cpu::HalfStochastic(x, cpu::HashIndex(i, 99));
      ASSERT_TRUE(h == t || h == static_cast<uint16_t>(t + 1)) << x;
      sum += h == t ? 0.0 : 1.0;
    }
    EXPECT_NEAR(sum / kN, p, 5 * std::sqrt(p * (1 - p) / kN)) << x;
  }
}

// ---- conversions against the hardware
// ------------------------------------------------------------

__attribute__((target("f16c"))) uint16_t HwToHalf(float x, bool toward_zero) {
  const __m128 v = _mm_set_ss(x);
  const __m128i h = toward_zero ? _mm_cvtps_ph(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC)
                                : _mm_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return static_cast<uint16_t>(_mm_extract_epi16(h, 0));
}
__attribute__((target("f16c"))) uint32_t HwFromHalf(uint16_t h) {
  return cpu::FloatBits(_mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)))));
}

// CPUID leaf 1, ECX bit 29 (clang 14 knows no "f16c" for __builtin_cpu_supports).
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && ((ecx >> 29) & 1u) != 0;
}

TEST(CpuNumerics, HalfConversionsMatchF16cBitwise) {
  if (!CpuHasF16c()) GTEST_SKIP() << "no F16C on this CPU";
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    ASSERT_EQ(cpu::FloatBits(HalfToFloat(static_cast<uint16_t>(h))),
              HwFromHalf(static_cast<uint16_t>(h)))
        << std::hex << h;
  }
  Rng rng(5);
  std::vector<uint32_t> bits = {0,           0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u,
                                0x7F800001u, 0xFFA01234u, 0x477FEFFFu, 0x477FF000u, 0x477FF001u,
                                0x47800000u, 0x33000000u, 0x33000001u, 0x32FFFFFFu, 0x387FE000u,
                                0x38800000u, 0x00000001u};
  for (int i = 0; i < 2000000; ++i) {
    const uint64_t r = rng.Next();
    // Half of them with exponents in fp16's range, where the interesting rounding happens.
    uint32_t u = static_cast<uint32_t>(r);
    if (r >> 63) u = (u & 0x807FFFFFu) | (static_cast<uint32_t>(96 + (r >> 40) % 50) << 23);
    bits.push_back(u);
  }
  for (uint32_t u : bits) {
    const float x = cpu::BitsFloat(u);
    ASSERT_EQ(FloatToHalf(x, HalfRounding::kNearestEven), HwToHalf(x, false)) << std::hex << u;
    ASSERT_EQ(FloatToHalf(x, HalfRounding::kTowardZero), HwToHalf(x, true)) << std::hex << u;
  }
}

TEST(CpuNumerics, Bf16RoundsToNearestEvenAndKeepsNan) {
  EXPECT_EQ(Bf16Nearest(cpu::BitsFloat(0x3F808000u)), 0x3F80);  // tie, even stays
  EXPECT_EQ(Bf16Nearest(cpu::BitsFloat(0x3F818000u)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(Bf16Nearest(cpu::BitsFloat(0x3F808001u)), 0x3F81);
  EXPECT_EQ(Bf16Nearest(cpu::BitsFloat(0x7F7FFFFFu)), 0x7F80);  // overflow to inf
  EXPECT_EQ(Bf16Nearest(cpu::BitsFloat(0xFF800000u)), 0xFF80);
  EXPECT_EQ(Bf16Nearest(cpu::BitsFloat(0x7FFFFFFFu)), 0x7FFF);  // NaN stays NaN (no carry)
  EXPECT_EQ(Bf16Nearest(cpu::BitsFloat(0x7F800001u)), 0x7FC0);  // signalling NaN quieted
  EXPECT_EQ(cpu::Bf16Stochastic(cpu::BitsFloat(0x7FFFFFFFu), 0xFFFF), 0x7FFF);
  EXPECT_EQ(cpu::Bf16Stochastic(cpu::BitsFloat(0x3F80FFFFu), 0x0001), 0x3F81);
  EXPECT_EQ(cpu::Bf16Stochastic(cpu::BitsFloat(0x3F80FFFFu), 0x0000), 0x3F80);
}

// ---- the finite check and GradStats -------------------------------------------------------------

TEST(CpuUpdate, CheckFiniteSkipsWholeBatchAndChangesNothing) {
  for (SimdLevel level : kLevels) {
    if (!Supported(level)) continue;
    for (DType gd : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (float bad : {INFINITY, -INFINITY, NAN}) {
        SCOPED_TRACE(testing::Message() << SimdLevelName(level) << " " << Short(gd) << " " << bad);
        const Combo c{OptimizerKind::kAdamW, DType::kFloat32,      false, gd,
                      DType::kFloat32,       Rounding::kStochastic};
        auto updater = MakeUpdater(level, 3);
        Batch b(c, {5, 17, 4097, 100}, 9);
        b.t.grad[2].Set(4000, bad);
        b.t.grad[3].Set(3, bad);
        const Tensors before = b.t;
        StepOptions o = b.Options();
        o.check_finite = true;
        StepReport report;
        ASSERT_TRUE(b.Step(*updater, o, &report).ok());
        EXPECT_TRUE(report.skipped);
        EXPECT_EQ(report.nonfinite_count, 2);
        EXPECT_EQ(report.first_nonfinite_tensor, 2);
        EXPECT_EQ(FirstDiff(before, b.t), "");
      }
    }
  }
}

TEST(CpuUpdate, CheckFiniteWithFiniteGradsUpdatesAsWithout) {
  const Combo c{OptimizerKind::kAdam, DType::kFloat32,  false,
                DType::kBFloat16,     DType::kBFloat16, Rounding::kStochastic};
  auto updater = MakeUpdater(DetectSimdLevel(), 2);
  Batch a(c, kSizes, 4);
  Batch b = a;
  StepOptions checked = a.Options();
  checked.check_finite = true;
  StepReport report;
  ASSERT_TRUE(a.Step(*updater, checked, &report).ok());
  ASSERT_TRUE(b.Step(*updater, b.Options()).ok());
  EXPECT_FALSE(report.skipped);
  EXPECT_EQ(report.nonfinite_count, 0);
  EXPECT_EQ(report.first_nonfinite_tensor, -1);
  EXPECT_EQ(FirstDiff(a.t, b.t), "");
}

TEST(CpuUpdate, GradStatsSumsSquaresAndCountsNonFinite) {
  for (SimdLevel level : kLevels) {
    if (!Supported(level)) continue;
    for (DType gd : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(testing::Message() << SimdLevelName(level) << " " << Short(gd));
      const Combo c{OptimizerKind::kAdamW, DType::kFloat32,      false, gd,
                    DType::kFloat32,       Rounding::kStochastic};
      auto updater = MakeUpdater(level, 3);
      Batch b(c, kSizes, 6);
      double want = 0.0;
      for (const Buffer& g : b.t.grad)
        for (int64_t i = 0; i < g.size(); ++i) want += g.Get(i) * g.Get(i);
      std::vector<TensorUpdate> ups = b.Updates();
      double sum = -1;
      int64_t bad = -1;
      ASSERT_TRUE(updater->GradStats(ups.data(), ups.size(), &sum, &bad).ok());
      EXPECT_NEAR(sum, want, 1e-12 * want);
      EXPECT_EQ(bad, 0);
      b.t.grad[4].Set(12345, NAN);
      b.t.grad[2].Set(16, INFINITY);
      ASSERT_TRUE(updater->GradStats(ups.data(), ups.size(), &sum, &bad).ok());
      EXPECT_EQ(bad, 2);
      EXPECT_TRUE(std::isnan(sum));
    }
  }
}

// ---- validation ---------------------------------------------------------------------------------

struct BadCase {
  const char* name;
  std::function<void(std::vector<TensorUpdate>&, HyperParams&, StepOptions&)> mutate;
  StatusCode code;
  const char* message_part;
};

TEST(CpuUpdate, InvalidInputIsRejectedNamingTheTensorAndChangesNothing) {
  using V = std::vector<TensorUpdate>;
  const BadCase cases[] = {
      {"null param", [](V& u, HyperParams&, StepOptions&) { u[1].param = nullptr; },
       StatusCode::kInvalidArgument, "tensors[1].param"},
      {"null grad", [](V& u, HyperParams&, StepOptions&) { u[1].grad = nullptr; },
       StatusCode::kInvalidArgument, "tensors[1].grad"},
      {"null exp_avg", [](V& u, HyperParams&, StepOptions&) { u[1].exp_avg = nullptr; },
       StatusCode::kInvalidArgument, "tensors[1].exp_avg"},
      {"null exp_avg_sq", [](V& u, HyperParams&, StepOptions&) { u[1].exp_avg_sq = nullptr; },
       StatusCode::kInvalidArgument, "tensors[1].exp_avg_sq"},
      {"negative numel", [](V& u, HyperParams&, StepOptions&) { u[1].numel = -1; },
       StatusCode::kInvalidArgument, "tensors[1].numel"},
      {"step 0", [](V& u, HyperParams&, StepOptions&) { u[1].step = 0; },
       StatusCode::kInvalidArgument, "tensors[1].step"},
      {"null hyper", [](V& u, HyperParams&, StepOptions&) { u[1].hyper = nullptr; },
       StatusCode::kInvalidArgument, "tensors[1].hyper"},
      {"negative lr", [](V&, HyperParams& h, StepOptions&) { h.lr = -1e-3f; },
       StatusCode::kInvalidArgument, "tensors[1].hyper->lr"},
      {"nan lr", [](V&, HyperParams& h, StepOptions&) { h.lr = NAN; }, StatusCode::kInvalidArgument,
       "tensors[1].hyper->lr"},
      {"beta1 = 1", [](V&, HyperParams& h, StepOptions&) { h.beta1 = 1.0f; },
       StatusCode::kInvalidArgument, "tensors[1].hyper->beta1"},
      {"beta2 = 1", [](V&, HyperParams& h, StepOptions&) { h.beta2 = 1.0f; },
       StatusCode::kInvalidArgument, "tensors[1].hyper->beta2"},
      {"beta1 < 0", [](V&, HyperParams& h, StepOptions&) { h.beta1 = -0.1f; },
       StatusCode::kInvalidArgument, "tensors[1].hyper->beta1"},
      {"eps = 0", [](V&, HyperParams& h, StepOptions&) { h.eps = 0.0f; },
       StatusCode::kInvalidArgument, "tensors[1].hyper->eps"},
      {"negative weight_decay", [](V&, HyperParams& h, StepOptions&) { h.weight_decay = -1.0f; },
       StatusCode::kInvalidArgument, "tensors[1].hyper->weight_decay"},
      {"fp16 state", [](V& u, HyperParams&, StepOptions&) { u[1].state_dtype = DType::kFloat16; },
       StatusCode::kUnsupported, "tensors[1].state_dtype"},
      {"bad dtype",
       [](V& u, HyperParams&, StepOptions&) { u[1].grad_dtype = static_cast<DType>(9); },
       StatusCode::kInvalidArgument, "tensors[1]"},
      {"master with fp32 param",
       [](V& u, HyperParams&, StepOptions&) { u[1].master = static_cast<float*>(u[0].param); },
       StatusCode::kInvalidArgument, "tensors[1].master"},
      {"bf16 param without master, nearest",
       [](V& u, HyperParams&, StepOptions& o) {
         u[1].param_dtype = DType::kBFloat16;
         o.rounding = Rounding::kNearest;
       },
       StatusCode::kInvalidArgument, "tensors[1].param"},
      {"infinite grad_multiplier",
       [](V&, HyperParams&, StepOptions& o) { o.grad_multiplier = INFINITY; },
       StatusCode::kInvalidArgument, "grad_multiplier"},
      {"bad optimizer",
       [](V&, HyperParams&, StepOptions& o) { o.optimizer = static_cast<OptimizerKind>(7); },
       StatusCode::kInvalidArgument, "optimizer"},
  };
  const Combo c{OptimizerKind::kAdamW, DType::kFloat32, false,
                DType::kFloat32,       DType::kFloat32, Rounding::kStochastic};
  auto updater = MakeUpdater(DetectSimdLevel(), 2);
  for (const BadCase& bc : cases) {
    for (bool check_finite : {false, true}) {
      SCOPED_TRACE(testing::Message() << bc.name << (check_finite ? " (check_finite)" : ""));
      Batch b(c, {100, 200, 300}, 8);
      const Tensors before = b.t;
      HyperParams own = b.hyper[1];
      std::vector<TensorUpdate> ups = b.Updates();
      ups[1].hyper = &own;
      StepOptions o = b.Options();
      o.check_finite = check_finite;
      bc.mutate(ups, own, o);
      const Status v = updater->Validate(ups.data(), ups.size(), o);
      EXPECT_EQ(v.code(), bc.code) << v.ToString();
      StepReport report;
      report.skipped = true;
      const Status s = updater->Step(ups.data(), ups.size(), o, &report);
      EXPECT_EQ(s.message(), v.message());
      EXPECT_EQ(s.code(), bc.code) << s.ToString();
      EXPECT_NE(s.message().find(bc.message_part), std::string::npos) << s.message();
      EXPECT_FALSE(report.skipped);
      EXPECT_EQ(FirstDiff(before, b.t), "");
    }
  }
  Batch good(c, {100, 200}, 8);
  std::vector<TensorUpdate> good_ups = good.Updates();
  EXPECT_TRUE(updater->Validate(good_ups.data(), good_ups.size(), good.Options()).ok());
  const Status s = updater->Step(nullptr, 2, StepOptions{});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("tensors is null"), std::string::npos) << s.message();
}

TEST(CpuUpdate, GradStatsRejectsBadTensors) {
  auto updater = MakeUpdater(SimdLevel::kScalar, 1);
  std::vector<TensorUpdate> ups(2);
  ups[1].numel = 5;
  double sum = 0;
  const Status s = updater->GradStats(ups.data(), ups.size(), &sum, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("tensors[1].grad"), std::string::npos) << s.message();
  ups[1].numel = -2;
  EXPECT_EQ(updater->GradStats(ups.data(), ups.size(), &sum, nullptr).code(),
            StatusCode::kInvalidArgument);
}

TEST(CpuUpdate, ZeroSizeTensorsAreFine) {
  const Combo c{OptimizerKind::kAdamW, DType::kFloat32,  false,
                DType::kFloat32,       DType::kBFloat16, Rounding::kStochastic};
  auto updater = MakeUpdater(DetectSimdLevel(), 3);
  Batch with(c, {0, 100, 0, 0, 4097, 0}, 10);
  Batch without(c, {100, 4097}, 10);
  // Same data in both: copy the non-empty tensors across.
  without.t.param = {with.t.param[1], with.t.param[4]};
  without.t.grad = {with.t.grad[1], with.t.grad[4]};
  without.t.m = {with.t.m[1], with.t.m[4]};
  without.t.v = {with.t.v[1], with.t.v[4]};
  without.t.master = {with.t.master[1], with.t.master[4]};
  without.steps = {with.steps[1], with.steps[4]};
  without.hyper = {with.hyper[1], with.hyper[0]};  // tensor k takes hyper[k % 2]
  std::vector<TensorUpdate> ups = with.Updates();
  for (TensorUpdate& u : ups) {
    if (u.numel == 0) u.param = u.exp_avg = u.exp_avg_sq = nullptr, u.grad = nullptr;
  }
  StepOptions o = with.Options();
  o.check_finite = true;
  ASSERT_TRUE(updater->Step(ups.data(), ups.size(), o).ok());
  ASSERT_TRUE(without.Step(*updater, without.Options()).ok());
  EXPECT_EQ(with.t.param[1].FirstDiff(without.t.param[0]), -1);
  EXPECT_EQ(with.t.param[4].FirstDiff(without.t.param[1]), -1);
  EXPECT_EQ(with.t.v[4].FirstDiff(without.t.v[1]), -1);
  // Only empty tensors, and no tensors at all.
  std::vector<TensorUpdate> empty(3);
  for (TensorUpdate& u : empty) u.hyper = &with.hyper[0];
  EXPECT_TRUE(updater->Step(empty.data(), empty.size(), o).ok());
  EXPECT_TRUE(updater->Step(nullptr, 0, o).ok());
}

// ---- creation and allocation
// ----------------------------------------------------------------------

TEST(CpuUpdate, CreateHonoursOptions) {
  for (SimdLevel level : kLevels) {
    CpuUpdaterOptions o;
    o.max_simd = level;
    o.threads = 3;
    auto r = CpuUpdater::Create(o);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r.value()->simd(), std::min(level, DetectSimdLevel()));
    EXPECT_EQ(r.value()->threads(), 3);
  }
  CpuUpdaterOptions bad;
  bad.threads = -1;
  EXPECT_EQ(CpuUpdater::Create(bad).status().code(), StatusCode::kInvalidArgument);
  bad.threads = 100000;
  EXPECT_EQ(CpuUpdater::Create(bad).status().code(), StatusCode::kInvalidArgument);
  bad.threads = 1;
  bad.max_simd = static_cast<SimdLevel>(5);
  EXPECT_EQ(CpuUpdater::Create(bad).status().code(), StatusCode::kInvalidArgument);
}

TEST(CpuUpdate, StepAndGradStatsDoNotAllocate) {
  const Combo c{OptimizerKind::kAdamW, DType::kBFloat16, true,
                DType::kBFloat16,      DType::kBFloat16, Rounding::kStochastic};
  for (SimdLevel level : kLevels) {
    if (!Supported(level)) continue;
    auto updater = MakeUpdater(level, 3);
    Batch b(c, {17, 4097, 100000}, 12);
    std::vector<TensorUpdate> ups = b.Updates();
    StepOptions o = b.Options();
    o.check_finite = true;
    double sum = 0;
    int64_t bad = 0;
    ASSERT_TRUE(updater->Step(ups.data(), ups.size(), o).ok());  // warm up
    g_allocations = 0;
    g_count_allocations = true;
    for (int i = 0; i < 20; ++i) {
      (void)updater->Step(ups.data(), ups.size(), o);
      (void)updater->GradStats(ups.data(), ups.size(), &sum, &bad);
    }
    g_count_allocations = false;
    EXPECT_EQ(g_allocations.load(), 0) << SimdLevelName(level);
  }
}

}  // namespace
}  // namespace emsa
