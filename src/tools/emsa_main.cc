// emsa_main.cc — the `emsa` command: plan a probe record under a budget, or profile this machine.
//
// Exit codes: 0 ok; 2 usage or bad input (the message says what to change); 3 the budget cannot
// be met (the message names the smallest budget that works); 1 anything else.
#include <cstdio>
#include <string>
#include <vector>

#include "common/json.h"
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
    "  emsa plan PROBE.json [options]   plan optimizer state for a probed model\n"
    "  emsa profile [--no-bandwidth]    measure this machine, print the profile as JSON\n"
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
    "\n"
    "exit codes: 0 ok, 2 usage or bad input, 3 the budget cannot be met, 1 other errors\n";

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
};

bool TakesValue(const std::string& name) {
  for (const char* known : {"--budget", "--safety-margin", "--bucket-bytes", "--profile", "--json",
                            "--optimizer", "--state-dtype"}) {
    if (name == known) return true;
  }
  return false;
}

// Applies one "--name value" option; returns what was wrong, or "".
std::string ApplyOption(const std::string& name, const std::string& value, PlanArgs* out) {
  if (name == "--budget" || name == "--safety-margin" || name == "--bucket-bytes") {
    auto bytes = emsa::ParseBytes(value);
    if (!bytes.ok()) return name + ": " + bytes.status().message();
    if (name == "--budget") {
      if (*bytes == 0) return "--budget 0 is not a budget; name a positive size such as 24GiB";
      out->options.budget_bytes = *bytes;
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
  if (out->probe_path.empty()) return "emsa plan needs a probe record: emsa plan PROBE.json";
  if (out->options.force_all_host && !out->options.allow_host_tier) {
    return "--all-host and --no-host-tier contradict each other; pick one";
  }
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

int RunPlan(Args* args) {
  PlanArgs plan_args;
  if (std::string error = ParsePlanArgs(args, &plan_args); !error.empty()) return Usage(error);

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
    const emsa::Status& s = plan.status();
    if (s.code() == emsa::StatusCode::kInfeasible) {
      std::fprintf(stderr, "emsa: %s\nsmallest feasible budget: %s (--budget %llu)\n",
                   s.message().c_str(), emsa::FormatBytes(min_budget).c_str(),
                   static_cast<unsigned long long>(min_budget));
      return kExitInfeasible;
    }
    return Fail(s.code() == emsa::StatusCode::kInternal ? kExitFailure : kExitUsage, s.message());
  }

  const std::string json = emsa::PlanToJson(*plan);
  if (plan_args.json_path == "-") {
    std::fputs(json.c_str(), stdout);
    return kExitOk;
  }
  const std::string table =
      plan_args.summary ? emsa::PlanSummaryToTable(*plan) : emsa::PlanToTable(*plan);
  std::fputs(table.c_str(), stdout);
  if (!plan_args.json_path.empty()) {
    if (emsa::Status s = emsa::json::WriteFile(plan_args.json_path, json); !s.ok()) {
      return Fail(kExitFailure, s.message());
    }
  }
  return kExitOk;
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

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) args.items.emplace_back(argv[i]);
  if (args.Done()) {
    std::fputs(kUsage, stderr);
    return kExitUsage;
  }
  const std::string command = args.items[args.next++];
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(kUsage, stdout);
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
