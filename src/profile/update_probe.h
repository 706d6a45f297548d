// update_probe.h — the tensor both host-update measurements of the profile time (cpu_profile.cc
// alone, gpu_profile.cc with copies running): n fp32 parameters, their gradients and two moments
// in four consecutive arrays of `data`, 28 bytes moved per parameter, rounding to nearest.
#pragma once

#include <cstdint>

#include "emsa/update.h"

namespace emsa::profile_internal {

inline TensorUpdate FourArrayUpdate(float* data, int64_t n, const HyperParams* hyper) {
  TensorUpdate t;
  t.param = data;
  t.grad = data + n;
  t.exp_avg = data + 2 * n;
  t.exp_avg_sq = data + 3 * n;
  t.numel = n;
  t.hyper = hyper;
  return t;
}

inline StepOptions NearestRounding() {
  StepOptions step;
  step.rounding = Rounding::kNearest;
  return step;
}

}  // namespace emsa::profile_internal
