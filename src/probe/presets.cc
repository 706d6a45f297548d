// presets.cc — the preset files compiled into the library: lookup by name, and device presets
// read as DeviceProfile plus the matmul rate the analytic probe should assume.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/json.h"
#include "emsa/model_config.h"
#include "probe/embedded_presets.h"

namespace emsa {
namespace {

using presets_internal::EmbeddedFile;
using presets_internal::kEmbeddedFileCount;
using presets_internal::kEmbeddedFiles;

std::vector<std::string> Names(const std::string& kind) {
  std::vector<std::string> out;
  for (size_t i = 0; i < kEmbeddedFileCount; ++i) {
    if (kind == kEmbeddedFiles[i].kind) out.emplace_back(kEmbeddedFiles[i].name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

Result<std::string> Text(const std::string& kind, const char* what, const std::string& name) {
  for (size_t i = 0; i < kEmbeddedFileCount; ++i) {
    const EmbeddedFile& f = kEmbeddedFiles[i];
    if (kind == f.kind && name == f.name) {
      return std::string(reinterpret_cast<const char*>(f.data), f.size);
    }
  }
  return Status::NotFound(std::string("no ") + what + " preset named '" + name +
                          "'; the presets are " + Join(Names(kind)));
}

}  // namespace

std::vector<std::string> ModelPresetNames() { return Names("models"); }
std::vector<std::string> DevicePresetNames() { return Names("devices"); }

Result<std::string> ModelPresetText(const std::string& name) {
  return Text("models", "model", name);
}

Result<std::string> DevicePresetText(const std::string& name) {
  return Text("devices", "device", name);
}

Result<DevicePreset> DevicePresetFromJson(const std::string& text) {
  DevicePreset preset;
  EMSA_ASSIGN_OR_RETURN(preset.profile, DeviceProfileFromJson(text));
  // The profile parsed, so the text is a JSON object; only the extra key remains to read.
  EMSA_ASSIGN_OR_RETURN(json::Value root, json::Parse(text));
  const json::Reader reader(root, "profile");
  EMSA_ASSIGN_OR_RETURN(preset.matmul_flops, reader.Number("matmul_flops", 0.0));
  if (reader.Has("matmul_flops") && !(preset.matmul_flops > 0.0)) {
    return reader.Error("matmul_flops", "must be a positive FLOP/s rate (or absent)");
  }
  return preset;
}

Result<DevicePreset> LoadDevicePreset(const std::string& name) {
  EMSA_ASSIGN_OR_RETURN(std::string text, DevicePresetText(name));
  auto preset = DevicePresetFromJson(text);
  if (!preset.ok()) {
    return Status::Internal("the built-in device preset '" + name +
                            "' does not parse: " + preset.status().message());
  }
  return preset;
}

}  // namespace emsa
