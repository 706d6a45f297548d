// step_verdict.h — the verdict of a gated step, defined once for the CPU updater and the CUDA
// step header (kernels/cuda/step_scalars.cu): from the sum of squares and the non-finite count
// of every gradient of the step, whether it is skipped, its norm, its clip coefficient and the
// multiplier every gradient element gets.
//
// The rule (emsa/update.h, StepGate):
//   - unscale = 1 / loss_scale as torch's GradScaler computes it (the reciprocal in double,
//     rounded to float); a scale it would never hold (not finite, <= 0, or a reciprocal that
//     overflows) gives NaN, which skips the step;
//   - any non-finite gradient element, a non-finite sum or a non-finite unscale skips the step
//     (nothing is written). Clipping cannot be applied to such a step: torch's
//     clip_grad_norm_ would multiply every gradient by NaN;
//   - norm = sqrt(sum_sq) * |unscale| in double; the reported norm is that value rounded to
//     float, as torch reports a float32 norm;
//   - clip_coef = max_norm / (norm + 1e-6), clamped to 1, computed in double and rounded once
//     (torch.nn.utils.clip_grad_norm_'s formula); 1 when max_norm is 0;
//   - grad_multiplier = unscale * clip_coef, in double, rounded once.
// Plain double arithmetic, valid as host and device code (EMSA_HD): both paths give the same
// bits for the same inputs.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/host_device.h"

namespace emsa {
namespace verdict {

// The decision's outputs, in the order the CUDA step header keeps them.
struct Decision {
  bool skip;
  double grad_norm;  // unscaled, rounded to float (of the sum as scanned, also when skipped)
  float clip_coef;   // 1 when not clipped or skipped
  float grad_multiplier;
};

// torch.amp.GradScaler's unscale: scale.double().reciprocal().float(); NaN where no valid
// scale gives one.
EMSA_HD float UnscaleOf(float scale) {
  if (!(scale > 0.0f) || !std::isfinite(scale)) return NAN;
  const float r = static_cast<float>(1.0 / static_cast<double>(scale));
  return std::isfinite(r) ? r : NAN;
}

// max_norm <= 0 (or not finite): no clipping.
EMSA_HD Decision Decide(double sum_sq, int64_t nonfinite, float grad_unscale, float max_norm) {
  Decision d{false, 0.0, 1.0f, grad_unscale};
  const double unscale = static_cast<double>(grad_unscale);
  const double norm = std::sqrt(sum_sq) * std::fabs(unscale);
  d.grad_norm = static_cast<double>(static_cast<float>(norm));
  if (nonfinite > 0 || !std::isfinite(sum_sq) || !std::isfinite(unscale)) {
    d.skip = true;
    return d;
  }
  if (max_norm > 0.0f && std::isfinite(max_norm)) {
    const double c = static_cast<double>(max_norm) / (norm + 1e-6);
    if (c < 1.0) d.clip_coef = static_cast<float>(c);
  }
  d.grad_multiplier = static_cast<float>(unscale * static_cast<double>(d.clip_coef));
  return d;
}

}  // namespace verdict
}  // namespace emsa
