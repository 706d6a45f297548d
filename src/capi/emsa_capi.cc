// emsa_capi.cc — the only extern "C" translation unit: wraps the C++ core for include/emsa/emsa.h.
//
// Every entry point catches nothing because the core throws nothing; what can throw here is
// std::bad_alloc from building strings, which we turn into EMSA_OUT_OF_MEMORY at the boundary.
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "emsa/cpu_update.h"
#include "emsa/cuda_update.h"
#include "emsa/device_arena.h"
#include "emsa/emsa.h"
#include "emsa/host_arena.h"
#include "emsa/host_tier.h"
#include "emsa/model_config.h"
#include "emsa/plan.h"
#include "emsa/probe_record.h"
#include "emsa/profile.h"
#include "emsa/types.h"
#include "memory/dlpack_export.h"
#include "tools/cli.h"

struct emsa_plan {
  emsa::Plan plan;
};
struct emsa_host_arena {
  std::shared_ptr<emsa::HostArena> arena;  // shared with the DLPack exports of its views
};
struct emsa_device_arena {
  std::shared_ptr<emsa::DeviceArena> arena;
};
struct emsa_cpu_updater {
  std::unique_ptr<emsa::CpuUpdater> updater;
};
struct emsa_host_load {
  std::unique_ptr<emsa::HostLoad> load;
};
struct emsa_device_scalars {
  std::unique_ptr<emsa::DeviceScalars> scalars;
};
struct emsa_device_table {
  std::unique_ptr<emsa::DeviceUpdateTable> table;
};
struct emsa_host_tier {
  std::unique_ptr<emsa::HostTier> tier;
  std::vector<emsa::HyperParams> hypers;  // one per group: begin_step converts into it in place
};

// The C header mirrors the device layout byte for byte.
static_assert(sizeof(emsa_device_step_header) == sizeof(emsa::DeviceStepHeader),
              "emsa_device_step_header must mirror emsa::DeviceStepHeader");
#define EMSA_SAME_OFFSET(field)                                                            \
  static_assert(                                                                           \
      offsetof(emsa_device_step_header, field) == offsetof(emsa::DeviceStepHeader, field), \
      "emsa_device_step_header." #field " must sit where the device has it")
EMSA_SAME_OFFSET(grad_multiplier);
EMSA_SAME_OFFSET(found_inf);
EMSA_SAME_OFFSET(grad_unscale);
EMSA_SAME_OFFSET(max_norm);
EMSA_SAME_OFFSET(seed);
EMSA_SAME_OFFSET(sum_sq);
EMSA_SAME_OFFSET(nonfinite_count);
EMSA_SAME_OFFSET(grad_norm);
EMSA_SAME_OFFSET(clip_coef);
#undef EMSA_SAME_OFFSET

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

// Wraps a body so an allocation failure becomes a status instead of crossing the C boundary.
template <typename Fn>
emsa_status Guard(Fn&& fn) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return Fail(EMSA_OUT_OF_MEMORY, "out of host memory inside emsa");
  } catch (...) {
    return Fail(EMSA_INTERNAL, "unexpected exception inside emsa; please report it");
  }
}

// A guarded call on a handle: NULL is EMSA_INVALID_ARGUMENT naming it; otherwise the Status
// fn(*handle) returns.
template <typename Handle, typename Fn>
emsa_status OnHandle(Handle* handle, const char* name, Fn&& fn) {
  return Guard([&] {
    if (handle == nullptr) return Fail(EMSA_INVALID_ARGUMENT, std::string(name) + " is NULL");
    return Report(fn(*handle));
  });
}

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

// A versioned struct from the caller: struct_size must be one this library knows.
template <typename T>
emsa_status CheckSize(const T* s, const char* type, const char* init) {
  if (s == nullptr) return Fail(EMSA_INVALID_ARGUMENT, std::string(type) + " pointer is NULL");
  if (s->struct_size != sizeof(T)) {
    return Fail(EMSA_INVALID_ARGUMENT,
                std::string(type) + ".struct_size is " + std::to_string(s->struct_size) +
                    ", this library expects " + std::to_string(sizeof(T)) + "; call " + init +
                    "() first, and use the emsa.h that matches the library");
  }
  return EMSA_OK;
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
  *out = emsa::HyperParams{h->lr, h->beta1, h->beta2, h->eps, h->weight_decay, h->maximize != 0};
  return emsa::Status::Ok();
}

emsa::Result<emsa::StepOptions> ToStepOptions(const emsa_step_options* o) {
  emsa::StepOptions out;
  if (o == nullptr) return out;
  if (o->struct_size != sizeof(emsa_step_options)) {
    return emsa::Status::InvalidArgument(
        "emsa_step_options.struct_size mismatch; call emsa_step_options_init() first");
  }
  EMSA_ASSIGN_OR_RETURN(out.optimizer, ToOptimizer(o->optimizer));
  out.grad_multiplier = o->grad_multiplier;
  out.check_finite = o->check_finite != 0;
  if (o->rounding != EMSA_ROUNDING_NEAREST && o->rounding != EMSA_ROUNDING_STOCHASTIC) {
    return emsa::Status::InvalidArgument("rounding must be EMSA_ROUNDING_NEAREST or _STOCHASTIC");
  }
  out.rounding = static_cast<emsa::Rounding>(o->rounding);
  out.seed = o->seed;
  return out;
}

// The C tensors are converted in fixed-size chunks on the stack: no heap allocation per step,
// whatever the tensor count.
constexpr size_t kChunk = 64;

// One C tensor to the core's form. With need_hyper, .hyper must be valid and is copied into
// *hyper (the device tier reads hyperparameters from its scalars instead and passes false).
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

// Calls fn(updates, n, base) for each chunk of converted tensors.
template <typename Fn>
emsa::Status ForEachChunk(const emsa_tensor_update* tensors, size_t count, Fn&& fn) {
  emsa::TensorUpdate updates[kChunk];
  emsa::HyperParams hyper[kChunk];
  for (size_t base = 0; base < count; base += kChunk) {
    size_t n = count - base < kChunk ? count - base : kChunk;
    EMSA_RETURN_IF_ERROR(ConvertChunk(tensors + base, base, n, updates, hyper));
    EMSA_RETURN_IF_ERROR(fn(updates, n, base));
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

// One view of a host or device arena (either handle holds a shared_ptr `arena`) as DLPack.
template <typename Handle>
emsa_status ExportArenaView(const Handle* handle, uint64_t offset, const int64_t* shape,
                            int32_t ndim, int32_t dtype, void** dlmanaged_out) {
  return Guard([&] {
    if (handle == nullptr || dlmanaged_out == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "arena and dlmanaged_out must not be NULL");
    }
    std::vector<int64_t> dims;
    emsa::DType type;
    emsa::Status st = ExportArgs(shape, ndim, dtype, &dims, &type);
    if (!st.ok()) return Report(st);
    emsa::Result<DLManagedTensor*> exported = emsa::ExportView(handle->arena, offset, dims, type);
    if (!exported.ok()) return Report(exported.status());
    *dlmanaged_out = *exported;
    return Report(emsa::Status::Ok());
  });
}

}  // namespace

extern "C" {

// ---- library
// -------------------------------------------------------------------------------------

uint32_t emsa_abi_version(void) { return EMSA_ABI_VERSION; }
const char* emsa_version(void) { return "0.1.0"; }
const char* emsa_last_error(void) { return g_last_error.c_str(); }
void emsa_free(void* p) { std::free(p); }

emsa_status emsa_parse_bytes(const char* text, uint64_t* bytes_out) {
  return Guard([&] {
    if (text == nullptr || bytes_out == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "text and bytes_out must not be NULL");
    }
    auto r = emsa::ParseBytes(text);
    if (!r.ok()) return Report(r.status());
    *bytes_out = *r;
    return Report(emsa::Status::Ok());
  });
}

// ---- profile
// -------------------------------------------------------------------------------------

int32_t emsa_simd_level(void) { return static_cast<int32_t>(emsa::DetectSimdLevel()); }

emsa_status emsa_profile_measure(int32_t measure_bandwidth, int32_t gpu_device, char** json_out) {
  return Guard([&] {
    if (json_out == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "json_out is NULL");
    emsa::ProfileOptions options;
    options.measure_bandwidth = measure_bandwidth != 0;
    options.gpu_device = gpu_device;
    auto profile = emsa::MeasureDeviceProfile(options);
    if (!profile.ok()) return Report(profile.status());
    return ReturnString(emsa::DeviceProfileToJson(*profile), json_out);
  });
}

emsa_status emsa_host_load_start(int32_t threads, int64_t update_params, int32_t gpu_device,
                                 int32_t copies, uint64_t copy_bytes, emsa_host_load** load_out) {
  return Guard([&] {
    if (load_out == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "load_out is NULL");
    emsa::HostLoadOptions options;
    options.threads = threads;
    options.update_params = update_params;
    options.gpu_device = gpu_device;
    options.copies = copies != 0;
    options.copy_bytes = copy_bytes;
    auto load = emsa::HostLoad::Start(options);
    if (!load.ok()) return Report(load.status());
    *load_out = new emsa_host_load{std::move(load).value()};
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_host_load_stop(emsa_host_load* load, int64_t* update_rounds_out,
                                int64_t* copy_rounds_out) {
  return Guard([&] {
    if (load == nullptr) return Report(emsa::Status::Ok());
    std::unique_ptr<emsa_host_load> owned(load);
    const emsa::Status s = owned->load->Stop();
    if (update_rounds_out != nullptr) *update_rounds_out = owned->load->update_rounds();
    if (copy_rounds_out != nullptr) *copy_rounds_out = owned->load->copy_rounds();
    return Report(s);
  });
}

// ---- plan
// ----------------------------------------------------------------------------------------

void emsa_plan_options_init(emsa_plan_options* o) {
  if (o == nullptr) return;
  emsa::PlanOptions d;
  *o = emsa_plan_options{};
  o->struct_size = sizeof(emsa_plan_options);
  o->optimizer = static_cast<int32_t>(d.optimizer);
  o->state_dtype = static_cast<int32_t>(d.state_dtype);
  o->allow_host_tier = d.allow_host_tier ? 1 : 0;
  o->force_all_host = d.force_all_host ? 1 : 0;
  o->budget_bytes = d.budget_bytes;
  o->safety_margin_bytes = d.safety_margin_bytes;
  o->bucket_bytes = d.bucket_bytes;
  o->release_grads = d.release_grads ? 1 : 0;
  o->device_update_share = d.device_update_share;
}

namespace {

// The planner's inputs from emsa_plan_create's arguments.
struct PlanInputs {
  emsa::PlanOptions options;
  emsa::ProbeRecord record;
  emsa::DeviceProfile profile;
};

emsa_status ReadPlanInputs(const char* probe_json, const char* profile_json,
                           const emsa_plan_options* options, PlanInputs* in) {
  emsa::PlanOptions& po = in->options;
  if (options != nullptr) {
    if (emsa_status s = CheckSize(options, "emsa_plan_options", "emsa_plan_options_init")) {
      return s;
    }
    auto opt = ToOptimizer(options->optimizer);
    if (!opt.ok()) return Report(opt.status());
    auto sd = ToDType(options->state_dtype, "state_dtype");
    if (!sd.ok()) return Report(sd.status());
    po.optimizer = *opt;
    po.state_dtype = *sd;
    po.allow_host_tier = options->allow_host_tier != 0;
    po.force_all_host = options->force_all_host != 0;
    po.budget_bytes = options->budget_bytes;
    po.safety_margin_bytes = options->safety_margin_bytes;
    po.bucket_bytes = options->bucket_bytes;
    po.release_grads = options->release_grads != 0;
    po.device_update_share = options->device_update_share;
  }
  auto record = emsa::ProbeRecordFromJson(probe_json);
  if (!record.ok()) return Report(record.status().Annotate("probe record"));
  in->record = std::move(record).value();
  if (profile_json != nullptr) {
    auto p = emsa::DeviceProfileFromJson(profile_json);
    if (!p.ok()) return Report(p.status().Annotate("device profile"));
    in->profile = std::move(p).value();
  } else if (in->record.has_profile) {
    in->profile = in->record.profile;
  } else {
    auto p = emsa::MeasureDeviceProfile();
    if (!p.ok()) return Report(p.status());
    in->profile = std::move(p).value();
  }
  return EMSA_OK;
}

emsa_status ReadModelOptions(const emsa_model_options* options, emsa::ModelProbeOptions* mo) {
  if (options == nullptr) return EMSA_OK;
  if (emsa_status s = CheckSize(options, "emsa_model_options", "emsa_model_options_init")) {
    return s;
  }
  auto dtype = ToDType(options->param_dtype, "param_dtype");
  if (!dtype.ok()) return Report(dtype.status());
  mo->activation_checkpointing = options->activation_checkpointing != 0;
  mo->batch = options->batch;
  mo->seq_len = options->seq_len;
  mo->param_dtype = *dtype;
  mo->matmul_flops = options->matmul_flops;
  mo->eager_attention = options->eager_attention != 0;
  return EMSA_OK;
}

}  // namespace

emsa_status emsa_plan_create(const char* probe_json, const char* profile_json,
                             const emsa_plan_options* options, emsa_plan** plan_out,
                             uint64_t* min_budget_out) {
  return Guard([&] {
    if (probe_json == nullptr || plan_out == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "probe_json and plan_out must not be NULL");
    }
    PlanInputs in;
    if (emsa_status s = ReadPlanInputs(probe_json, profile_json, options, &in)) return s;
    uint64_t min_budget = 0;
    auto plan = emsa::MakePlan(in.record, in.profile, in.options, &min_budget);
    if (!plan.ok()) {
      if (min_budget_out != nullptr) *min_budget_out = min_budget;
      return Report(plan.status());
    }
    if (min_budget_out != nullptr) *min_budget_out = plan->min_budget_bytes;
    *plan_out = new emsa_plan{std::move(plan).value()};
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_plan_infeasible_message(const char* probe_json, const char* profile_json,
                                         const emsa_plan_options* options,
                                         const emsa_model_options* model, char** message_out) {
  return Guard([&] {
    if (probe_json == nullptr || message_out == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "probe_json and message_out must not be NULL");
    }
    PlanInputs in;
    if (emsa_status s = ReadPlanInputs(probe_json, profile_json, options, &in)) return s;
    emsa::ModelProbeOptions mo;
    if (emsa_status s = ReadModelOptions(model, &mo)) return s;
    uint64_t min_budget = 0;
    auto plan = emsa::MakePlan(in.record, in.profile, in.options, &min_budget);
    if (plan.ok()) return ReturnString("", message_out);
    if (plan.status().code() != emsa::StatusCode::kInfeasible) return Report(plan.status());
    const emsa::ModelChoices choices{mo.activation_checkpointing, mo.param_dtype};
    return ReturnString(
        emsa::InfeasibleBudgetMessage(in.record, in.profile, in.options, plan.status(), min_budget,
                                      model != nullptr ? &choices : nullptr),
        message_out);
  });
}

void emsa_plan_destroy(emsa_plan* plan) { delete plan; }

emsa_status emsa_plan_to_json(const emsa_plan* plan, char** json_out) {
  return Guard([&] {
    if (plan == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "plan is NULL");
    return ReturnString(emsa::PlanToJson(plan->plan), json_out);
  });
}

emsa_status emsa_plan_to_table(const emsa_plan* plan, char** table_out) {
  return Guard([&] {
    if (plan == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "plan is NULL");
    return ReturnString(emsa::PlanToTable(plan->plan), table_out);
  });
}

emsa_status emsa_plan_arena_bytes(const emsa_plan* plan, uint64_t* device_bytes,
                                  uint64_t* host_bytes) {
  if (plan == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "plan is NULL");
  if (device_bytes != nullptr) *device_bytes = plan->plan.prediction.device_state_bytes;
  if (host_bytes != nullptr) *host_bytes = plan->plan.prediction.host_state_bytes;
  return Report(emsa::Status::Ok());
}

emsa_status emsa_plan_to_summary(const emsa_plan* plan, char** table_out) {
  return Guard([&] {
    if (plan == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "plan is NULL");
    return ReturnString(emsa::PlanSummaryToTable(plan->plan), table_out);
  });
}

emsa_status emsa_plan_verdict(const emsa_plan* plan, const char* profile_json,
                              int64_t tokens_per_step, char** verdict_out) {
  return Guard([&] {
    if (plan == nullptr || profile_json == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "plan and profile_json must not be NULL");
    }
    auto profile = emsa::DeviceProfileFromJson(profile_json);
    if (!profile.ok()) return Report(profile.status());
    return ReturnString(emsa::PlanVerdict(plan->plan, *profile, tokens_per_step), verdict_out);
  });
}

emsa_status emsa_cli_run(int argc, const char* const* argv, int* exit_code, char** out,
                         char** err) {
  return Guard([&] {
    if (argc < 0 || (argc > 0 && argv == nullptr) || exit_code == nullptr || out == nullptr ||
        err == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "emsa_cli_run: argv and the outputs must not be NULL");
    }
    std::vector<std::string> args;
    for (int i = 0; i < argc; ++i) {
      if (argv[i] == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "emsa_cli_run: argv[i] is NULL");
      args.emplace_back(argv[i]);
    }
    emsa::Console console;
    *exit_code = emsa::RunCli(args, &console);
    char* out_copy = CopyString(console.out);
    char* err_copy = CopyString(console.err);
    if (out_copy == nullptr || err_copy == nullptr) {
      std::free(out_copy);
      std::free(err_copy);
      return Fail(EMSA_OUT_OF_MEMORY, "cannot allocate the returned strings");
    }
    *out = out_copy;
    *err = err_copy;
    return Report(emsa::Status::Ok());
  });
}

// ---- models
// --------------------------------------------------------------------------------------

void emsa_model_options_init(emsa_model_options* o) {
  if (o == nullptr) return;
  const emsa::ModelProbeOptions d;
  *o = emsa_model_options{};
  o->struct_size = sizeof(emsa_model_options);
  o->activation_checkpointing = d.activation_checkpointing ? 1 : 0;
  o->batch = d.batch;
  o->seq_len = d.seq_len;
  o->param_dtype = static_cast<int32_t>(d.param_dtype);
  o->matmul_flops = d.matmul_flops;
  o->eager_attention = d.eager_attention ? 1 : 0;
}

emsa_status emsa_model_probe(const char* model, const emsa_model_options* options,
                             char** probe_json_out, char** summary_out) {
  return Guard([&] {
    if (model == nullptr || probe_json_out == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "model and probe_json_out must not be NULL");
    }
    emsa::ModelProbeOptions mo;
    if (emsa_status s = ReadModelOptions(options, &mo)) return s;
    emsa::DecoderConfig config;
    auto record = emsa::ModelProbe(model, mo, &config);
    if (!record.ok()) return Report(record.status());
    // Both strings or neither: a failure leaves the outputs untouched.
    char* probe = CopyString(emsa::ProbeRecordToJson(*record));
    char* summary =
        summary_out != nullptr ? CopyString(emsa::ModelSummary(config, *record)) : nullptr;
    if (probe == nullptr || (summary_out != nullptr && summary == nullptr)) {
      std::free(probe);
      std::free(summary);
      return Fail(EMSA_OUT_OF_MEMORY, "cannot allocate the returned strings");
    }
    *probe_json_out = probe;
    if (summary_out != nullptr) *summary_out = summary;
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_device_preset(const char* name, char** json_out) {
  return Guard([&] {
    if (name == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "name is NULL");
    auto text = emsa::DevicePresetText(name);
    if (!text.ok()) return Report(text.status());
    return ReturnString(*text, json_out);
  });
}

// ---- host arena
// ----------------------------------------------------------------------------------

emsa_status emsa_host_arena_create(uint64_t bytes, int32_t want_pinned,
                                   emsa_host_arena** arena_out) {
  return Guard([&] {
    if (arena_out == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "arena_out is NULL");
    if (want_pinned != 0 && want_pinned != 1) {
      return Fail(EMSA_INVALID_ARGUMENT, "want_pinned is " + std::to_string(want_pinned) +
                                             "; use 0 (plain) or 1 (pinned)");
    }
    auto arena = emsa::HostArena::Create(bytes, want_pinned != 0);
    if (!arena.ok()) return Report(arena.status());
    *arena_out = new emsa_host_arena{std::move(arena).value()};
    return Report(emsa::Status::Ok());
  });
}

void emsa_host_arena_destroy(emsa_host_arena* arena) { delete arena; }

emsa_status emsa_host_arena_export(const emsa_host_arena* arena, uint64_t offset,
                                   const int64_t* shape, int32_t ndim, int32_t dtype,
                                   void** dlmanaged_out) {
  return ExportArenaView(arena, offset, shape, ndim, dtype, dlmanaged_out);
}

emsa_status emsa_host_arena_info(const emsa_host_arena* arena, void** data_out, uint64_t* bytes_out,
                                 int32_t* pinned_out) {
  if (arena == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "arena is NULL");
  if (data_out != nullptr) *data_out = arena->arena->data();
  if (bytes_out != nullptr) *bytes_out = arena->arena->size();
  if (pinned_out != nullptr) *pinned_out = arena->arena->kind() == emsa::HostArena::Kind::kPinned;
  return Report(emsa::Status::Ok());
}

// ---- CPU step
// ------------------------------------------------------------------------------------

void emsa_hyperparams_init(emsa_hyperparams* h) {
  if (h == nullptr) return;
  emsa::HyperParams d;
  *h = emsa_hyperparams{sizeof(emsa_hyperparams), d.lr, d.beta1, d.beta2, d.eps, d.weight_decay,
                        d.maximize ? 1 : 0};
}

void emsa_tensor_update_init(emsa_tensor_update* t) {
  if (t == nullptr) return;
  *t = emsa_tensor_update{};
  t->struct_size = sizeof(emsa_tensor_update);
  t->step = 1;
}

void emsa_step_options_init(emsa_step_options* o) {
  if (o == nullptr) return;
  emsa::StepOptions d;
  *o = emsa_step_options{
      sizeof(emsa_step_options), static_cast<int32_t>(d.optimizer), d.grad_multiplier,
      d.check_finite ? 1 : 0,    static_cast<int32_t>(d.rounding),  d.seed};
}

void emsa_step_report_init(emsa_step_report* r) {
  if (r == nullptr) return;
  *r = emsa_step_report{sizeof(emsa_step_report), 0, 0, -1};
}

emsa_status emsa_cpu_updater_create(int32_t threads, int32_t max_simd,
                                    emsa_cpu_updater** updater_out) {
  return Guard([&] {
    if (updater_out == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "updater_out is NULL");
    if (max_simd < EMSA_SIMD_SCALAR || max_simd > EMSA_SIMD_AVX512) {
      return Fail(EMSA_INVALID_ARGUMENT, "max_simd must be an EMSA_SIMD_* value");
    }
    emsa::CpuUpdaterOptions options;
    options.threads = threads;
    options.max_simd = static_cast<emsa::SimdLevel>(max_simd);
    auto updater = emsa::CpuUpdater::Create(options);
    if (!updater.ok()) return Report(updater.status());
    *updater_out = new emsa_cpu_updater{std::move(updater).value()};
    return Report(emsa::Status::Ok());
  });
}

void emsa_cpu_updater_destroy(emsa_cpu_updater* updater) { delete updater; }

emsa_status emsa_cpu_updater_info(const emsa_cpu_updater* updater, int32_t* threads_out,
                                  int32_t* simd_out) {
  if (updater == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "updater is NULL");
  if (threads_out != nullptr) *threads_out = updater->updater->threads();
  if (simd_out != nullptr) *simd_out = static_cast<int32_t>(updater->updater->simd());
  return Report(emsa::Status::Ok());
}

emsa_status emsa_cpu_grad_stats(emsa_cpu_updater* updater, const emsa_tensor_update* tensors,
                                size_t count, double* sum_sq_out, int64_t* nonfinite_out) {
  return Guard([&] {
    if (updater == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "updater is NULL");
    if (tensors == nullptr && count > 0) return Fail(EMSA_INVALID_ARGUMENT, "tensors is NULL");
    double total = 0.0;
    int64_t bad = 0;
    emsa::Status s =
        ForEachChunk(tensors, count, [&](const emsa::TensorUpdate* u, size_t n, size_t base) {
          double sq = 0.0;
          int64_t nf = 0;
          emsa::Status st = updater->updater->GradStats(u, n, &sq, &nf);
          total += sq;
          bad += nf;
          return st.ok() ? st : st.Annotate("chunk at tensor " + std::to_string(base));
        });
    if (!s.ok()) return Report(s);
    if (sum_sq_out != nullptr) *sum_sq_out = total;
    if (nonfinite_out != nullptr) *nonfinite_out = bad;
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_cpu_step(emsa_cpu_updater* updater, const emsa_tensor_update* tensors,
                          size_t count, const emsa_step_options* options,
                          emsa_step_report* report) {
  return Guard([&] {
    if (updater == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "updater is NULL");
    if (tensors == nullptr && count > 0) return Fail(EMSA_INVALID_ARGUMENT, "tensors is NULL");
    if (report != nullptr && report->struct_size != sizeof(emsa_step_report)) {
      return Fail(EMSA_INVALID_ARGUMENT,
                  "emsa_step_report.struct_size mismatch; call emsa_step_report_init() first");
    }
    auto opts = ToStepOptions(options);
    if (!opts.ok()) return Report(opts.status());
    emsa::StepOptions step = *opts;
    emsa::StepReport result;
    // Batches larger than one chunk: the finite check must see every tensor before any update,
    // so it runs over all chunks first and the chunked updates then run without it.
    if (count > kChunk && step.check_finite) {
      int64_t bad = 0, first_bad = -1;
      emsa::Status s =
          ForEachChunk(tensors, count, [&](const emsa::TensorUpdate* u, size_t n, size_t base) {
            double sq = 0.0;
            int64_t nf = 0;
            EMSA_RETURN_IF_ERROR(updater->updater->GradStats(u, n, &sq, &nf));
            if (nf > 0 && first_bad < 0) {
              for (size_t i = 0; i < n && first_bad < 0; ++i) {
                double sqi = 0.0;
                int64_t nfi = 0;
                EMSA_RETURN_IF_ERROR(updater->updater->GradStats(u + i, 1, &sqi, &nfi));
                if (nfi > 0) first_bad = static_cast<int64_t>(base + i);
              }
            }
            bad += nf;
            return emsa::Status::Ok();
          });
      if (!s.ok()) return Report(s);
      if (bad > 0) {
        result.skipped = true;
        result.nonfinite_count = bad;
        result.first_nonfinite_tensor = first_bad;
      }
      step.check_finite = false;
    }
    if (!result.skipped) {
      // Validate every chunk before the first update so an invalid tensor late in the batch
      // leaves the early ones untouched.
      if (count > kChunk) {
        emsa::Status v =
            ForEachChunk(tensors, count, [&](const emsa::TensorUpdate* u, size_t n, size_t base) {
              emsa::Status st = updater->updater->Validate(u, n, step);
              return st.ok() ? st : st.Annotate("tensors from index " + std::to_string(base));
            });
        if (!v.ok()) return Report(v);
      }
      emsa::Status s =
          ForEachChunk(tensors, count, [&](const emsa::TensorUpdate* u, size_t n, size_t base) {
            emsa::StepReport part;
            emsa::Status st = updater->updater->Step(u, n, step, &part);
            if (part.skipped) {
              result.skipped = true;
              result.nonfinite_count += part.nonfinite_count;
              if (result.first_nonfinite_tensor < 0) {
                result.first_nonfinite_tensor =
                    static_cast<int64_t>(base) + part.first_nonfinite_tensor;
              }
            }
            return st;
          });
      if (!s.ok()) return Report(s);
    }
    if (report != nullptr) {
      report->skipped = result.skipped ? 1 : 0;
      report->nonfinite_count = result.nonfinite_count;
      report->first_nonfinite_tensor = result.first_nonfinite_tensor;
    }
    return Report(emsa::Status::Ok());
  });
}

// ---- device tier
// ---------------------------------------------------------------------------------

void emsa_device_table_options_init(emsa_device_table_options* o) {
  if (o == nullptr) return;
  emsa::DeviceTableOptions d;
  *o = emsa_device_table_options{sizeof(emsa_device_table_options),
                                 static_cast<int32_t>(d.optimizer),
                                 static_cast<int32_t>(d.rounding), d.bulk_copy ? 1 : 0};
}

void emsa_device_step_report_init(emsa_device_step_report* r) {
  if (r == nullptr) return;
  *r = emsa_device_step_report{};
  r->struct_size = sizeof(emsa_device_step_report);
}

emsa_status emsa_device_scalars_create(const emsa_hyperparams* groups, size_t count,
                                       emsa_device_scalars** scalars_out) {
  return Guard([&] {
    if (scalars_out == nullptr || (groups == nullptr && count > 0)) {
      return Fail(EMSA_INVALID_ARGUMENT, "groups and scalars_out must not be NULL");
    }
    std::vector<emsa::HyperParams> hypers(count);
    for (size_t i = 0; i < count; ++i) {
      emsa::Status st = ToHyper(&groups[i], "groups[" + std::to_string(i) + "]", &hypers[i]);
      if (!st.ok()) return Report(st);
    }
    auto scalars = emsa::DeviceScalars::Create(hypers.data(), count);
    if (!scalars.ok()) return Report(scalars.status());
    *scalars_out = new emsa_device_scalars{std::move(scalars).value()};
    return Report(emsa::Status::Ok());
  });
}

void emsa_device_scalars_destroy(emsa_device_scalars* scalars) { delete scalars; }

emsa_status emsa_device_scalars_set_group(emsa_device_scalars* scalars, size_t group,
                                          const emsa_hyperparams* hyper, int64_t step,
                                          void* stream) {
  return Guard([&] {
    if (scalars == nullptr || hyper == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and hyper must not be NULL");
    }
    emsa::HyperParams h;
    emsa::Status st = ToHyper(hyper, "hyper", &h);
    if (!st.ok()) return Report(st);
    return Report(scalars->scalars->SetGroup(group, h, step, static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_scalars_set_inputs(emsa_device_scalars* scalars, float grad_unscale,
                                           float max_norm, uint64_t seed, void* stream) {
  return OnHandle(scalars, "scalars", [&](auto& h) {
    return h.scalars->SetInputs(grad_unscale, max_norm, seed, static_cast<cudaStream_t>(stream));
  });
}

emsa_status emsa_device_step(emsa_device_scalars* scalars, emsa_device_table** tables, size_t count,
                             int32_t check_stats, void* stream) {
  return Guard([&] {
    if (scalars == nullptr || (tables == nullptr && count > 0)) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and tables must not be NULL");
    }
    for (size_t i = 0; i < count; ++i) {
      if (tables[i] == nullptr) {
        return Fail(EMSA_INVALID_ARGUMENT, "tables[" + std::to_string(i) + "] is NULL");
      }
    }
    auto s = static_cast<cudaStream_t>(stream);
    emsa::DeviceScalars& sc = *scalars->scalars;
    emsa::Status st = sc.BeginStep(s);
    for (size_t i = 0; st.ok() && check_stats && i < count; ++i) {
      st = tables[i]->table->AccumulateGradStats(sc, s);
    }
    if (st.ok()) st = sc.FinishGradStats(s);
    if (st.ok()) st = sc.AdvanceSteps(s);
    for (size_t i = 0; st.ok() && i < count; ++i) st = tables[i]->table->Update(sc, s);
    return Report(st);
  });
}

emsa_status emsa_device_table_update(emsa_device_table* table, const emsa_device_scalars* scalars,
                                     void* stream) {
  return Guard([&] {
    if (table == nullptr || scalars == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "table and scalars must not be NULL");
    }
    return Report(table->table->Update(*scalars->scalars, static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_scalars_read(const emsa_device_scalars* scalars,
                                     emsa_device_step_report* report, void* stream) {
  return Guard([&] {
    if (scalars == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "scalars is NULL");
    if (emsa_status s =
            CheckSize(report, "emsa_device_step_report", "emsa_device_step_report_init")) {
      return s;
    }
    emsa::DeviceStepHeader h;
    emsa::Status st = scalars->scalars->Read(&h, nullptr, static_cast<cudaStream_t>(stream));
    if (!st.ok()) return Report(st);
    report->found_inf = h.found_inf != 0;
    report->grad_multiplier = h.grad_multiplier;
    report->clip_coef = h.clip_coef;
    report->sum_sq = h.sum_sq;
    report->grad_norm = h.grad_norm;
    report->nonfinite_count = h.nonfinite_count;
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_device_table_create(const emsa_tensor_update* tensors, const int32_t* groups,
                                     size_t count, const emsa_device_table_options* options,
                                     emsa_device_table** table_out) {
  return Guard([&] {
    if (table_out == nullptr || (tensors == nullptr && count > 0)) {
      return Fail(EMSA_INVALID_ARGUMENT, "tensors and table_out must not be NULL");
    }
    emsa::DeviceTableOptions o;
    if (options != nullptr) {
      if (emsa_status s =
              CheckSize(options, "emsa_device_table_options", "emsa_device_table_options_init")) {
        return s;
      }
      auto opt = ToOptimizer(options->optimizer);
      if (!opt.ok()) return Report(opt.status());
      o.optimizer = *opt;
      if (options->rounding != EMSA_ROUNDING_NEAREST &&
          options->rounding != EMSA_ROUNDING_STOCHASTIC) {
        return Fail(EMSA_INVALID_ARGUMENT, "rounding must be an EMSA_ROUNDING_* value");
      }
      o.rounding = static_cast<emsa::Rounding>(options->rounding);
      if (options->bulk_copy != 0 && options->bulk_copy != 1) {
        return Fail(EMSA_INVALID_ARGUMENT, "bulk_copy must be 0 or 1");
      }
      o.bulk_copy = options->bulk_copy != 0;
    }
    std::vector<emsa::TensorUpdate> updates(count);  // bind time: allocation is fine here
    for (size_t i = 0; i < count; ++i) {
      emsa::Status st = ConvertTensor(tensors[i], i, false, &updates[i], nullptr);
      if (!st.ok()) return Report(st);
    }
    auto table = emsa::DeviceUpdateTable::Create(updates.data(), groups, count, o);
    if (!table.ok()) return Report(table.status());
    *table_out = new emsa_device_table{std::move(table).value()};
    return Report(emsa::Status::Ok());
  });
}

void emsa_device_table_destroy(emsa_device_table* table) { delete table; }

emsa_status emsa_device_scalars_set_hyper(emsa_device_scalars* scalars, size_t group,
                                          const emsa_hyperparams* hyper, void* stream) {
  return Guard([&] {
    if (scalars == nullptr || hyper == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and hyper must not be NULL");
    }
    emsa::HyperParams h;
    emsa::Status st = ToHyper(hyper, "hyper", &h);
    if (!st.ok()) return Report(st);
    return Report(scalars->scalars->SetGroupHyper(group, h, static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_scalars_read_steps(const emsa_device_scalars* scalars, int64_t* steps_out,
                                           size_t count, void* stream) {
  return Guard([&] {
    if (scalars == nullptr || steps_out == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and steps_out must not be NULL");
    }
    const size_t groups = scalars->scalars->group_count();
    if (count != groups) {
      return Fail(EMSA_INVALID_ARGUMENT, "count is " + std::to_string(count) +
                                             " but the scalars hold " + std::to_string(groups) +
                                             " groups");
    }
    emsa::DeviceStepHeader header;
    std::vector<emsa::DeviceGroupScalars> records(groups);
    emsa::Status st =
        scalars->scalars->Read(&header, records.data(), static_cast<cudaStream_t>(stream));
    if (!st.ok()) return Report(st);
    for (size_t i = 0; i < groups; ++i) steps_out[i] = records[i].step;
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_device_scalars_copy_header(const emsa_device_scalars* scalars,
                                            emsa_device_step_header* dst, void* stream) {
  return Guard([&] {
    if (scalars == nullptr || dst == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and dst must not be NULL");
    }
    return Report(scalars->scalars->CopyHeader(reinterpret_cast<emsa::DeviceStepHeader*>(dst),
                                               static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_table_set_grads(emsa_device_table* table, const void* const* grads,
                                        size_t count, void* stream) {
  return OnHandle(table, "table", [&](auto& h) {
    return h.table->SetGradPointers(grads, count, static_cast<cudaStream_t>(stream));
  });
}

// ---- device arena
// --------------------------------------------------------------------------------

emsa_status emsa_device_arena_create(uint64_t bytes, int32_t device,
                                     emsa_device_arena** arena_out) {
  return Guard([&] {
    if (arena_out == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "arena_out is NULL");
    auto arena = emsa::DeviceArena::Create(bytes, device);
    if (!arena.ok()) return Report(arena.status());
    *arena_out = new emsa_device_arena{std::move(arena).value()};
    return Report(emsa::Status::Ok());
  });
}

void emsa_device_arena_destroy(emsa_device_arena* arena) { delete arena; }

emsa_status emsa_device_arena_info(const emsa_device_arena* arena, void** data_out,
                                   uint64_t* bytes_out, int32_t* kind_out,
                                   char** fallback_reason_out) {
  return Guard([&] {
    if (arena == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "arena is NULL");
    const emsa::DeviceArena& a = *arena->arena;
    char* reason = nullptr;
    if (fallback_reason_out != nullptr) {
      reason = CopyString(a.fallback_reason());
      if (reason == nullptr) return Fail(EMSA_OUT_OF_MEMORY, "cannot allocate the reason");
      *fallback_reason_out = reason;
    }
    if (data_out != nullptr) *data_out = a.data();
    if (bytes_out != nullptr) *bytes_out = a.size();
    if (kind_out != nullptr) {
      *kind_out = a.kind() == emsa::DeviceArena::Kind::kVmm ? EMSA_DEVICE_ARENA_VMM
                                                            : EMSA_DEVICE_ARENA_CUDA_MALLOC;
    }
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_device_arena_export(const emsa_device_arena* arena, uint64_t offset,
                                     const int64_t* shape, int32_t ndim, int32_t dtype,
                                     void** dlmanaged_out) {
  return ExportArenaView(arena, offset, shape, ndim, dtype, dlmanaged_out);
}

void emsa_dlpack_delete(void* dlmanaged) {
  auto* managed = static_cast<DLManagedTensor*>(dlmanaged);
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

emsa_status emsa_device_table_info(const emsa_device_table* table, int64_t* numel_out,
                                   int32_t* launches_out, uint64_t* bytes_out) {
  if (table == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "table is NULL");
  if (numel_out != nullptr) *numel_out = table->table->total_numel();
  if (launches_out != nullptr) *launches_out = table->table->launches_per_update();
  if (bytes_out != nullptr) *bytes_out = table->table->bytes_per_update();
  return Report(emsa::Status::Ok());
}

// ---- host tier ----------------------------------------------------------------------------------
void emsa_host_tier_tensor_init(emsa_host_tier_tensor* tensor) {
  if (tensor == nullptr) return;
  std::memset(tensor, 0, sizeof(*tensor));
  tensor->struct_size = sizeof(emsa_host_tier_tensor);
  emsa_tensor_update_init(&tensor->update);
}

// The C options' defaults are HostTierOptions' (the optimizer, rounding and seed as every
// options struct of the C ABI starts them).
void emsa_host_tier_options_init(emsa_host_tier_options* options) {
  if (options == nullptr) return;
  const emsa::HostTierOptions d;
  std::memset(options, 0, sizeof(*options));
  options->struct_size = sizeof(emsa_host_tier_options);
  options->optimizer = EMSA_OPTIMIZER_ADAMW;
  options->rounding = EMSA_ROUNDING_STOCHASTIC;
  options->seed = d.seed;
  options->device = d.device;
  options->submit_in_backward = d.submit_in_backward ? 1 : 0;
  options->device_delta = d.device_delta ? 1 : 0;
  options->delta_staging_elements = d.delta_staging_elements;
  options->paced_copies = d.paced_copies;
  options->pace_piece_elements = d.pace_piece_elements;
  options->paced_hold_bytes = d.paced_hold_bytes;
  options->stream_piece_elements = d.stream_piece_elements;
  options->stream_slots = d.stream_slots;
  options->device_update_stream = d.device_update_stream;
}

void emsa_host_tier_step_stats_init(emsa_host_tier_step_stats* stats) {
  if (stats == nullptr) return;
  std::memset(stats, 0, sizeof(*stats));
  stats->struct_size = sizeof(emsa_host_tier_step_stats);
}

int32_t emsa_host_tier_threads(int32_t cores) { return emsa::HostTierThreads(cores); }

emsa_status emsa_host_tier_create(emsa_cpu_updater* updater, const emsa_host_tier_tensor* tensors,
                                  size_t count, size_t bucket_count, size_t group_count,
                                  void* d2h_stream, void* h2d_stream,
                                  const emsa_host_tier_options* options,
                                  emsa_host_tier** tier_out) {
  return Guard([&] {
    if (updater == nullptr || tier_out == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "updater and tier_out must not be NULL");
    }
    if (tensors == nullptr && count > 0) return Fail(EMSA_INVALID_ARGUMENT, "tensors is NULL");
    if (emsa_status s =
            CheckSize(options, "emsa_host_tier_options", "emsa_host_tier_options_init")) {
      return s;
    }
    emsa::HostTierOptions o;
    auto kind = ToOptimizer(options->optimizer);
    if (!kind.ok()) return Report(kind.status());
    o.optimizer = *kind;
    if (options->rounding != EMSA_ROUNDING_NEAREST &&
        options->rounding != EMSA_ROUNDING_STOCHASTIC) {
      return Fail(EMSA_INVALID_ARGUMENT, "rounding must be EMSA_ROUNDING_NEAREST or _STOCHASTIC");
    }
    o.rounding = static_cast<emsa::Rounding>(options->rounding);
    o.seed = options->seed;
    o.device = options->device;
    if (options->submit_in_backward != 0 && options->submit_in_backward != 1) {
      return Fail(EMSA_INVALID_ARGUMENT, "submit_in_backward must be 0 or 1");
    }
    o.submit_in_backward = options->submit_in_backward == 1;
    if (options->device_delta != 0 && options->device_delta != 1) {
      return Fail(EMSA_INVALID_ARGUMENT, "device_delta must be 0 or 1");
    }
    o.device_delta = options->device_delta == 1;
    o.delta_staging_elements = options->delta_staging_elements;
    o.paced_copies = options->paced_copies;
    o.pace_piece_elements = options->pace_piece_elements;
    o.paced_hold_bytes = options->paced_hold_bytes;
    o.stream_piece_elements = options->stream_piece_elements;
    o.stream_slots = options->stream_slots;
    o.device_update_stream = static_cast<cudaStream_t>(options->device_update_stream);
    std::vector<emsa::HostTierTensor> converted(count);
    for (size_t i = 0; i < count; ++i) {
      const emsa_host_tier_tensor& t = tensors[i];
      if (t.struct_size != sizeof(emsa_host_tier_tensor)) {
        return Fail(EMSA_INVALID_ARGUMENT, "tensors[" + std::to_string(i) +
                                               "].struct_size mismatch; call "
                                               "emsa_host_tier_tensor_init() first");
      }
      emsa::Status st = ConvertTensor(t.update, i, false, &converted[i].update, nullptr);
      if (!st.ok()) return Report(st);
      converted[i].group = t.group;
      converted[i].bucket = t.bucket;
      converted[i].device_param = t.device_param;
      if (t.device_update != 0 && t.device_update != 1) {
        return Fail(EMSA_INVALID_ARGUMENT,
                    "tensors[" + std::to_string(i) + "].device_update must be 0 or 1");
      }
      converted[i].device_update = t.device_update == 1;
    }
    auto tier = emsa::HostTier::Create(
        updater->updater.get(), converted.data(), count, bucket_count, group_count,
        static_cast<cudaStream_t>(d2h_stream), static_cast<cudaStream_t>(h2d_stream), o);
    if (!tier.ok()) return Report(tier.status());
    *tier_out =
        new emsa_host_tier{std::move(tier).value(), std::vector<emsa::HyperParams>(group_count)};
    return Report(emsa::Status::Ok());
  });
}

void emsa_host_tier_destroy(emsa_host_tier* tier) { delete tier; }

emsa_status emsa_host_tier_begin_step(emsa_host_tier* tier, const emsa_hyperparams* hypers,
                                      const int64_t* steps, size_t group_count) {
  return Guard([&] {
    if (tier == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "tier is NULL");
    if ((hypers == nullptr || steps == nullptr) && group_count > 0) {
      return Fail(EMSA_INVALID_ARGUMENT, "hypers and steps must not be NULL");
    }
    std::vector<emsa::HyperParams>& h = tier->hypers;  // sized at create: no allocation here
    if (group_count != h.size()) {
      return Report(tier->tier->BeginStep(nullptr, steps, group_count));  // names the count
    }
    for (size_t g = 0; g < group_count; ++g) {
      emsa::Status st = ToHyper(&hypers[g], "hypers[" + std::to_string(g) + "]", &h[g]);
      if (!st.ok()) return Report(st);
    }
    return Report(tier->tier->BeginStep(h.data(), steps, group_count));
  });
}

emsa_status emsa_host_tier_submit(emsa_host_tier* tier, size_t bucket, const void* const* grads,
                                  size_t count, void* stream) {
  return OnHandle(tier, "tier", [&](auto& h) {
    return h.tier->Submit(bucket, grads, count, static_cast<cudaStream_t>(stream));
  });
}

emsa_status emsa_host_tier_wait(emsa_host_tier* tier, size_t bucket, void* stream) {
  return OnHandle(tier, "tier",
                  [&](auto& h) { return h.tier->Wait(bucket, static_cast<cudaStream_t>(stream)); });
}

emsa_status emsa_host_tier_wait_grads_copied(emsa_host_tier* tier, void* stream) {
  return OnHandle(tier, "tier", [&](auto& h) {
    return h.tier->WaitGradsCopied(static_cast<cudaStream_t>(stream));
  });
}

emsa_status emsa_host_tier_synchronize(emsa_host_tier* tier) {
  return OnHandle(tier, "tier", [&](auto& h) { return h.tier->Synchronize(); });
}

int64_t emsa_host_tier_copies_enqueued(const emsa_host_tier* tier) {
  return tier == nullptr ? -1 : tier->tier->copies_enqueued();
}

void* emsa_host_tier_update_stream(const emsa_host_tier* tier) {
  return tier == nullptr ? nullptr : static_cast<void*>(tier->tier->update_stream());
}

int64_t emsa_host_tier_stream_staging_bytes(const emsa_host_tier_options* options,
                                            int32_t state_dtype, int64_t largest) {
  if (options == nullptr || options->struct_size != sizeof(emsa_host_tier_options) || largest < 1) {
    return -1;
  }
  auto dtype = ToDType(state_dtype, "state_dtype");
  auto kind = ToOptimizer(options->optimizer);
  if (!dtype.ok() || !kind.ok()) return -1;
  emsa::HostTierOptions o;
  o.optimizer = *kind;
  o.stream_piece_elements = options->stream_piece_elements;
  o.stream_slots = options->stream_slots;
  return emsa::HostTier::StreamStagingBytes(o, *dtype, largest);
}

int32_t emsa_host_tier_bucket_copies_enqueued(const emsa_host_tier* tier, size_t bucket) {
  if (tier == nullptr || bucket >= tier->tier->bucket_count()) return -1;
  return tier->tier->BucketCopiesEnqueued(bucket) ? 1 : 0;
}

emsa_status emsa_host_tier_trace(const emsa_host_tier* tier, double* submit, double* start,
                                 double* end, size_t count) {
  return Guard([&] {
    if (tier == nullptr || submit == nullptr || start == nullptr || end == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "tier and the three output arrays must not be NULL");
    }
    if (count != tier->tier->bucket_count()) {
      return Fail(EMSA_INVALID_ARGUMENT, "count must be the tier's bucket count, " +
                                             std::to_string(tier->tier->bucket_count()));
    }
    tier->tier->Trace(submit, start, end, count);
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_host_tier_stats(const emsa_host_tier* tier, int64_t first,
                                 emsa_host_tier_step_stats* out, size_t capacity,
                                 size_t* count_out) {
  return Guard([&] {
    if (tier == nullptr || count_out == nullptr || (out == nullptr && capacity > 0)) {
      return Fail(EMSA_INVALID_ARGUMENT, "tier, count_out and out must not be NULL");
    }
    std::vector<emsa::HostTierStepStats> got(capacity);
    size_t n = tier->tier->Stats(first, got.data(), capacity);
    for (size_t i = 0; i < n; ++i) {
      if (out[i].struct_size != sizeof(emsa_host_tier_step_stats)) {
        return Fail(EMSA_INVALID_ARGUMENT,
                    "out[" + std::to_string(i) +
                        "].struct_size mismatch; call emsa_host_tier_step_stats_init() first");
      }
      out[i].step = got[i].step;
      out[i].d2h_s = got[i].d2h_s;
      out[i].cpu_s = got[i].cpu_s;
      out[i].h2d_s = got[i].h2d_s;
      out[i].wait_s = got[i].wait_s;
      out[i].buckets = got[i].buckets;
      out[i].complete = got[i].complete ? 1 : 0;
      out[i].grad_wait_s = got[i].grad_wait_s;
      out[i].worker_s = got[i].worker_s;
      out[i].device_buckets = got[i].device_buckets;
      out[i].stream_up_s = got[i].stream_up_s;
    }
    *count_out = n;
    return Report(emsa::Status::Ok());
  });
}

}  // extern "C"
