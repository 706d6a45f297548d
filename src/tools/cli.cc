// cli.cc — the `emsa` command: plan a probe record or a model config under a budget, or
// profile this machine. The C++ binary (emsa_main.cc) and the Python package's `emsa` command
// (through the C ABI's emsa_cli_run) both run this code, so the two cannot drift apart.
//
// Exit codes: 0 ok; 2 usage or bad input (the message says what to change); 3 the plan does not
// fit (the budget cannot be met: the message names the smallest budget that works; or the host
// memory it needs exceeds the host's); 1 anything else.
#include "tools/cli.h"

#include <cerrno>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "common/json.h"
#include "emsa/model_config.h"
#include "emsa/plan.h"
#include "emsa/probe_record.h"
#include "emsa/profile.h"
#include "emsa/profile_cache.h"
#include "emsa/types.h"
#include "plan/plan_json.h"

namespace emsa {
namespace {

constexpr const char* kVersion = "0.1.0";  // keep equal to project(VERSION) in CMakeLists.txt
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr int kExitInfeasible = 3;

constexpr const char* kUsage =
    "usage:\n"
    "  emsa plan --model NAME|PATH [options]\n"
    "                                     will a model known by its config fit, and how fast?\n"
    "                                     (an analytic probe, no GPU needed)\n"
    "  emsa plan PROBE.json [options]     the same for a model probed in training (emsa.probe)\n"
    "  emsa plan --list                   the model and device presets, and the model types read\n"
    "  emsa profile [--refresh] [--no-bandwidth] [--cache-dir DIR] [--max-age SECONDS]\n"
    "                                     this machine's profile as JSON: the bandwidths from\n"
    "                                     the machine's cache ($XDG_CACHE_HOME/emsa, else\n"
    "                                     ~/.cache/emsa; a week at most), measured and cached\n"
    "                                     when it has none; --refresh measures and rewrites it;\n"
    "                                     --no-bandwidth: the untimed description only\n"
    "  emsa demo | emsa report            (the Python package's emsa command) train a small GPT\n"
    "                                     with emsa and torch side by side; report a run\n"
    "  emsa --help | --version\n"
    "\n"
    "The plan opens with its verdict: fits or not, the predicted step time and tokens/s, the\n"
    "host memory it needs and the tier split; then the totals and the prediction.\n"
    "\n"
    "plan options:\n"
    "  --budget SIZE          device memory the training may use at its peak, e.g. 24GiB\n"
    "                         (default: the GPU's free memory minus the safety margin;\n"
    "                         no limit when the profile has no GPU); at most the card's memory\n"
    "  --safety-margin SIZE   kept free when the budget is defaulted (default 1GiB)\n"
    "  --profile FILE         plan against this device profile (from `emsa profile`);\n"
    "                         default: the probe's embedded profile, else measure this machine\n"
    "  --optimizer NAME       adamw (default), adam or lion\n"
    "  --state-dtype DTYPE    fp32 (default) or bf16 optimizer state\n"
    "  --bucket-bytes SIZE    parameter bytes per update bucket (default 32MiB)\n"
    "  --no-host-tier         keep all state on the device (or fail)\n"
    "  --all-host             put all state on the host\n"
    "  --json FILE            also write the plan as JSON to FILE ('-': stdout, no table)\n"
    "  --verbose, --table     add one row per parameter and the module ranges\n"
    "  --step-in-backward     plan for updates in backward (emsa.AdamW(step_in_backward=True)):\n"
    "                         each gradient is freed once its update has it\n"
    "  --gated                the updates wait for every gradient of the step: clipping\n"
    "                         (max_grad_norm=), the non-finite check or a GradScaler\n"
    "\n"
    "model options (with --model):\n"
    "  --model NAME|PATH      a preset (emsa plan --list), or a Hugging Face config.json or\n"
    "                         the folder holding it\n"
    "  --gpu-mem SIZE         the device budget, e.g. 24GiB (the same as --budget)\n"
    "  --batch B              sequences per step (default 1)\n"
    "  --seq T                tokens per sequence (default: the model's context, at most 2048)\n"
    "  --checkpointing        activation checkpointing (each layer keeps only its input)\n"
    "  --eager-attention      attention saves its scores for backward (default: fused\n"
    "                         attention, PyTorch SDPA or FlashAttention, which does not)\n"
    "  --param-dtype DTYPE    the parameters on the device: bf16 (default; their fp32 master\n"
    "                         lives in the optimizer state), fp32 or fp16; training runs\n"
    "                         under bf16 autocast either way\n"
    "  --device NAME          a device preset (default h200), or 'this' to measure this\n"
    "                         machine; --profile FILE instead names a profile file\n"
    "  --keep-grads           plan for step() after backward, every gradient held at once\n"
    "                         (the default with --model is --step-in-backward)\n"
    "\n"
    "exit codes: 0 ok, 2 usage or bad input, 3 the plan does not fit (the budget cannot be\n"
    "met, or the host memory it needs exceeds the host's), 1 other errors\n";

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

std::string ListText() {
  return "model presets:  " + Join(ModelPresetNames()) +
         "\ndevice presets: " + Join(DevicePresetNames()) +
         ", this (measure this machine)\nmodel types:    " + SupportedModelTypes() + "\n";
}

int Fail(Console* con, int code, const std::string& message) {
  con->err += "emsa: " + message + "\n";
  return code;
}

int Usage(Console* con, const std::string& message) {
  return Fail(con, kExitUsage, message + "\nrun 'emsa --help' for usage");
}

struct Args {
  std::vector<std::string> items;
  size_t next = 0;
  bool Done() const { return next >= items.size(); }
};

struct PlanArgs {
  std::string probe_path, profile_path, json_path;
  bool verbose = false, list = false;
  PlanOptions options;
  // --model and the options that only make sense with it.
  std::string model, device;
  ModelProbeOptions model_options;
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
    if (arg == "--summary") {  // the default now; kept so that older command lines still run
      out->verbose = false;
    } else if (arg == "--verbose" || arg == "--table") {
      out->verbose = true;
    } else if (arg == "--list") {
      out->list = true;
    } else if (arg == "--no-host-tier") {
      out->options.allow_host_tier = false;
    } else if (arg == "--all-host") {
      out->options.force_all_host = true;
    } else if (arg == "--step-in-backward") {
      out->step_in_backward = true;
    } else if (arg == "--gated") {
      out->options.gated_steps = true;
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
  if (out->list) return "";
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

Result<DeviceProfile> ChooseProfile(const PlanArgs& args, const ProbeRecord& record, Console* con) {
  if (!args.profile_path.empty()) {
    EMSA_ASSIGN_OR_RETURN(std::string text, json::ReadFile(args.profile_path));
    auto profile = DeviceProfileFromJson(text);
    if (!profile.ok()) return profile.status().Annotate(args.profile_path);
    return profile;
  }
  if (record.has_profile) return record.profile;
  con->err += "emsa: the probe record has no device profile; measuring this machine\n";
  return MeasureDeviceProfile();
}

// A budget above the card's memory describes a machine that is not this one: refused, naming
// the card's memory, rather than planned for memory that does not exist.
std::string CheckBudget(const PlanArgs& args, const DeviceProfile& profile,
                        const std::string& device) {
  const uint64_t total = profile.gpu.total_memory;
  if (!profile.gpu.present || args.options.budget_bytes <= total) return "";
  const char* flag = args.gpu_mem_given ? "--gpu-mem" : "--budget";
  return std::string(flag) + " " + FormatBytes(args.options.budget_bytes) + " is more than the " +
         FormatBytes(total) + " of the " + profile.gpu.name + " (" + device + "); name at most " +
         FormatBytes(total) + ", or plan for another card with --device";
}

// Prints the plan as the options ask: its JSON alone on stdout, or its verdict, `preamble` (the
// model summary), and its summary or whole table (and the JSON to a file). Exit 3 when the host
// memory it needs exceeds the host's. The JSON is built only when it is asked for, handed on
// without a copy, and written to a file in pieces: for a large model it is the largest thing
// the command would hold.
int EmitPlan(const Plan& plan, const DeviceProfile& profile, const PlanArgs& args,
             const std::string& preamble, int64_t tokens_per_step, Console* con) {
  const bool host_fits = PlanFitsHost(plan, profile);
  if (!host_fits) {
    con->err += "emsa: the plan needs " + FormatBytes(HostMemoryNeeded(plan)) +
                " of host memory, more than the host's " + FormatBytes(profile.cpu.host_memory) +
                "\n";
  }
  const int code = host_fits ? kExitOk : kExitInfeasible;
  if (args.json_path == "-") {
    std::string json = PlanToJson(plan);
    if (con->out.empty()) {
      con->out = std::move(json);
    } else {
      con->out += json;
    }
    return code;
  }
  con->out += PlanVerdict(plan, profile, tokens_per_step) + "\n" + preamble +
              (args.verbose ? PlanToTable(plan) : PlanSummaryToTable(plan));
  if (!args.verbose) con->out += "\n(emsa plan --verbose adds one row per parameter)\n";
  if (!args.json_path.empty()) {
    auto produce = [&plan](const std::function<void(std::string_view)>& emit) {
      WritePlanJson(plan, emit);
    };
    if (Status s = json::WriteFile(args.json_path, produce); !s.ok()) {
      return Fail(con, kExitFailure, s.message());
    }
  }
  return code;
}

int PlanFailure(const Status& s, Console* con) {
  return Fail(con, s.code() == StatusCode::kInternal ? kExitFailure : kExitUsage, s.message());
}

int RunProbePlan(const PlanArgs& plan_args, Console* con) {
  auto record = LoadProbeRecord(plan_args.probe_path);
  if (!record.ok()) {
    const bool io = record.status().code() == StatusCode::kIoError;
    return Fail(
        con, kExitUsage,
        record.status().message() + (io ? ""
                                        : "\nthe probe record must come from emsa.probe() or "
                                          "AnalyticDecoderProbe"));
  }
  auto profile = ChooseProfile(plan_args, *record, con);
  if (!profile.ok()) {
    const bool measured = plan_args.profile_path.empty();
    return Fail(con, measured ? kExitFailure : kExitUsage, profile.status().message());
  }
  const std::string where =
      plan_args.profile_path.empty() ? "the probe's profile" : "profile " + plan_args.profile_path;
  if (std::string error = CheckBudget(plan_args, *profile, where); !error.empty()) {
    return Usage(con, error);
  }
  uint64_t min_budget = 0;
  auto plan = MakePlan(*record, *profile, plan_args.options, &min_budget);
  if (!plan.ok()) {
    if (plan.status().code() != StatusCode::kInfeasible) return PlanFailure(plan.status(), con);
    return Fail(
        con, kExitInfeasible,
        InfeasibleBudgetMessage(*record, *profile, plan_args.options, plan.status(), min_budget));
  }
  *record = ProbeRecord{};  // the plan holds what it needs: not kept beside the plan's text
  return EmitPlan(*plan, *profile, plan_args, "", 0, con);
}

// --device NAME, --device this, or --profile FILE (which may carry matmul_flops as presets do).
struct ChosenDevice {
  DevicePreset preset;
  std::string label;  // how the summary names it
};

Result<ChosenDevice> ChooseDevice(const PlanArgs& args) {
  ChosenDevice out;
  if (!args.profile_path.empty()) {
    EMSA_ASSIGN_OR_RETURN(std::string text, json::ReadFile(args.profile_path));
    auto preset = DevicePresetFromJson(text);
    if (!preset.ok()) return preset.status().Annotate(args.profile_path);
    out.preset = std::move(preset).value();
    out.label = "profile " + args.profile_path;
  } else if (args.device == "this") {
    EMSA_ASSIGN_OR_RETURN(out.preset.profile, MeasureDeviceProfile());
    out.label = "this machine, measured";
  } else {
    const std::string name = args.device.empty() ? kDefaultDevice : args.device;
    auto preset = LoadDevicePreset(name);
    if (!preset.ok()) {
      return preset.status().code() == StatusCode::kNotFound
                 ? Status::NotFound(preset.status().message() +
                                    ", or 'this' to measure this machine")
                 : preset.status();
    }
    out.preset = std::move(preset).value();
    out.label = "preset " + name;
  }
  return out;
}

std::string DeviceLine(const ChosenDevice& device) {
  const GpuProfile& gpu = device.preset.profile.gpu;
  const uint64_t ram = device.preset.profile.cpu.host_memory;
  const std::string host = ram == 0 ? "" : "; host " + FormatBytes(ram);
  if (!gpu.present) {
    return "device     no GPU (" + device.label + "): the training runs in host memory" + host +
           "\n";
  }
  return "device     " + gpu.name + " (" + device.label + "), " + FormatBytes(gpu.total_memory) +
         host + "\n";
}

std::string OptimizerLine(const PlanOptions& o) {
  return std::string("optimizer  ") + OptimizerName(o.optimizer) + ", " + DTypeName(o.state_dtype) +
         " state, " +
         (o.release_grads ? "step in backward (each gradient freed once its update has it)"
                          : "step() after backward (every gradient held at once)") +
         (o.gated_steps ? ", updates after every gradient (clipping, non-finite check, scaler)"
                        : "") +
         "\n";
}

int RunModelPlan(PlanArgs plan_args, Console* con) {
  auto device = ChooseDevice(plan_args);
  if (!device.ok()) {
    const bool measured = plan_args.device == "this";
    return Fail(con, measured ? kExitFailure : kExitUsage, device.status().message());
  }
  const DeviceProfile& profile = device->preset.profile;
  if (std::string error = CheckBudget(plan_args, profile, device->label); !error.empty()) {
    return Usage(con, error);
  }
  plan_args.model_options.matmul_flops = device->preset.matmul_flops;
  DecoderConfig config;
  auto record = ModelProbe(plan_args.model, plan_args.model_options, &config);
  if (!record.ok()) return PlanFailure(record.status(), con);
  uint64_t min_budget = 0;
  auto plan = MakePlan(*record, profile, plan_args.options, &min_budget);
  if (!plan.ok()) {
    if (plan.status().code() != StatusCode::kInfeasible) return PlanFailure(plan.status(), con);
    const ModelChoices choices{config.activation_checkpointing, config.dtype};
    return Fail(con, kExitInfeasible,
                InfeasibleBudgetMessage(*record, profile, plan_args.options, plan.status(),
                                        min_budget, &choices));
  }
  const std::string preamble =
      ModelSummary(config, *record) + DeviceLine(*device) + OptimizerLine(plan_args.options) + "\n";
  *record = ProbeRecord{};  // the plan holds what it needs: not kept beside the plan's text
  return EmitPlan(*plan, profile, plan_args, preamble, config.batch * config.seq_len, con);
}

int RunPlan(Args* args, Console* con) {
  PlanArgs plan_args;
  if (std::string error = ParsePlanArgs(args, &plan_args); !error.empty()) {
    return Usage(con, error);
  }
  if (plan_args.list) {
    con->out += ListText();
    return kExitOk;
  }
  return plan_args.model.empty() ? RunProbePlan(plan_args, con) : RunModelPlan(plan_args, con);
}

// One option of `emsa profile`; returns what was wrong, or "".
std::string ApplyProfileOption(Args* args, const std::string& arg, ProfileCacheOptions* cache,
                               bool* describe_only) {
  if (arg == "--no-bandwidth") {
    *describe_only = true;
  } else if (arg == "--refresh") {
    cache->refresh = true;
  } else if (arg == "--cache-dir" || arg == "--max-age") {
    if (args->Done()) return "emsa profile: " + arg + " needs a value";
    const std::string value = args->items[args->next++];
    int64_t seconds = 0;
    if (arg == "--cache-dir") {
      cache->folder = value;
    } else if (value == "0") {
      cache->max_age_seconds = 0;
    } else if (ParseCount(value, &seconds)) {
      cache->max_age_seconds = seconds;
    } else {
      return "emsa profile: --max-age takes whole seconds, got '" + value + "'";
    }
  } else {
    return "emsa profile: unknown argument '" + arg + "'";
  }
  return "";
}

int RunProfile(Args* args, Console* con) {
  ProfileCacheOptions cache;
  bool describe_only = false;
  while (!args->Done()) {
    const std::string arg = args->items[args->next++];
    if (std::string error = ApplyProfileOption(args, arg, &cache, &describe_only); !error.empty()) {
      return Usage(con, error);
    }
  }
  if (describe_only && cache.refresh) {
    return Usage(con,
                 "emsa profile: --refresh measures the bandwidths, --no-bandwidth skips "
                 "them; give one");
  }
  std::string text;
  if (describe_only) {
    ProfileOptions options;
    options.measure_bandwidth = false;
    auto profile = MeasureDeviceProfile(options);
    if (!profile.ok()) return Fail(con, kExitFailure, profile.status().message());
    text = DeviceProfileToJson(*profile);
  } else {
    auto cached = CachedDeviceProfile(cache);
    if (!cached.ok()) return Fail(con, kExitFailure, cached.status().message());
    text = DeviceProfileToJson(cached->profile);
    con->err += "emsa profile: " + CachedProfileSummary(*cached) + "\n";
  }
  if (text.empty() || text.back() != '\n') text += '\n';
  con->out += text;
  return kExitOk;
}

}  // namespace

int RunCli(const std::vector<std::string>& arguments, Console* con) {
  Args args{arguments, 0};
  if (args.Done()) {
    con->err += std::string(kUsage) + "\n" + ListText();
    return kExitUsage;
  }
  const std::string command = args.items[args.next++];
  if (command == "--help" || command == "-h" || command == "help") {
    con->out += std::string(kUsage) + "\n" + ListText();
    return kExitOk;
  }
  if (command == "--version") {
    con->out += std::string("emsa ") + kVersion + "\n";
    return kExitOk;
  }
  if (command == "plan") return RunPlan(&args, con);
  if (command == "profile") return RunProfile(&args, con);
  return Usage(con, "unknown command '" + command + "'");
}

}  // namespace emsa
