// cli_fixture.h — a test fixture that runs the `emsa` binary (build/emsa, next to the tests
// directory) in a scratch folder of its own and captures exit code, stdout and stderr. Tests
// skip when the binary has not been built (e.g. `--target emsa_tests` alone).
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "common/json.h"

namespace emsa {

struct CliOutcome {
  int code = -1;
  std::string out, err;
};

class CliFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    char buf[4096];
    const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
    ASSERT_GT(n, 0);
    const std::string self(buf, static_cast<size_t>(n));
    cli_ = self.substr(0, self.rfind('/')) + "/../emsa";
    if (access(cli_.c_str(), X_OK) != 0) GTEST_SKIP() << "the emsa binary is not built at " << cli_;
    dir_ = ::testing::TempDir() + "emsa_cli_" + std::to_string(getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::error_code made;
    std::filesystem::create_directories(dir_, made);
    ASSERT_FALSE(made) << dir_ << ": " << made.message();
  }
  void TearDown() override {
    std::error_code ignored;  // a scratch folder left behind is no test failure
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Runs `emsa ARGS` in the test's working directory, or in `cwd` when given.
  CliOutcome Emsa(const std::string& args, const std::string& cwd = "") const {
    CliOutcome run;
    const std::string cmd = (cwd.empty() ? "" : "cd '" + cwd + "' && ") + "'" + cli_ + "' " + args +
                            " >'" + Path("out.txt") + "' 2>'" + Path("err.txt") + "'";
    const int status = std::system(cmd.c_str());
    run.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    run.out = json::ReadFile(Path("out.txt")).value();
    run.err = json::ReadFile(Path("err.txt")).value();
    return run;
  }

  std::string cli_, dir_;
};

}  // namespace emsa
