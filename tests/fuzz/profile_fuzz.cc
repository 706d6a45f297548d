// libFuzzer target: DeviceProfileFromJson and DevicePresetFromJson on any bytes; a profile either
// accepts writes back.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "emsa/model_config.h"
#include "emsa/profile.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  emsa::Result<emsa::DeviceProfile> profile = emsa::DeviceProfileFromJson(text);
  if (profile.ok() && !emsa::DeviceProfileFromJson(emsa::DeviceProfileToJson(*profile)).ok()) {
    std::abort();
  }
  emsa::Result<emsa::DevicePreset> preset = emsa::DevicePresetFromJson(text);
  if (preset.ok() &&
      !emsa::DeviceProfileFromJson(emsa::DeviceProfileToJson(preset->profile)).ok()) {
    std::abort();
  }
  return 0;
}
