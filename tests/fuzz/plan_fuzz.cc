// libFuzzer target: MakePlan on a probe record and a device profile read from the input, the two
// JSON documents separated by the first NUL byte (the seeds are an example probe, NUL, a
// profile). Planned at the default budget and at a quarter of the smallest one that works.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "emsa/plan.h"
#include "emsa/probe_record.h"
#include "emsa/profile.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  if (nul == std::string::npos) return 0;
  emsa::Result<emsa::ProbeRecord> record = emsa::ProbeRecordFromJson(input.substr(0, nul));
  if (!record.ok()) return 0;
  emsa::Result<emsa::DeviceProfile> profile = emsa::DeviceProfileFromJson(input.substr(nul + 1));
  if (!profile.ok()) return 0;
  emsa::PlanOptions options;
  uint64_t min_budget = 0;
  emsa::Result<emsa::Plan> plan = emsa::MakePlan(*record, *profile, options, &min_budget);
  if (plan.ok() && plan->min_budget_bytes != min_budget) std::abort();
  options.budget_bytes = min_budget / 4 + 1;
  (void)emsa::MakePlan(*record, *profile, options);
  return 0;
}
