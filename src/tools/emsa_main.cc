// emsa_main.cc — the `emsa` binary: runs the command (tools/cli.h) and prints what it says.
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "tools/cli.h"

// Nothing escapes as a signal: the inputs' limits keep memory small, and should an allocation
// fail anyway the answer is a message and an exit code.
int main(int argc, char** argv) {
  try {
    const std::vector<std::string> args(argv + 1, argv + argc);
    emsa::Console console;
    const int code = emsa::RunCli(args, &console);
    std::fputs(console.out.c_str(), stdout);
    std::fputs(console.err.c_str(), stderr);
    return code;
  } catch (const std::bad_alloc&) {
    std::fputs("emsa: out of memory\n", stderr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emsa: internal error: %s\n", e.what());
  }
  return 1;
}
