// capi_plan.cc — the C ABI's library, profile, plan, model and CLI entries.
#include <algorithm>
#include <string_view>

#include "capi/capi_internal.h"
#include "emsa/profile_cache.h"
#include "plan/plan_json.h"

using namespace emsa::capi;  // NOLINT(google-build-using-namespace)

extern "C" {

// ---- library
// -------------------------------------------------------------------------------------

uint32_t emsa_abi_version(void) { return EMSA_ABI_VERSION; }
const char* emsa_version(void) { return "0.1.0"; }
const char* emsa_last_error(void) { return LastError(); }
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

emsa_status emsa_profile_cached(int32_t gpu_device, const char* folder, int64_t max_age_seconds,
                                int32_t refresh, char** json_out) {
  return Guard([&] {
    if (json_out == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "json_out is NULL");
    emsa::ProfileCacheOptions options;
    if (folder != nullptr) options.folder = folder;
    if (max_age_seconds >= 0) options.max_age_seconds = max_age_seconds;
    options.refresh = refresh != 0;
    options.gpu_device = gpu_device;
    auto cached = emsa::CachedDeviceProfile(options);
    if (!cached.ok()) return Report(cached.status());
    return ReturnString(emsa::CachedProfileToJson(*cached), json_out);
  });
}

int64_t emsa_profile_measurement_count(void) { return emsa::ProfileMeasurementCount(); }

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

}  // extern "C"

// ---- plan
// ----------------------------------------------------------------------------------------
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
    CopyFields(*options, &po);
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

// The plan's JSON in one malloc'd string, grown with realloc as its pieces come (a large block
// is remapped, not copied), so the text is never held twice.
emsa_status ReturnPlanJson(const emsa::Plan& plan, char** json_out) {
  if (json_out == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "json_out is NULL");
  char* text = nullptr;
  size_t size = 0, capacity = 0;
  bool failed = false;
  emsa::WritePlanJson(plan, [&](std::string_view piece) {
    if (failed) return;
    if (size + piece.size() + 1 > capacity) {
      const size_t want = std::max(2 * capacity, size + piece.size() + 1);
      void* grown = std::realloc(text, want);
      if (grown == nullptr) {
        failed = true;
        return;
      }
      text = static_cast<char*>(grown);
      capacity = want;
    }
    std::memcpy(text + size, piece.data(), piece.size());
    size += piece.size();
  });
  if (failed || text == nullptr) {
    std::free(text);
    return Fail(EMSA_OUT_OF_MEMORY, "cannot allocate the plan's JSON");
  }
  text[size] = '\0';
  *json_out = text;
  return Report(emsa::Status::Ok());
}

emsa_status ReadModelOptions(const emsa_model_options* options, emsa::ModelProbeOptions* mo) {
  if (options == nullptr) return EMSA_OK;
  if (emsa_status s = CheckSize(options, "emsa_model_options", "emsa_model_options_init")) {
    return s;
  }
  auto dtype = ToDType(options->param_dtype, "param_dtype");
  if (!dtype.ok()) return Report(dtype.status());
  CopyFields(*options, mo);
  return EMSA_OK;
}

}  // namespace

extern "C" {

void emsa_plan_options_init(emsa_plan_options* o) {
  if (o == nullptr) return;
  InitFields(o);
}

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
    return ReturnPlanJson(plan->plan, json_out);
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
  InitFields(o);
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

}  // extern "C"
