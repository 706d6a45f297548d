// tools/cli.h — the `emsa` command as a function: what the binary (emsa_main.cc) runs, and what
// the C ABI's emsa_cli_run runs for the Python package's `emsa` command.
#pragma once

#include <string>
#include <vector>

namespace emsa {

// What a command prints, collected so that a caller without a terminal (the C ABI) gets it too.
struct Console {
  std::string out, err;
};

// Runs `emsa ARGS...` (arguments without the program name); returns the exit code (0 ok, 2
// usage or bad input, 3 the plan does not fit, 1 other errors).
int RunCli(const std::vector<std::string>& args, Console* console);

}  // namespace emsa
