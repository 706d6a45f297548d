// emsa/update.h — the optimizer arithmetic's inputs, shared by the CPU and CUDA paths.
//
// One update touches one tensor: its parameter, gradient and state, each a raw pointer owned by
// the caller (or a view into an emsa arena). The math follows torch.optim exactly:
//   AdamW: p *= 1 - lr*wd; m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g*g;
//          p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
//   Adam:  g += wd*p (L2 decay), then as AdamW without the decoupled decay
//   Lion:  c = lerp(m, g, 1-b1); p *= 1 - lr*wd; p -= lr*sign(c); m = lerp(m, g, 1-b2)
// Before any of that the gradient is multiplied by grad_multiplier (= clip_coef / loss_scale).
#pragma once

#include <cstdint>
#include <string_view>

#include "emsa/status.h"
#include "emsa/types.h"

namespace emsa {

// Doubles, as torch passes them: per-step constants such as 1 - beta2 and lr / (1 - beta1^t)
// are computed in double and rounded to float once (1 - 0.999f would be 1.3e-5 off torch's).
struct HyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool maximize = false;  // ascend instead of descend, as torch's maximize=True
};

// Rounding of values stored in bf16/fp16 (states, and params without a master copy).
enum class Rounding : int32_t {
  kNearest = 0,     // round to nearest even
  kStochastic = 1,  // unbiased; deterministic from (seed, step, element index)
};

struct TensorUpdate {
  void* param = nullptr;  // numel elements of param_dtype; updated in place
  // numel elements of grad_dtype. CPU only (CpuUpdater): may be param itself when both have the
  // same dtype (each element is read before it is written): a 16-bit parameter with a master
  // is then rounded over its gradient, which the host tier's upload reads.
  const void* grad = nullptr;
  void* exp_avg = nullptr;     // numel elements of state_dtype
  void* exp_avg_sq = nullptr;  // numel elements of state_dtype; unused (may be null) for Lion
  float* master = nullptr;     // numel fp32 master weights, or null (then param is the master;
                               // param must be fp32 unless rounding is stochastic)
  int64_t numel = 0;
  DType param_dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  DType state_dtype = DType::kFloat32;
  int64_t step = 1;                    // this update's step number, >= 1 (bias correction)
  const HyperParams* hyper = nullptr;  // per-tensor (param group) hyperparameters
  // CPU only (CpuUpdater), AdamW and Lion, fp32 param without master: when set, param is
  // neither read nor written (it may be null); the update writes numel fp32 values here
  // instead, the change after weight decay, so that the parameter's new value is
  // p * (1 - lr * wd) + delta, each operation rounded on its own (no FMA), bitwise what the
  // update would have stored in param. May be grad itself when grad is fp32 (each element is
  // read before it is written). The host tier uses it to apply the update where the parameter
  // lives, so the host neither reads nor writes the parameter.
  float* delta = nullptr;
};

struct StepOptions {
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  float grad_multiplier = 1.0f;  // clip_coef / loss_scale, applied to every gradient element
  bool check_finite = false;     // scan gradients first; any inf/nan skips the whole update
  Rounding rounding = Rounding::kStochastic;
  uint64_t seed = 0;  // stochastic rounding stream
};

// The rules every path (CPU, CUDA, planner, C ABI) applies, defined once (src/common/update.cc)
// so that input valid on one tier is valid on every other.
//
// `optimizer` is one of the OptimizerKind values; else kInvalidArgument naming `where` (the
// field, e.g. "options.optimizer") and the values to use.
Status ValidateOptimizer(OptimizerKind optimizer, std::string_view where);
// Every value finite; lr >= 0; weight_decay >= 0; 0 <= beta1, beta2 < 1; eps > 0 where the
// optimizer reads it (Adam and AdamW; Lion has no eps). torch.optim accepts eps == 0, emsa does
// not: eps == 0 divides by zero wherever a moment is zero. kInvalidArgument otherwise, the
// message naming the field as `where` followed by its name (where = "hypers[1]." gives
// "hypers[1].eps is 0; ..."). A caller that does not know the optimizer (DeviceScalars, whose
// groups any table may use) passes kAdamW, the strictest rule; a Lion group keeps the default
// eps there.
Status ValidateHyperParams(const HyperParams& hyper, OptimizerKind optimizer,
                           std::string_view where);

struct StepReport {
  bool skipped = false;         // true: a non-finite gradient was found, nothing was written
  int64_t nonfinite_count = 0;  // gradient elements that were inf or nan (when checked)
  int64_t first_nonfinite_tensor = -1;  // index in the batch of the first offending tensor
};

}  // namespace emsa
