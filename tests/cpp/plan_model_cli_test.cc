// Tests for `emsa plan --model`: exit codes (0 ok, 2 bad input, 3 infeasible with the smallest
// budget named), that the plan printed is the library's, and the 7B-on-24-GiB expectation. The
// binary sits next to the tests directory (build/emsa); skipped when it has not been built.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cli_fixture.h"
#include "common/json.h"
#include "emsa/model_config.h"
#include "emsa/plan.h"
#include "emsa/profile.h"

namespace emsa {
namespace {

using Outcome = CliOutcome;
using PlanModelCli = CliFixture;

// What the CLI should compute for `--model NAME` on the h200 preset, step in backward.
Result<Plan> LibraryPlan(const std::string& model, const ModelProbeOptions& probe_options,
                         PlanOptions options, uint64_t* min_budget) {
  EMSA_ASSIGN_OR_RETURN(DevicePreset device, LoadDevicePreset("h200"));
  ModelProbeOptions o = probe_options;
  o.matmul_flops = device.matmul_flops;
  EMSA_ASSIGN_OR_RETURN(ProbeRecord record, ModelProbe(model, o));
  options.release_grads = true;
  return MakePlan(record, device.profile, options, min_budget);
}

TEST_F(PlanModelCli, FitsAndPrintsTheModelAndThePlan) {
  Outcome r = Emsa("plan --model tinyllama-1.1b --gpu-mem 80GiB --seq 1024 --summary");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* part : {"tinyllama-1.1b: llama family, 1,100,048,384 parameters (bfloat16",
                           "batch 1 x seq 1024", "NVIDIA H200 (preset h200)", "L1 (device)",
                           "L2 (host)", "peak device memory", "step  ", "(budget 80.00 GiB)"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
  // --summary (the default) leaves out the per-parameter rows; --verbose has them.
  EXPECT_EQ(r.out.find("model.layers.0.mlp.up_proj.weight"), std::string::npos);
  Outcome plain = Emsa("plan --model tinyllama-1.1b --gpu-mem 80GiB --seq 1024");
  ASSERT_EQ(plain.code, 0) << plain.err;
  EXPECT_EQ(plain.out, r.out);
  Outcome full = Emsa("plan --model tinyllama-1.1b --gpu-mem 80GiB --seq 1024 --verbose");
  ASSERT_EQ(full.code, 0) << full.err;
  EXPECT_NE(full.out.find("model.layers.0.mlp.up_proj.weight"), std::string::npos);
}

TEST_F(PlanModelCli, JsonIsTheLibrarysPlan) {
  ModelProbeOptions o;
  o.batch = 2;
  o.seq_len = 512;
  o.activation_checkpointing = true;
  o.param_dtype = DType::kBFloat16;
  PlanOptions options;
  options.budget_bytes = 20ull << 30;
  options.state_dtype = DType::kBFloat16;
  Result<Plan> want = LibraryPlan("mistral-7b", o, options, nullptr);
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  Outcome r = Emsa(
      "plan --model mistral-7b --gpu-mem 20GiB --batch 2 --seq 512 --checkpointing "
      "--param-dtype bf16 --state-dtype bf16 --json -");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(r.out == PlanToJson(*want)) << "the CLI's plan differs from MakePlan's";
}

TEST_F(PlanModelCli, Llama7BOn24GiBFitsOnlyWithTheHostTier) {
  // The question as a user asks it: bf16 parameters on the device are the default.
  const std::string args =
      "plan --model llama-2-7b --gpu-mem 24GiB --batch 1 --seq 2048 --checkpointing";
  Outcome explicit_dtype = Emsa(args + " --param-dtype bf16 --json -");
  ASSERT_EQ(explicit_dtype.code, 0) << explicit_dtype.err;
  Outcome r = Emsa(args + " --json '" + Path("plan.json") + "'");
  EXPECT_EQ(json::ReadFile(Path("plan.json")).value(), explicit_dtype.out);
  ASSERT_EQ(r.code, 0) << r.err;
  const json::Value plan = json::Parse(json::ReadFile(Path("plan.json")).value()).value();
  const json::Value& prediction = *plan.Find("prediction");
  EXPECT_LE(prediction.Find("peak_device_bytes")->as_int(), int64_t{24} << 30);
  EXPECT_GT(prediction.Find("host_state_bytes")->as_int(), 0);
  // The bf16 parameters (13.5 GB) stay on the device; most state and masters go to the host.
  size_t host = 0, params = 0;
  for (const json::Value& p : plan.Find("params")->as_array()) {
    ++params;
    if (p.Find("tier")->as_string() == "L2") ++host;
  }
  EXPECT_GT(host, params / 2);

  Outcome device_only = Emsa(args + " --no-host-tier");
  EXPECT_EQ(device_only.code, 3) << device_only.err;
  EXPECT_NE(device_only.err.find("llama-2-7b needs at least"), std::string::npos)
      << device_only.err;
  EXPECT_NE(device_only.err.find("with everything on the device (--no-host-tier)"),
            std::string::npos)
      << device_only.err;
}

TEST_F(PlanModelCli, InfeasibleExitsThreeNamingTheSmallestBudget) {
  ModelProbeOptions o;
  o.param_dtype = DType::kBFloat16;
  o.activation_checkpointing = true;
  PlanOptions options;
  options.budget_bytes = 4ull << 30;
  uint64_t min_budget = 0;
  Result<Plan> want = LibraryPlan("llama-2-7b", o, options, &min_budget);
  ASSERT_FALSE(want.ok());
  ASSERT_EQ(want.status().code(), StatusCode::kInfeasible);
  ASSERT_GT(min_budget, 4ull << 30);

  const std::string model = "plan --model llama-2-7b --checkpointing --param-dtype bf16";
  Outcome r = Emsa(model + " --gpu-mem 4GiB");
  EXPECT_EQ(r.code, 3);
  EXPECT_TRUE(r.out.empty()) << r.out;
  const std::string need = "needs at least " + FormatBytes(min_budget);
  EXPECT_NE(r.err.find(need + " of device memory with the host tier"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the budget is 4.00 GiB"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--gpu-mem " + std::to_string(min_budget)), std::string::npos) << r.err;
  // Checkpointing and bf16 are in use, so only the shape is left to shrink.
  EXPECT_NE(r.err.find("to need less: a smaller --batch or --seq"), std::string::npos) << r.err;
  // The budget named is exactly the smallest that works.
  EXPECT_EQ(Emsa(model + " --summary --gpu-mem " + std::to_string(min_budget)).code, 0);
  EXPECT_EQ(Emsa(model + " --summary --gpu-mem " + std::to_string(min_budget - 1)).code, 3);
  // Without the default step in backward every gradient stays: it needs more.
  Outcome keep = Emsa(model + " --gpu-mem 4GiB --keep-grads");
  EXPECT_EQ(keep.code, 3);
  EXPECT_NE(keep.err.find("--step-in-backward"), std::string::npos) << keep.err;
}

TEST_F(PlanModelCli, BadInputExitsTwoWithAMessage) {
  ASSERT_TRUE(json::WriteFile(Path("gemma.json"), R"({"model_type": "gemma"})").ok());
  ASSERT_TRUE(json::WriteFile(Path("nolayers.json"),
                              R"({"model_type": "llama", "hidden_size": 64,
                                  "intermediate_size": 128, "num_attention_heads": 4,
                                  "vocab_size": 100})")
                  .ok());
  struct Case {
    std::string args, says;
  } cases[] = {
      {"plan --model llama-9", "not a preset (gpt2-xl, llama-2-7b"},
      {"plan --model '" + Path("gemma.json") + "'", "model_type: \"gemma\" is not supported"},
      {"plan --model '" + Path("nolayers.json") + "'", "num_hidden_layers: missing"},
      {"plan --model '" + Path("absent.json") + "'", "absent.json"},
      {"plan --model llama-2-7b --batch 0", "--batch '0' is not a positive whole number"},
      {"plan --model llama-2-7b --seq 1e3", "--seq '1e3' is not a positive whole number"},
      {"plan --model gpt2-xl --seq 4096", "exceeds gpt2-xl's n_positions 1024"},
      {"plan --model llama-2-7b --param-dtype int8", "--param-dtype 'int8' is not supported"},
      {"plan --model llama-2-7b --device tpu", "a100-40gb, h200, rtx-4090, or 'this'"},
      {"plan --model llama-2-7b --gpu-mem lots", "--gpu-mem"},
      {"plan --model llama-2-7b --gpu-mem 24GiB --budget 24GiB", "give one"},
      {"plan --model llama-2-7b --device h200 --profile x.json", "give one"},
      {"plan --model llama-2-7b --keep-grads --step-in-backward", "contradict"},
      {"plan --model llama-2-7b probe.json", "not both"},
      {"plan probe.json --batch 2", "--batch goes with --model"},
      {"plan probe.json --gpu-mem 2GiB", "--gpu-mem goes with --model"},
      {"plan --checkpointing", "--checkpointing goes with --model"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.args);
    Outcome r = Emsa(k.args);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find(k.says), std::string::npos) << r.err;
  }
}

// Splits text into lines (without their '\n').
std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = text.find('\n', begin);
    out.push_back(text.substr(begin, end - begin));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return out;
}

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_F(PlanModelCli, TheVerdictComesFirstAndTheDefaultIsShort) {
  Outcome r = Emsa("plan --model llama-2-7b --gpu-mem 24GiB --batch 1 --seq 2048 --checkpointing");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<std::string> lines = Lines(r.out);
  EXPECT_LE(lines.size(), 40u) << r.out;
  ASSERT_GE(lines.size(), 5u);
  std::string head;
  for (size_t i = 0; i < 5; ++i) head += lines[i] + "\n";
  EXPECT_EQ(lines[0].rfind("fits         yes: peak device memory ", 0), 0u) << head;
  for (const char* part : {"of the card's 140.40 GiB", "(budget 24.00 GiB)", "ms predicted",
                           "tokens/s (2,048 tokens a step)", "pinned for the host tier",
                           "of the host's 128.00 GiB", "parameters' state on the device"}) {
    EXPECT_TRUE(Has(head, part)) << part << "\n" << head;
  }
}

TEST_F(PlanModelCli, ABudgetAboveTheCardIsRefusedNamingItsMemory) {
  Outcome r = Emsa("plan --model llama-3-8b --gpu-mem 30GiB --device rtx-4090 --checkpointing");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(Has(r.err,
                  "--gpu-mem 30.00 GiB is more than the 23.99 GiB of the NVIDIA GeForce "
                  "RTX 4090 (preset rtx-4090)"))
      << r.err;
  EXPECT_EQ(Emsa("plan --model llama-3-8b --gpu-mem 20GiB --device rtx-4090 --checkpointing "
                 "--state-dtype bf16 --param-dtype bf16 --json -")
                    .code == 2,
            false);
}

TEST_F(PlanModelCli, HostMemoryAboveTheHostsDoesNotFit) {
  // 8B parameters' fp32 state and masters in the host tier need about 120 GiB; the RTX 4090
  // preset's desktop has 64 GiB.
  Outcome r = Emsa("plan --model llama-3-8b --gpu-mem 20GiB --device rtx-4090 --checkpointing");
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_EQ(r.out.rfind("fits         no: the host tier needs ", 0), 0u) << r.out;
  EXPECT_TRUE(Has(Lines(r.out)[0], "more than the host's 64.00 GiB")) << r.out;
  EXPECT_TRUE(Has(r.err, "more than the host's 64.00 GiB")) << r.err;
}

TEST_F(PlanModelCli, WithoutAGpuThePlanSpeaksOfHostMemory) {
  DeviceProfile cpu_only;
  cpu_only.cpu.model = "test CPU";
  cpu_only.cpu.logical_cores = 2;
  cpu_only.cpu.host_mem_bandwidth = 10e9;
  cpu_only.cpu.host_update_bandwidth = 9e9;
  for (const int gib : {64, 8}) {
    SCOPED_TRACE(gib);
    cpu_only.cpu.host_memory = uint64_t(gib) << 30;
    ASSERT_TRUE(json::WriteFile(Path("cpu.json"), DeviceProfileToJson(cpu_only)).ok());
    Outcome r = Emsa("plan --model tinyllama-1.1b --seq 256 --profile '" + Path("cpu.json") + "'");
    // 1.1B parameters with fp32 state need about 20 GiB of host memory.
    const bool fits = gib == 64;
    EXPECT_EQ(r.code, fits ? 0 : 3) << r.err;
    EXPECT_EQ(r.out.rfind(
                  std::string("fits         ") + (fits ? "yes" : "no") + ": peak host memory ", 0),
              0u)
        << r.out;
    const std::string of = "of the host's " + std::to_string(gib) + ".00 GiB";
    for (const std::string& part :
         {of, std::string("no GPU"), std::string("L1 (in RAM)"), std::string("peak host memory")}) {
      EXPECT_TRUE(Has(r.out, part)) << part << "\n" << r.out;
    }
    for (const char* absent : {"HBM", "peak device memory", "L1 (device)", "on the device"}) {
      EXPECT_FALSE(Has(r.out, absent)) << absent << "\n" << r.out;
    }
  }
}

TEST_F(PlanModelCli, ListNamesThePresetsAndTheModelTypes) {
  Outcome r = Emsa("plan --list");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(Has(r.out, "model presets:  gpt2-xl, llama-2-7b")) << r.out;
  EXPECT_TRUE(Has(r.out, "device presets: a100-40gb, h200, rtx-4090, this")) << r.out;
  EXPECT_TRUE(Has(r.out, "model_type llama, mistral, qwen2")) << r.out;
}

TEST_F(PlanModelCli, ABareFolderNameIsAModel) {
  ASSERT_EQ(std::system(("mkdir -p '" + Path("cfg-llama") + "'").c_str()), 0);
  ASSERT_TRUE(
      json::WriteFile(Path("cfg-llama/config.json"), ModelPresetText("tinyllama-1.1b").value())
          .ok());
  Outcome bare = Emsa("plan --model cfg-llama --seq 256 --json -", dir_);
  ASSERT_EQ(bare.code, 0) << bare.err;
  Outcome dotted = Emsa("plan --model ./cfg-llama --seq 256 --json -", dir_);
  ASSERT_EQ(dotted.code, 0) << dotted.err;
  EXPECT_EQ(bare.out, dotted.out);
  Outcome missing = Emsa("plan --model no-such-model");
  EXPECT_EQ(missing.code, 2);
  EXPECT_TRUE(Has(missing.err, "is not a preset")) << missing.err;
}

TEST_F(PlanModelCli, HelpListsThePresets) {
  Outcome r = Emsa("--help");
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("emsa plan --model NAME|PATH"), std::string::npos);
  EXPECT_NE(r.out.find("model presets:  gpt2-xl, llama-2-7b, llama-3-8b"), std::string::npos);
  EXPECT_NE(r.out.find("device presets: a100-40gb, h200, rtx-4090, this"), std::string::npos);
}

}  // namespace
}  // namespace emsa
