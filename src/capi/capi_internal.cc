// capi_internal.cc — the C ABI's shared plumbing: the last error, string returns and the
// converters from the C structs to the core's (see capi_internal.h).
#include "capi/capi_internal.h"

namespace emsa::capi {

namespace {

thread_local std::string g_last_error;

// Keeping the message may itself run out of memory; then a short one that needs no allocation
// (the string's capacity already holds it) stands in, so these never throw.
void SetLastError(const std::string& message) noexcept {
  try {
    g_last_error = message;
  } catch (...) {
    g_last_error = "out of memory";
  }
}

}  // namespace

emsa_status Report(const emsa::Status& status) noexcept {
  if (status.ok()) {
    g_last_error.clear();
  } else {
    SetLastError(status.message());
  }
  return static_cast<emsa_status>(status.code());
}

emsa_status Fail(emsa_status code, const std::string& message) noexcept {
  SetLastError(message);
  return code;
}

// For a literal message: no std::string is built at the call, so unguarded entries stay safe.
emsa_status Fail(emsa_status code, const char* message) noexcept {
  try {
    g_last_error = message;
  } catch (...) {
    g_last_error = "out of memory";
  }
  return code;
}

const char* LastError() noexcept { return g_last_error.c_str(); }

char* CopyString(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

emsa_status ReturnString(const std::string& s, char** out) {
  if (out == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "output pointer is NULL");
  char* copy = CopyString(s);
  if (copy == nullptr) return Fail(EMSA_OUT_OF_MEMORY, "cannot allocate the returned string");
  *out = copy;
  return Report(emsa::Status::Ok());
}

emsa::Result<emsa::DType> ToDType(int32_t v, const char* field) {
  if (v < EMSA_DTYPE_FLOAT32 || v > EMSA_DTYPE_FLOAT16) {
    return emsa::Status::InvalidArgument(std::string(field) + " = " + std::to_string(v) +
                                         " is not an EMSA_DTYPE_* value");
  }
  return static_cast<emsa::DType>(v);
}

emsa::Result<emsa::OptimizerKind> ToOptimizer(int32_t v) {
  const auto kind = static_cast<emsa::OptimizerKind>(v);  // any int32: the enum's type
  EMSA_RETURN_IF_ERROR(emsa::ValidateOptimizer(kind, "optimizer (EMSA_OPTIMIZER_*)"));
  return kind;
}

emsa::Status ToHyper(const emsa_hyperparams* h, const std::string& where, emsa::HyperParams* out) {
  if (h->struct_size != sizeof(emsa_hyperparams)) {
    return emsa::Status::InvalidArgument(
        where + "->struct_size mismatch; call emsa_hyperparams_init() first");
  }
  *out = emsa::HyperParams{};
  CopyFields(*h, out);
  return emsa::Status::Ok();
}

bool IsRounding(int32_t v) { return v == EMSA_ROUNDING_NEAREST || v == EMSA_ROUNDING_STOCHASTIC; }

bool IsFlag(int32_t v) { return v == 0 || v == 1; }

emsa::Result<emsa::StepOptions> ToStepOptions(const emsa_step_options* o) {
  emsa::StepOptions out;
  if (o == nullptr) return out;
  if (o->struct_size != sizeof(emsa_step_options)) {
    return emsa::Status::InvalidArgument(
        "emsa_step_options.struct_size mismatch; call emsa_step_options_init() first");
  }
  EMSA_RETURN_IF_ERROR(ToOptimizer(o->optimizer).status());
  if (!IsRounding(o->rounding)) {
    return emsa::Status::InvalidArgument("rounding must be EMSA_ROUNDING_NEAREST or _STOCHASTIC");
  }
  CopyFields(*o, &out);
  return out;
}

emsa::Status ConvertTensor(const emsa_tensor_update& t, size_t index, bool need_hyper,
                           emsa::TensorUpdate* u, emsa::HyperParams* hyper) {
  const std::string where = "tensors[" + std::to_string(index) + "]";
  if (t.struct_size != sizeof(emsa_tensor_update)) {
    return emsa::Status::InvalidArgument(
        where + ".struct_size mismatch; call emsa_tensor_update_init() first");
  }
  if (need_hyper) {
    if (t.hyper == nullptr) return emsa::Status::InvalidArgument(where + ".hyper is NULL");
    EMSA_RETURN_IF_ERROR(ToHyper(t.hyper, where + ".hyper", hyper));
    u->hyper = hyper;
  }
  u->param = t.param;
  u->grad = t.grad;
  u->exp_avg = t.exp_avg;
  u->exp_avg_sq = t.exp_avg_sq;
  u->master = t.master;
  u->numel = t.numel;
  u->step = t.step;
  EMSA_ASSIGN_OR_RETURN(u->param_dtype, ToDType(t.param_dtype, (where + ".param_dtype").c_str()));
  EMSA_ASSIGN_OR_RETURN(u->grad_dtype, ToDType(t.grad_dtype, (where + ".grad_dtype").c_str()));
  EMSA_ASSIGN_OR_RETURN(u->state_dtype, ToDType(t.state_dtype, (where + ".state_dtype").c_str()));
  return emsa::Status::Ok();
}

emsa::Status ConvertChunk(const emsa_tensor_update* in, size_t base, size_t n,
                          emsa::TensorUpdate* out, emsa::HyperParams* hyper) {
  for (size_t i = 0; i < n; ++i) {
    EMSA_RETURN_IF_ERROR(ConvertTensor(in[i], base + i, true, &out[i], &hyper[i]));
  }
  return emsa::Status::Ok();
}

// Shape and dtype of a DLPack export from the C arguments.
emsa::Status ExportArgs(const int64_t* shape, int32_t ndim, int32_t dtype,
                        std::vector<int64_t>* dims, emsa::DType* type) {
  if (ndim < 0) {
    return emsa::Status::InvalidArgument("ndim is " + std::to_string(ndim) + "; it must be >= 0");
  }
  if (ndim > 0 && shape == nullptr) {
    return emsa::Status::InvalidArgument("shape is NULL but ndim is " + std::to_string(ndim));
  }
  EMSA_ASSIGN_OR_RETURN(*type, ToDType(dtype, "dtype"));
  dims->assign(shape, shape + ndim);
  return emsa::Status::Ok();
}

}  // namespace emsa::capi
