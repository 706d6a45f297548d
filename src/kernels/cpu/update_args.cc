// update_args.cc — one tensor's per-step constants, resolved as torch.optim resolves them.
//
// torch computes bias corrections and the like in Python floats (double) and hands each to the
// fp32 kernel as one float scalar; so do we: double arithmetic, one rounding at the end.
#include <cmath>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/numerics.h"

namespace emsa {
namespace cpu {
namespace {

// torch.lerp's weight is the float scalar w, its other form uses 1 - w computed in float.
LerpConst MakeLerp(double beta) {
  const float w = static_cast<float>(1.0 - beta);
  LerpConst lerp;
  lerp.from_end = !(std::fabs(w) < 0.5f);
  lerp.coef = lerp.from_end ? -(1.0f - w) : w;
  return lerp;
}

}  // namespace

UpdateArgs MakeUpdateArgs(const TensorUpdate& t, const StepOptions& options) {
  const HyperParams& h = *t.hyper;
  const double lr = h.lr, wd = h.weight_decay;
  const double beta1 = h.beta1, beta2 = h.beta2;
  const double step = static_cast<double>(t.step);

  UpdateArgs a;
  a.param = t.param;
  a.grad = t.grad;
  a.exp_avg = t.exp_avg;
  a.exp_avg_sq = t.exp_avg_sq;
  a.master = t.master;
  a.delta = t.delta;
  a.grad_dtype = t.grad_dtype;
  a.stochastic = options.rounding == Rounding::kStochastic;
  a.grad_scale = h.maximize ? -options.grad_multiplier : options.grad_multiplier;
  a.lerp1 = MakeLerp(h.beta1);
  a.seed = options.seed;
  a.step = t.step;
  if (options.optimizer == OptimizerKind::kLion) {
    a.decay = static_cast<float>(1.0 - lr * wd);
    a.lerp2 = MakeLerp(h.beta2);
    a.neg_step_size = static_cast<float>(-lr);
  } else {
    a.decay = static_cast<float>(options.optimizer == OptimizerKind::kAdam ? wd : 1.0 - lr * wd);
    a.beta2 = static_cast<float>(beta2);
    a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    a.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
    a.eps = static_cast<float>(h.eps);
    a.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, step))));
  }
  SetIndexHigh(&a, 0);
  return a;
}

void SetIndexHigh(UpdateArgs* a, uint32_t index_high) {
  a->state_key = StreamKey(a->seed, a->step, kStateStream, index_high);
  a->param_key = StreamKey(a->seed, a->step, kParamStream, index_high);
}

const KernelTable& KernelsFor(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512:
      return Avx512Kernels();
    case SimdLevel::kAvx2:
      return Avx2Kernels();
    default:
      return ScalarKernels();
  }
}

}  // namespace cpu
}  // namespace emsa
