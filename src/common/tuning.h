// tuning.h — the environment variables libemsa's C++ code reads: all of them, here and nowhere
// else in src/.
//
// Each is an override for tests and A/B runs; none is needed for normal use. CONTRIBUTING.md's
// table "Environment variables" (and python/emsa/_tuning.py's KNOBS) lists the same names and
// meanings: change them together. Each function reads the environment on every call, so a test
// may set a variable for one scope.
#pragma once

#include <string>

namespace emsa {
namespace tuning {

// EMSA_MAX_SIMD: the highest CPU instruction set the kernels may use, as written ("scalar",
// "avx2" or "avx512"; DetectSimdLevel parses it); empty when unset or empty.
std::string MaxSimd();

}  // namespace tuning
}  // namespace emsa
