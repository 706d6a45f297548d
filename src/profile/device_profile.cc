// device_profile.cc — the whole profile: the CPU half, then the GPU half.
#include "emsa/profile.h"

namespace emsa {

Result<DeviceProfile> MeasureDeviceProfile(const ProfileOptions& options) {
  DeviceProfile profile;
  EMSA_ASSIGN_OR_RETURN(profile.cpu, MeasureCpuProfile(options));
  EMSA_ASSIGN_OR_RETURN(profile.gpu, MeasureGpuProfile(options));
  return profile;
}

}  // namespace emsa
