// libFuzzer target: ProbeRecordFromJson on any bytes; a record it accepts passes
// ValidateProbeRecord and writes back.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "emsa/probe_record.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  emsa::Result<emsa::ProbeRecord> record = emsa::ProbeRecordFromJson(text);
  if (!record.ok()) return 0;
  if (!emsa::ValidateProbeRecord(*record).ok()) std::abort();
  if (!emsa::ProbeRecordFromJson(emsa::ProbeRecordToJson(*record)).ok()) std::abort();
  return 0;
}
