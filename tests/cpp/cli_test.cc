// Tests for the `emsa` command: exit codes, messages, and that `emsa plan --json` writes exactly
// what MakePlan + PlanToJson give. The binary sits next to the tests directory (build/emsa);
// these tests are skipped when it has not been built (e.g. `--target emsa_tests` alone).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "cli_fixture.h"
#include "common/json.h"
#include "emsa/analytic_probe.h"
#include "emsa/plan.h"
#include "emsa/probe_record.h"
#include "emsa/profile.h"

namespace emsa {
namespace {

using Outcome = CliOutcome;

class CliTest : public CliFixture {
 protected:
  void SetUp() override {
    CliFixture::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    DecoderConfig c;
    c.vocab_size = 4000;
    c.hidden_size = 256;
    c.intermediate_size = 704;
    c.num_layers = 4;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.seq_len = 128;
    Result<ProbeRecord> r = AnalyticDecoderProbe(c);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    record_ = *r;
    profile_.cpu.model = "Test CPU";
    profile_.gpu.present = true;
    profile_.gpu.name = "Test GPU";
    profile_.gpu.compute_capability_major = 9;
    profile_.gpu.sm_count = 132;
    profile_.gpu.l2_bytes = 60ull << 20;
    profile_.gpu.total_memory = 80ull << 30;
    profile_.gpu.free_memory = 70ull << 30;
    profile_.gpu.hbm_bandwidth = 3e12;
    profile_.gpu.h2d_bandwidth = 50e9;
    profile_.gpu.d2h_bandwidth = 50e9;
    profile_.cpu.logical_cores = 16;
    profile_.cpu.host_update_bandwidth = 90e9;
    ASSERT_TRUE(SaveProbeRecord(record_, Path("probe.json")).ok());
    ASSERT_TRUE(json::WriteFile(Path("profile.json"), DeviceProfileToJson(profile_)).ok());
  }
  ProbeRecord record_;
  DeviceProfile profile_;
};

TEST_F(CliTest, HelpVersionAndUsageErrors) {
  Outcome help = Emsa("--help");
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("emsa plan PROBE.json"), std::string::npos);
  Outcome version = Emsa("--version");
  EXPECT_EQ(version.code, 0);
  EXPECT_EQ(version.out, "emsa 0.1.0\n");
  EXPECT_EQ(Emsa("").code, 2);
  Outcome unknown = Emsa("frobnicate");
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.err.find("unknown command 'frobnicate'"), std::string::npos) << unknown.err;
}

TEST_F(CliTest, BadPlanInputExitsTwoWithAMessage) {
  const std::string probe = "'" + Path("probe.json") + "'";
  const std::string profile = " --profile '" + Path("profile.json") + "'";
  struct Case {
    std::string args, says;
  } cases[] = {
      {"plan", "needs a probe record"},
      {"plan '" + Path("missing.json") + "'", "missing.json"},
      {"plan " + probe + profile + " --optimizer sgd", "adamw, adam or lion"},
      {"plan " + probe + profile + " --state-dtype fp16", "fp32 or bf16"},
      {"plan " + probe + profile + " --budget '12 parsecs'", "unknown unit 'parsecs'"},
      {"plan " + probe + profile + " --budget=0", "--budget 0"},
      {"plan " + probe + profile + " --budget", "--budget needs a value"},
      {"plan " + probe + profile + " --colour", "unknown option '--colour'"},
      {"plan " + probe + profile + " --all-host --no-host-tier", "contradict"},
      {"plan " + probe + " --profile '" + Path("probe.json") + "'", "profile"},
      {"plan " + probe + profile + " --bucket-bytes 0", "bucket_bytes"},
  };
  for (const Case& c : cases) {
    Outcome run = Emsa(c.args);
    EXPECT_EQ(run.code, 2) << c.args << "\n" << run.err;
    EXPECT_NE(run.err.find(c.says), std::string::npos) << c.args << "\n" << run.err;
  }
}

TEST_F(CliTest, PlanWritesTheSameJsonAsTheLibrary) {
  PlanOptions o;
  o.optimizer = OptimizerKind::kLion;
  o.state_dtype = DType::kBFloat16;
  Result<Plan> unlimited = MakePlan(record_, DeviceProfile{}, o);
  ASSERT_TRUE(unlimited.ok());
  uint64_t floor = 0;  // with this profile's GPU: counts the staging of GPU-updated parameters
  (void)MakePlan(record_, profile_, o, &floor);
  o.budget_bytes = (floor + unlimited->prediction.peak_device_bytes) / 2;
  Result<Plan> plan = MakePlan(record_, profile_, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();

  Outcome run = Emsa("plan '" + Path("probe.json") + "' --profile '" + Path("profile.json") +
                     "' --optimizer lion --state-dtype bf16 --budget " +
                     std::to_string(o.budget_bytes) + " --json '" + Path("plan.json") + "'");
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_EQ(json::ReadFile(Path("plan.json")).value(), PlanToJson(*plan));
  // The verdict first, then the totals and the prediction; the rows only with --verbose.
  const std::string verdict = PlanVerdict(*plan, profile_, 0) + "\n";
  EXPECT_EQ(run.out, verdict + PlanSummaryToTable(*plan) +
                         "\n(emsa plan --verbose adds one row per parameter)\n");

  for (const char* flag : {"--verbose", "--table"}) {
    Outcome verbose = Emsa("plan '" + Path("probe.json") + "' --profile='" + Path("profile.json") +
                           "' --optimizer=lion --state-dtype=bf16 " + flag +
                           " --budget=" + std::to_string(o.budget_bytes));
    ASSERT_EQ(verbose.code, 0) << verbose.err;
    EXPECT_EQ(verbose.out, verdict + PlanToTable(*plan)) << flag;
  }
}

TEST_F(CliTest, EmbeddedProfileIsUsedWithoutMeasuring) {
  record_.has_profile = true;
  record_.profile = profile_;
  ASSERT_TRUE(SaveProbeRecord(record_, Path("probe.json")).ok());
  Result<Plan> plan = MakePlan(record_, profile_, PlanOptions{});
  ASSERT_TRUE(plan.ok());
  Outcome run = Emsa("plan '" + Path("probe.json") + "' --json -");
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_EQ(run.out, PlanToJson(*plan));
  EXPECT_EQ(run.err.find("measuring"), std::string::npos) << run.err;
}

TEST_F(CliTest, InfeasibleBudgetExitsThreeWithTheMinimum) {
  Result<Plan> plan = MakePlan(record_, profile_, PlanOptions{});
  ASSERT_TRUE(plan.ok());
  const uint64_t min = plan->min_budget_bytes;
  Outcome run = Emsa("plan '" + Path("probe.json") + "' --profile '" + Path("profile.json") +
                     "' --budget " + std::to_string(min - 1));
  EXPECT_EQ(run.code, 3) << run.err;
  EXPECT_NE(run.err.find("smallest feasible budget: " + FormatBytes(min) + " (--budget " +
                         std::to_string(min) + ")"),
            std::string::npos)
      << run.err;
  EXPECT_TRUE(run.out.empty());
  Outcome fits = Emsa("plan '" + Path("probe.json") + "' --profile '" + Path("profile.json") +
                      "' --summary --budget " + std::to_string(min));
  EXPECT_EQ(fits.code, 0) << fits.err;
}

TEST_F(CliTest, ProfileWithoutBandwidthPrintsAProfile) {
  Outcome run = Emsa("profile --no-bandwidth");
  ASSERT_EQ(run.code, 0) << run.err;
  Result<DeviceProfile> profile = DeviceProfileFromJson(run.out);
  ASSERT_TRUE(profile.ok()) << profile.status().ToString();
  EXPECT_GT(profile->cpu.logical_cores, 0);
  EXPECT_EQ(profile->cpu.host_update_bandwidth, 0.0);
  EXPECT_EQ(Emsa("profile --fast").code, 2);
}

}  // namespace
}  // namespace emsa
