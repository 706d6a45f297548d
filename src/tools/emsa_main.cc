// emsa_main.cc — the `emsa` command: plan a probe record or a model config under a budget, or
// profile this machine.
//
// Exit codes: 0 ok; 2 usage or bad input (the message says what to change); 3 the budget cannot
// be met (the message names the smallest budget that works); 1 anything else.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "common/json.h"
#include "emsa/model_config.h"
#include "emsa/plan.h"
#include "emsa/probe_record.h"
#include "emsa/profile.h"
#include "emsa/types.h"

namespace {

constexpr const char* kVersion = "0.1.0";  // keep equal to project(VERSION) in CMakeLists.txt
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr int kExitInfeasible = 3;

constexpr const char* kUsage =
    "usage:\n"
    "  emsa plan PROBE.json [options]     plan optimizer state for a probed model\n"
    "  emsa plan --model NAME|PATH [options]\n"
    "                                     the same for a model known by its config: will it\n"
    "                                     fit, and how fast? (an analytic probe, no GPU needed)\n"
    "  emsa profile [--no-bandwidth]      measure this machine, print the profile as JSON\n"
    "  emsa --help | --version\n"
    "\n"
    "plan options:\n"
    "  --budget SIZE          device memory the training may use at its peak, e.g. 24GiB\n"
    "                         (default: the GPU's free memory minus the safety margin;\n"
    "                         no limit when the profile has no GPU)\n"
    "  --safety-margin SIZE   kept free when the budget is defaulted (default 1GiB)\n"
    "  --profile FILE         plan against this device profile (from `emsa profile`);\n"
    "                         default: the probe's embedded profile, else measure this machine\n"
    "  --optimizer NAME       adamw (default), adam or lion\n"
    "  --state-dtype DTYPE    fp32 (default) or bf16 optimizer state\n"
    "  --bucket-bytes SIZE    parameter bytes per update bucket (default 32MiB)\n"
    "  --no-host-tier         keep all state on the device (or fail)\n"
    "  --all-host             put all state on the host\n"
    "  --json FILE            also write the plan as JSON to FILE ('-': stdout, no table)\n"
    "  --summary              print totals and the prediction, not one row per parameter\n"
    "  --step-in-backward     plan for updates in backward (emsa.AdamW(step_in_backward=True)):\n"
    "                         each gradient is freed once its update has it\n"
    "\n"
    "model options (with --model):\n"
    "  --model NAME|PATH      a preset (below), or a Hugging Face config.json (or its folder)\n"
    "  --gpu-mem SIZE         the device budget, e.g. 24GiB (the same as --budget)\n"
    "  --batch B              sequences per step (default 1)\n"
    "  --seq T                tokens per sequence (default: the model's context, at most 2048)\n"
    "  --checkpointing        activation checkpointing (each layer keeps only its input)\n"
    "  --eager-attention      attention saves its scores for backward (default: fused\n"
    "                         attention, PyTorch SDPA or FlashAttention, which does not)\n"
    "  --param-dtype DTYPE    the parameters on the device: bf16 (default; their fp32 master\n"
    "                         lives in the optimizer state), fp32 or fp16; training runs\n"
    "                         under bf16 autocast either way\n"
    "  --device NAME          a device preset (below; default h200), or 'this' to measure\n"
    "                         this machine; --profile FILE instead names a profile file\n"
    "  --keep-grads           plan for step() after backward, every gradient held at once\n"
    "                         (the default with --model is --step-in-backward)\n"
    "\n"
    "exit codes: 0 ok, 2 usage or bad input, 3 the budget cannot be met, 1 other errors\n";

std::string UsageText() {
  auto join = [](const std::vector<std::string>& names) {
    std::string out;
    for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
  };
  return std::string(kUsage) + "\nmodel presets:  " + join(emsa::ModelPresetNames()) +
         "\ndevice presets: " + join(emsa::DevicePresetNames()) + ", this\n";
}

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "emsa: %s\n", message.c_str());
  return code;
}

int Usage(const std::string& message) {
  return Fail(kExitUsage, message + "\nrun 'emsa --help' for usage");
}

struct Args {
  std::vector<std::string> items;
  size_t next = 0;
  bool Done() const { return next >= items.size(); }
};

struct PlanArgs {
  std::string probe_path, profile_path, json_path;
  bool summary = false;
  emsa::PlanOptions options;
  // --model and the options that only make sense with it.
  std::string model, device;
  emsa::ModelProbeOptions model_options;
  std::vector<std::string> model_only;  // model options given, for the error without --model
  bool budget_given = false, gpu_mem_given = false;
  bool step_in_backward = false, keep_grads = false;
};

constexpr const char* kDefaultDevice = "h200";

bool TakesValue(const std::string& name) {
  for (const char* known :
       {"--budget", "--safety-margin", "--bucket-bytes", "--profile", "--json", "--optimizer",
        "--state-dtype", "--model", "--gpu-mem", "--batch", "--seq", "--param-dtype", "--device"}) {
    if (name == known) return true;
  }
  return false;
}

// A positive decimal count, all of the text.
bool ParseCount(const std::string& text, int64_t* out) {
  if (text.empty() || text[0] < '0' || text[0] > '9') return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v <= 0) return false;
  *out = v;
  return true;
}

// The --model options; returns what was wrong, or "".
std::string ApplyModelOption(const std::string& name, const std::string& value, PlanArgs* out) {
  out->model_only.push_back(name);
  if (name == "--batch" || name == "--seq") {
    int64_t n = 0;
    if (!ParseCount(value, &n)) {
      return name + " '" + value + "' is not a positive whole number";
    }
    (name == "--batch" ? out->model_options.batch : out->model_options.seq_len) = n;
  } else if (name == "--param-dtype") {
    auto dtype = emsa::ParseDType(value);
    if (!dtype.ok())
      return "--param-dtype '" + value + "' is not supported; use fp32, bf16 or fp16";
    out->model_options.param_dtype = *dtype;
  } else {  // --device
    out->device = value;
  }
  return "";
}

// Applies one "--name value" option; returns what was wrong, or "".
std::string ApplyOption(const std::string& name, const std::string& value, PlanArgs* out) {
  if (name == "--batch" || name == "--seq" || name == "--param-dtype" || name == "--device") {
    return ApplyModelOption(name, value, out);
  }
  if (name == "--model") {
    out->model = value;
  } else if (name == "--budget" || name == "--gpu-mem" || name == "--safety-margin" ||
             name == "--bucket-bytes") {
    auto bytes = emsa::ParseBytes(value);
    if (!bytes.ok()) return name + ": " + bytes.status().message();
    if (name == "--budget" || name == "--gpu-mem") {
      if (*bytes == 0) {
        return name + " 0 is not a budget; name a positive size such as 24GiB";
      }
      out->options.budget_bytes = *bytes;
      (name == "--budget" ? out->budget_given : out->gpu_mem_given) = true;
    } else if (name == "--safety-margin") {
      out->options.safety_margin_bytes = *bytes;
    } else {
      out->options.bucket_bytes = *bytes;
    }
  } else if (name == "--profile") {
    out->profile_path = value;
  } else if (name == "--json") {
    out->json_path = value;
  } else if (name == "--optimizer") {
    auto kind = emsa::ParseOptimizer(value);
    if (!kind.ok()) return "--optimizer: " + kind.status().message();
    out->options.optimizer = *kind;
  } else {  // --state-dtype
    auto dtype = emsa::ParseDType(value);
    if (!dtype.ok() || *dtype == emsa::DType::kFloat16) {
      return "--state-dtype '" + value + "' is not supported; use fp32 or bf16";
    }
    out->options.state_dtype = *dtype;
  }
  return "";
}

// Returns "" on success, else what was wrong. Options take "--name value" or "--name=value".
std::string ParsePlanArgs(Args* args, PlanArgs* out) {
  while (!args->Done()) {
    const std::string arg = args->items[args->next++];
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    if (arg == "--summary") {
      out->summary = true;
    } else if (arg == "--no-host-tier") {
      out->options.allow_host_tier = false;
    } else if (arg == "--all-host") {
      out->options.force_all_host = true;
    } else if (arg == "--step-in-backward") {
      out->step_in_backward = true;
    } else if (arg == "--keep-grads") {
      out->keep_grads = true;
      out->model_only.push_back(arg);
    } else if (arg == "--checkpointing") {
      out->model_options.activation_checkpointing = true;
      out->model_only.push_back(arg);
    } else if (arg == "--eager-attention") {
      out->model_options.eager_attention = true;
      out->model_only.push_back(arg);
    } else if (TakesValue(name)) {
      if (eq == std::string::npos && args->Done()) return name + " needs a value";
      const std::string value =
          eq == std::string::npos ? args->items[args->next++] : arg.substr(eq + 1);
      if (std::string error = ApplyOption(name, value, out); !error.empty()) return error;
    } else if (arg.rfind("-", 0) == 0 && arg != "-") {
      return "unknown option '" + arg + "'";
    } else if (out->probe_path.empty()) {
      out->probe_path = arg;
    } else {
      return "one probe record at a time: got '" + out->probe_path + "' and '" + arg + "'";
    }
  }
  if (!out->model.empty()) {
    if (!out->probe_path.empty()) {
      return "give a probe record or --model, not both: got '" + out->probe_path +
             "' and --model " + out->model;
    }
    if (out->budget_given && out->gpu_mem_given) {
      return "--gpu-mem and --budget name the same thing; give one";
    }
    if (!out->device.empty() && !out->profile_path.empty()) {
      return "--device and --profile both name the device; give one";
    }
  } else {
    if (!out->model_only.empty()) {
      return out->model_only.front() + " goes with --model NAME|PATH";
    }
    if (out->gpu_mem_given) return "--gpu-mem goes with --model; for a probe record use --budget";
    if (out->probe_path.empty()) {
      return "emsa plan needs a probe record (emsa plan PROBE.json) or a model "
             "(emsa plan --model NAME)";
    }
  }
  if (out->options.force_all_host && !out->options.allow_host_tier) {
    return "--all-host and --no-host-tier contradict each other; pick one";
  }
  if (out->step_in_backward && out->keep_grads) {
    return "--step-in-backward and --keep-grads contradict each other; pick one";
  }
  // A model is planned for step in backward unless told otherwise: it is how emsa hides the
  // host tier's copies under backward, and it frees each gradient once its update has it.
  out->options.release_grads = out->step_in_backward || (!out->model.empty() && !out->keep_grads);
  return "";
}

emsa::Result<emsa::DeviceProfile> ChooseProfile(const PlanArgs& args,
                                                const emsa::ProbeRecord& record) {
  if (!args.profile_path.empty()) {
    EMSA_ASSIGN_OR_RETURN(std::string text, emsa::json::ReadFile(args.profile_path));
    auto profile = emsa::DeviceProfileFromJson(text);
    if (!profile.ok()) return profile.status().Annotate(args.profile_path);
    return profile;
  }
  if (record.has_profile) return record.profile;
  std::fprintf(stderr, "emsa: the probe record has no device profile; measuring this machine\n");
  return emsa::MeasureDeviceProfile();
}

// Prints the plan as the options ask: its JSON alone on stdout, or its table (and the JSON to a
// file). `preamble` (the model summary) goes before the table.
int EmitPlan(const emsa::Plan& plan, const PlanArgs& args, const std::string& preamble) {
  const std::string json = emsa::PlanToJson(plan);
  if (args.json_path == "-") {
    std::fputs(json.c_str(), stdout);
    return kExitOk;
  }
  const std::string table = args.summary ? emsa::PlanSummaryToTable(plan) : emsa::PlanToTable(plan);
  std::fputs((preamble + table).c_str(), stdout);
  if (!args.json_path.empty()) {
    if (emsa::Status s = emsa::json::WriteFile(args.json_path, json); !s.ok()) {
      return Fail(kExitFailure, s.message());
    }
  }
  return kExitOk;
}

int PlanFailure(const emsa::Status& s) {
  return Fail(s.code() == emsa::StatusCode::kInternal ? kExitFailure : kExitUsage, s.message());
}

int RunProbePlan(const PlanArgs& plan_args) {
  auto record = emsa::LoadProbeRecord(plan_args.probe_path);
  if (!record.ok()) {
    const bool io = record.status().code() == emsa::StatusCode::kIoError;
    return Fail(kExitUsage, record.status().message() +
                                (io ? ""
                                    : "\nthe probe record must come from emsa.probe() or "
                                      "AnalyticDecoderProbe"));
  }
  auto profile = ChooseProfile(plan_args, *record);
  if (!profile.ok()) {
    const bool measured = plan_args.profile_path.empty();
    return Fail(measured ? kExitFailure : kExitUsage, profile.status().message());
  }
  uint64_t min_budget = 0;
  auto plan = emsa::MakePlan(*record, *profile, plan_args.options, &min_budget);
  if (!plan.ok()) {
    if (plan.status().code() != emsa::StatusCode::kInfeasible) return PlanFailure(plan.status());
    return Fail(kExitInfeasible, emsa::InfeasibleBudgetMessage(*record, *profile, plan_args.options,
                                                               plan.status(), min_budget));
  }
  return EmitPlan(*plan, plan_args, "");
}

// --device NAME, --device this, or --profile FILE (which may carry matmul_flops as presets do).
struct ChosenDevice {
  emsa::DevicePreset preset;
  std::string label;  // how the summary names it
};

emsa::Result<ChosenDevice> ChooseDevice(const PlanArgs& args) {
  ChosenDevice out;
  if (!args.profile_path.empty()) {
    EMSA_ASSIGN_OR_RETURN(std::string text, emsa::json::ReadFile(args.profile_path));
    auto preset = emsa::DevicePresetFromJson(text);
    if (!preset.ok()) return preset.status().Annotate(args.profile_path);
    out.preset = std::move(preset).value();
    out.label = "profile " + args.profile_path;
  } else if (args.device == "this") {
    EMSA_ASSIGN_OR_RETURN(out.preset.profile, emsa::MeasureDeviceProfile());
    out.label = "this machine, measured";
  } else {
    const std::string name = args.device.empty() ? kDefaultDevice : args.device;
    auto preset = emsa::LoadDevicePreset(name);
    if (!preset.ok()) {
      return preset.status().code() == emsa::StatusCode::kNotFound
                 ? emsa::Status::NotFound(preset.status().message() +
                                          ", or 'this' to measure this machine")
                 : preset.status();
    }
    out.preset = std::move(preset).value();
    out.label = "preset " + name;
  }
  return out;
}

std::string DeviceLine(const ChosenDevice& device) {
  const emsa::GpuProfile& gpu = device.preset.profile.gpu;
  if (!gpu.present)
    return "device     no GPU (" + device.label + "): no device limit unless --gpu-mem\n";
  return "device     " + gpu.name + " (" + device.label + "), " +
         emsa::FormatBytes(gpu.total_memory) + "\n";
}

std::string OptimizerLine(const emsa::PlanOptions& o) {
  return std::string("optimizer  ") + emsa::OptimizerName(o.optimizer) + ", " +
         emsa::DTypeName(o.state_dtype) + " state, " +
         (o.release_grads ? "step in backward (each gradient freed once its update has it)"
                          : "step() after backward (every gradient held at once)") +
         "\n";
}

int RunModelPlan(PlanArgs plan_args) {
  auto device = ChooseDevice(plan_args);
  if (!device.ok()) {
    const bool measured = plan_args.device == "this";
    return Fail(measured ? kExitFailure : kExitUsage, device.status().message());
  }
  plan_args.model_options.matmul_flops = device->preset.matmul_flops;
  emsa::DecoderConfig config;
  auto record = emsa::ModelProbe(plan_args.model, plan_args.model_options, &config);
  if (!record.ok()) return PlanFailure(record.status());
  const emsa::DeviceProfile& profile = device->preset.profile;
  uint64_t min_budget = 0;
  auto plan = emsa::MakePlan(*record, profile, plan_args.options, &min_budget);
  if (!plan.ok()) {
    if (plan.status().code() != emsa::StatusCode::kInfeasible) return PlanFailure(plan.status());
    const emsa::ModelChoices choices{config.activation_checkpointing, config.dtype};
    return Fail(kExitInfeasible,
                emsa::InfeasibleBudgetMessage(*record, profile, plan_args.options, plan.status(),
                                              min_budget, &choices));
  }
  const std::string preamble = emsa::ModelSummary(config, *record) + DeviceLine(*device) +
                               OptimizerLine(plan_args.options) + "\n";
  return EmitPlan(*plan, plan_args, preamble);
}

int RunPlan(Args* args) {
  PlanArgs plan_args;
  if (std::string error = ParsePlanArgs(args, &plan_args); !error.empty()) return Usage(error);
  return plan_args.model.empty() ? RunProbePlan(plan_args) : RunModelPlan(plan_args);
}

int RunProfile(Args* args) {
  emsa::ProfileOptions options;
  while (!args->Done()) {
    const std::string arg = args->items[args->next++];
    if (arg == "--no-bandwidth") {
      options.measure_bandwidth = false;
    } else {
      return Usage("emsa profile: unknown argument '" + arg + "'");
    }
  }
  auto profile = emsa::MeasureDeviceProfile(options);
  if (!profile.ok()) return Fail(kExitFailure, profile.status().message());
  std::string text = emsa::DeviceProfileToJson(*profile);
  if (text.empty() || text.back() != '\n') text += '\n';
  std::fputs(text.c_str(), stdout);
  return kExitOk;
}

int Main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) args.items.emplace_back(argv[i]);
  if (args.Done()) {
    std::fputs(UsageText().c_str(), stderr);
    return kExitUsage;
  }
  const std::string command = args.items[args.next++];
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(UsageText().c_str(), stdout);
    return kExitOk;
  }
  if (command == "--version") {
    std::printf("emsa %s\n", kVersion);
    return kExitOk;
  }
  if (command == "plan") return RunPlan(&args);
  if (command == "profile") return RunProfile(&args);
  return Usage("unknown command '" + command + "'");
}

}  // namespace

// Nothing escapes as a signal: the inputs' limits keep memory small, and should an allocation
// fail anyway the answer is a message and an exit code.
int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fputs("emsa: out of memory\n", stderr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emsa: internal error: %s\n", e.what());
  }
  return kExitFailure;
}
