// libFuzzer target: DecoderConfigFromHfJson (a Hugging Face config.json) on any bytes.
#include <cstddef>
#include <cstdint>
#include <string>

#include "emsa/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  (void)emsa::DecoderConfigFromHfJson(text, "fuzz");
  return 0;
}
