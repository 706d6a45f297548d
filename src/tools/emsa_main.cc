// emsa_main.cc — the `emsa` binary: runs the command (tools/cli.h) and prints what it says.
#include <cstdio>
#include <string>
#include <vector>

#include "tools/cli.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  emsa::Console console;
  const int code = emsa::RunCli(args, &console);
  std::fputs(console.out.c_str(), stdout);
  std::fputs(console.err.c_str(), stderr);
  return code;
}
