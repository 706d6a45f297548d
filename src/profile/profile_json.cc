// profile_json.cc — DeviceProfile to and from JSON, so that a profile taken on one machine can
// be planned against on another.
//
// Reading is strict about what it knows and lenient about what it does not: every known field
// is required and type-checked (errors name it: "profile.cpu.simd: ..."), while unknown keys
// such as a preset's "note" are ignored, so a newer writer's additions do not break older
// readers. When gpu.present is false, the other GPU fields are neither written nor read.
#include <cstdint>
#include <string>

#include "common/json.h"
#include "emsa/profile.h"

namespace emsa {
namespace {

json::Value CpuToJson(const CpuProfile& cpu) {
  json::Value v = json::Value::MakeObject();
  v.Set("model", cpu.model);
  v.Set("logical_cores", cpu.logical_cores);
  v.Set("simd", SimdLevelName(cpu.simd));
  v.Set("host_mem_bandwidth", cpu.host_mem_bandwidth);
  v.Set("host_update_bandwidth", cpu.host_update_bandwidth);
  if (cpu.host_memory != 0) v.Set("host_memory", cpu.host_memory);
  return v;
}

json::Value GpuToJson(const GpuProfile& gpu) {
  json::Value v = json::Value::MakeObject();
  v.Set("present", gpu.present);
  if (!gpu.present) return v;
  v.Set("device", gpu.device);
  v.Set("name", gpu.name);
  v.Set("compute_capability_major", gpu.compute_capability_major);
  v.Set("compute_capability_minor", gpu.compute_capability_minor);
  v.Set("sm_count", gpu.sm_count);
  v.Set("total_memory", gpu.total_memory);
  v.Set("free_memory", gpu.free_memory);
  v.Set("l2_bytes", gpu.l2_bytes);
  v.Set("max_persisting_l2_bytes", gpu.max_persisting_l2_bytes);
  v.Set("hbm_bandwidth", gpu.hbm_bandwidth);
  v.Set("h2d_bandwidth", gpu.h2d_bandwidth);
  v.Set("d2h_bandwidth", gpu.d2h_bandwidth);
  v.Set("duplex_bandwidth", gpu.duplex_bandwidth);
  v.Set("host_update_duplex_bandwidth", gpu.host_update_duplex_bandwidth);
  v.Set("duplex_under_update_bandwidth", gpu.duplex_under_update_bandwidth);
  return v;
}

// An int field in [min_value, INT32_MAX].
Result<int> ReadInt(const json::Reader& r, const char* key, int min_value) {
  EMSA_ASSIGN_OR_RETURN(int64_t v, r.Int(key));
  if (v < min_value || v > INT32_MAX) {
    return r.Error(key, "expected an integer in [" + std::to_string(min_value) + ", 2^31), got " +
                            std::to_string(v));
  }
  return static_cast<int>(v);
}

// A bandwidth in B/s: finite and non-negative (0 means "not measured").
Result<double> ReadBandwidth(const json::Reader& r, const char* key) {
  EMSA_ASSIGN_OR_RETURN(double v, r.Number(key));
  if (v < 0.0) {
    return r.Error(
        key, "expected a non-negative bandwidth in bytes per second, got " + std::to_string(v));
  }
  return v;
}

Result<CpuProfile> CpuFromJson(const json::Reader& r) {
  CpuProfile cpu;
  EMSA_ASSIGN_OR_RETURN(cpu.model, r.String("model"));
  EMSA_ASSIGN_OR_RETURN(cpu.logical_cores, ReadInt(r, "logical_cores", 1));
  EMSA_ASSIGN_OR_RETURN(std::string simd, r.String("simd"));
  Result<SimdLevel> level = ParseSimdLevel(simd);
  if (!level.ok()) {
    return r.Error("simd", "expected one of scalar, avx2, avx512, got \"" + simd + "\"");
  }
  cpu.simd = *level;
  EMSA_ASSIGN_OR_RETURN(cpu.host_mem_bandwidth, ReadBandwidth(r, "host_mem_bandwidth"));
  EMSA_ASSIGN_OR_RETURN(cpu.host_update_bandwidth, ReadBandwidth(r, "host_update_bandwidth"));
  EMSA_ASSIGN_OR_RETURN(cpu.host_memory, r.UInt("host_memory", 0));
  return cpu;
}

Result<GpuProfile> GpuFromJson(const json::Reader& r) {
  GpuProfile gpu;
  EMSA_ASSIGN_OR_RETURN(gpu.present, r.Bool("present"));
  if (!gpu.present) return gpu;
  EMSA_ASSIGN_OR_RETURN(gpu.device, ReadInt(r, "device", 0));
  EMSA_ASSIGN_OR_RETURN(gpu.name, r.String("name"));
  EMSA_ASSIGN_OR_RETURN(gpu.compute_capability_major, ReadInt(r, "compute_capability_major", 0));
  EMSA_ASSIGN_OR_RETURN(gpu.compute_capability_minor, ReadInt(r, "compute_capability_minor", 0));
  EMSA_ASSIGN_OR_RETURN(gpu.sm_count, ReadInt(r, "sm_count", 1));
  EMSA_ASSIGN_OR_RETURN(gpu.total_memory, r.UInt("total_memory"));
  EMSA_ASSIGN_OR_RETURN(gpu.free_memory, r.UInt("free_memory"));
  if (gpu.free_memory > gpu.total_memory) {
    return r.Error("free_memory", std::to_string(gpu.free_memory) + " exceeds total_memory " +
                                      std::to_string(gpu.total_memory));
  }
  EMSA_ASSIGN_OR_RETURN(gpu.l2_bytes, r.UInt("l2_bytes"));
  EMSA_ASSIGN_OR_RETURN(gpu.max_persisting_l2_bytes, r.UInt("max_persisting_l2_bytes"));
  if (gpu.max_persisting_l2_bytes > gpu.l2_bytes) {
    return r.Error("max_persisting_l2_bytes", std::to_string(gpu.max_persisting_l2_bytes) +
                                                  " exceeds l2_bytes " +
                                                  std::to_string(gpu.l2_bytes));
  }
  EMSA_ASSIGN_OR_RETURN(gpu.hbm_bandwidth, ReadBandwidth(r, "hbm_bandwidth"));
  EMSA_ASSIGN_OR_RETURN(gpu.h2d_bandwidth, ReadBandwidth(r, "h2d_bandwidth"));
  EMSA_ASSIGN_OR_RETURN(gpu.d2h_bandwidth, ReadBandwidth(r, "d2h_bandwidth"));
  for (auto [key, field] :
       {std::pair<const char*, double*>{"duplex_bandwidth", &gpu.duplex_bandwidth},
        {"host_update_duplex_bandwidth", &gpu.host_update_duplex_bandwidth},
        {"duplex_under_update_bandwidth", &gpu.duplex_under_update_bandwidth}}) {
    if (r.Has(key)) {  // absent from older profiles
      EMSA_ASSIGN_OR_RETURN(*field, ReadBandwidth(r, key));
    }
  }
  return gpu;
}

}  // namespace

std::string DeviceProfileToJson(const DeviceProfile& profile) {
  json::Value v = json::Value::MakeObject();
  v.Set("version", DeviceProfile::kVersion);
  v.Set("cpu", CpuToJson(profile.cpu));
  v.Set("gpu", GpuToJson(profile.gpu));
  return json::Write(v);
}

Result<DeviceProfile> DeviceProfileFromJson(const std::string& text) {
  Result<json::Value> parsed = json::Parse(text);
  if (!parsed.ok()) return parsed.status().Annotate("profile");
  const json::Value& doc = *parsed;
  json::Reader root(doc, "profile");
  if (!doc.is_object()) return root.Error("", "expected a JSON object");
  EMSA_ASSIGN_OR_RETURN(int64_t version, root.Int("version"));
  if (version != DeviceProfile::kVersion) {
    return root.Error("version", "this emsa reads device profiles of version " +
                                     std::to_string(DeviceProfile::kVersion) + ", got " +
                                     std::to_string(version) + "; measure the profile again");
  }
  DeviceProfile profile;
  EMSA_ASSIGN_OR_RETURN(json::Reader cpu, root.Object("cpu"));
  EMSA_ASSIGN_OR_RETURN(profile.cpu, CpuFromJson(cpu));
  EMSA_ASSIGN_OR_RETURN(json::Reader gpu, root.Object("gpu"));
  EMSA_ASSIGN_OR_RETURN(profile.gpu, GpuFromJson(gpu));
  return profile;
}

}  // namespace emsa
