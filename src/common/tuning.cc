// tuning.cc — the one C++ file that calls getenv (tuning.h).
#include "common/tuning.h"

#include <cstdlib>

namespace emsa {
namespace tuning {

std::string MaxSimd() {
  const char* text = std::getenv("EMSA_MAX_SIMD");
  return text == nullptr ? std::string() : std::string(text);
}

}  // namespace tuning
}  // namespace emsa
