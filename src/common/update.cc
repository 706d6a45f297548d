// update.cc — the validation rules of emsa/update.h, shared by every path that updates.
#include "emsa/update.h"

#include <cmath>
#include <cstdio>
#include <string>

namespace emsa {
namespace {

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

Status Invalid(std::string_view where, const char* field, double value, const char* rule) {
  return Status::InvalidArgument(std::string(where) + field + " is " + Num(value) + "; " + rule);
}

}  // namespace

Status ValidateOptimizer(OptimizerKind optimizer, std::string_view where) {
  if (optimizer == OptimizerKind::kAdamW || optimizer == OptimizerKind::kAdam ||
      optimizer == OptimizerKind::kLion) {
    return Status::Ok();
  }
  return Status::InvalidArgument(std::string(where) + " is " +
                                 std::to_string(static_cast<int32_t>(optimizer)) +
                                 "; use adamw (0), adam (1) or lion (2)");
}

Status ValidateHyperParams(const HyperParams& h, OptimizerKind optimizer, std::string_view where) {
  if (!(std::isfinite(h.lr) && h.lr >= 0.0)) {
    return Invalid(where, "lr", h.lr, "it must be finite and >= 0");
  }
  if (!(h.beta1 >= 0.0 && h.beta1 < 1.0)) {
    return Invalid(where, "beta1", h.beta1, "it must be in [0, 1)");
  }
  if (!(h.beta2 >= 0.0 && h.beta2 < 1.0)) {
    return Invalid(where, "beta2", h.beta2, "it must be in [0, 1)");
  }
  if (!(std::isfinite(h.weight_decay) && h.weight_decay >= 0.0)) {
    return Invalid(where, "weight_decay", h.weight_decay, "it must be finite and >= 0");
  }
  if (optimizer != OptimizerKind::kLion && !(std::isfinite(h.eps) && h.eps > 0.0)) {
    return Invalid(where, "eps", h.eps, "it must be finite and > 0 (Lion ignores it)");
  }
  return Status::Ok();
}

}  // namespace emsa
