// libFuzzer target: json::Parse on any bytes; what it accepts, json::Write writes and Parse reads
// back.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  emsa::Result<emsa::json::Value> doc = emsa::json::Parse(text);
  if (!doc.ok()) return 0;
  if (!emsa::json::Parse(emsa::json::Write(*doc)).ok()) std::abort();
  return 0;
}
