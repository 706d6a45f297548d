// device_arena.cc — one device allocation per plan through the CUDA virtual-memory API, with
// cudaMalloc as the named fallback; zero-filled once, freed once.
#include "emsa/device_arena.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "common/cuda_util.h"

#if EMSA_HAVE_CUDA
#include <cuda.h>  // types only: the driver is reached through entry points, never linked
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <mutex>
#endif

namespace emsa {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
[[maybe_unused]] constexpr uint64_t kArenaAlignment =
    2 * kMiB;                                      // DESIGN.md: the arena is 2 MiB-aligned
constexpr uint64_t kMaxBytes = uint64_t{1} << 50;  // 1 PiB: larger is a units mistake

std::atomic<uint64_t> g_release_errors{0};
[[maybe_unused]] std::atomic<bool> g_release_error_logged{false};

Status CheckSize(uint64_t bytes) {
  if (bytes == 0 || bytes > kMaxBytes) {
    return Status::InvalidArgument("device arena size must be between 1 byte and 1 PiB, got " +
                                   std::to_string(bytes) + " bytes");
  }
  return Status::Ok();
}

#if EMSA_HAVE_CUDA

uint64_t RoundUp(uint64_t value, uint64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

void CountReleaseError(const std::string& what) {
  g_release_errors.fetch_add(1, std::memory_order_relaxed);
  if (!g_release_error_logged.exchange(true)) {
    std::fprintf(stderr,
                 "emsa: freeing a device arena failed (%s); further failures are counted "
                 "silently\n",
                 what.c_str());
  }
}

// Ask for the ABI of CUDA 12.0: every VMM entry point kept the signature it had in 10.2, so the
// cudaTypedefs.h v10020 types match, and any driver that runs this cudart provides them.
constexpr unsigned int kDriverApiVersion = 12000;

struct DriverApi {
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 get_granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  std::string missing;  // why the table is incomplete; empty when every entry was found
};

template <typename Fn>
void LookUp(const char* symbol, Fn* fn, std::string* missing) {
  void* pointer = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &pointer, kDriverApiVersion,
                                                           cudaEnableDefault, &found);
  if (err == cudaSuccess && found == cudaDriverEntryPointSuccess && pointer != nullptr) {
    *fn = reinterpret_cast<Fn>(pointer);
    return;
  }
  (void)cudaGetLastError();
  if (missing->empty()) {
    *missing = std::string("the CUDA driver does not provide ") + symbol + " (" +
               (err != cudaSuccess ? cudaGetErrorName(err) : "symbol not found") + ")";
  }
}

// Looked up once per process, after a device has been found usable: without a driver the lookup
// itself fails, and that answer must not be cached before the caller knows there is no device.
const DriverApi& Driver() {
  static DriverApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    LookUp("cuGetErrorName", &api.get_error_name, &api.missing);
    LookUp("cuDeviceGet", &api.device_get, &api.missing);
    LookUp("cuDeviceGetAttribute", &api.device_get_attribute, &api.missing);
    LookUp("cuMemGetAllocationGranularity", &api.get_granularity, &api.missing);
    LookUp("cuMemAddressReserve", &api.address_reserve, &api.missing);
    LookUp("cuMemAddressFree", &api.address_free, &api.missing);
    LookUp("cuMemCreate", &api.create, &api.missing);
    LookUp("cuMemRelease", &api.release, &api.missing);
    LookUp("cuMemMap", &api.map, &api.missing);
    LookUp("cuMemUnmap", &api.unmap, &api.missing);
    LookUp("cuMemSetAccess", &api.set_access, &api.missing);
  });
  return api;
}

std::string DriverError(CUresult result, const std::string& what) {
  const char* name = nullptr;
  if (Driver().get_error_name == nullptr ||
      Driver().get_error_name(result, &name) != CUDA_SUCCESS || name == nullptr) {
    name = "unknown CUresult";
  }
  return what + ": " + name + " (" + std::to_string(static_cast<int>(result)) + ")";
}

// Makes `device` current for one scope and gives the caller back its own afterwards.
class ScopedDevice {
 public:
  Status Enter(int device) {
    EMSA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous_));
    if (previous_ != device) {
      EMSA_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice for the device arena"));
      restore_ = true;
    }
    return Status::Ok();
  }
  ~ScopedDevice() {
    if (restore_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

CUmemAllocationProp DeviceProp(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

#endif  // EMSA_HAVE_CUDA

}  // namespace

const char* DeviceArenaKindName(DeviceArena::Kind kind) {
  return kind == DeviceArena::Kind::kVmm ? "vmm" : "cudaMalloc";
}

uint64_t DeviceArena::ReleaseErrorCount() {
  return g_release_errors.load(std::memory_order_relaxed);
}

#if !EMSA_HAVE_CUDA

Result<std::unique_ptr<DeviceArena>> DeviceArena::Create(uint64_t bytes, int device,
                                                         const Options& options) {
  EMSA_RETURN_IF_ERROR(CheckSize(bytes));
  return Status::Unsupported(
      "this emsa build has no CUDA support, so it cannot allocate a device arena; rebuild with "
      "the CUDA toolkit or keep all optimizer state on the host tier");
}
DeviceArena::~DeviceArena() = default;
Status DeviceArena::MapVmm() { return Status::Unsupported("no CUDA"); }
Status DeviceArena::AllocateCudaMalloc() { return Status::Unsupported("no CUDA"); }
void DeviceArena::Release() {}

#else  // EMSA_HAVE_CUDA

Result<std::unique_ptr<DeviceArena>> DeviceArena::Create(uint64_t bytes, int device,
                                                         const Options& options) {
  EMSA_RETURN_IF_ERROR(CheckSize(bytes));
  int count = 0;
  const cudaError_t count_err = cudaGetDeviceCount(&count);
  if (count_err != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return Status::Unsupported(
        std::string("a device arena needs a usable CUDA device and this process has none (") +
        (count_err != cudaSuccess ? cudaGetErrorName(count_err) : "0 devices") +
        "); run on a GPU machine or keep all optimizer state on the host tier");
  }
  if (device < 0 || device >= count) {
    return Status::InvalidArgument("device arena: device " + std::to_string(device) +
                                   " does not exist; this process sees " + std::to_string(count) +
                                   " CUDA device(s), numbered from 0");
  }
  ScopedDevice scope;
  EMSA_RETURN_IF_ERROR(scope.Enter(device));

  std::unique_ptr<DeviceArena> arena(new DeviceArena());
  arena->size_ = bytes;
  arena->device_ = device;
  if (!options.allow_vmm) {
    arena->fallback_reason_ = "Options::allow_vmm is false";
  } else {
    const Status vmm = arena->MapVmm();
    if (vmm.ok()) {
      arena->kind_ = Kind::kVmm;
    } else {
      arena->fallback_reason_ = vmm.message();
    }
  }
  if (arena->kind_ == Kind::kCudaMalloc) EMSA_RETURN_IF_ERROR(arena->AllocateCudaMalloc());

  // Zero once: the engine relies on exp_avg and exp_avg_sq starting at zero, and the whole
  // mapping, padding included, so that no byte an oversized load might touch is garbage.
  EMSA_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(arena->data_, 0, arena->mapped_bytes_, options.zero_stream),
                 "cudaMemsetAsync zero-filling the device arena"));
  if (options.wait_for_zero_fill) {
    EMSA_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(options.zero_stream),
                                    "cudaStreamSynchronize after zero-filling the device arena"));
  }
  return arena;
}

// Leaves the arena untouched on failure (everything acquired here is given back), so Create()
// can fall back to cudaMalloc; the returned message becomes fallback_reason().
Status DeviceArena::MapVmm() {
  const DriverApi& driver = Driver();
  if (!driver.missing.empty()) return Status::Unsupported(driver.missing);

  CUdevice cu_device = 0;
  CUresult result = driver.device_get(&cu_device, device_);
  if (result != CUDA_SUCCESS) return Status::CudaError(DriverError(result, "cuDeviceGet"));
  int supported = 0;
  result = driver.device_get_attribute(
      &supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cu_device);
  if (result != CUDA_SUCCESS) {
    return Status::CudaError(DriverError(result, "cuDeviceGetAttribute(VMM supported)"));
  }
  if (supported == 0) {
    return Status::Unsupported("device " + std::to_string(device_) +
                               " does not support the CUDA virtual-memory API");
  }

  const CUmemAllocationProp prop = DeviceProp(device_);
  size_t granularity = 0;
  result = driver.get_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (result != CUDA_SUCCESS || granularity == 0) {
    return Status::CudaError(DriverError(result, "cuMemGetAllocationGranularity"));
  }
  // Both are powers of two, so the larger is a multiple of the smaller.
  const uint64_t granule = granularity > kArenaAlignment ? granularity : kArenaAlignment;
  const uint64_t bytes = RoundUp(size_, granule);

  CUdeviceptr va = 0;
  result = driver.address_reserve(&va, bytes, granule, 0, 0);
  if (result != CUDA_SUCCESS) return Status::CudaError(DriverError(result, "cuMemAddressReserve"));
  CUmemGenericAllocationHandle handle = 0;
  result = driver.create(&handle, bytes, &prop, 0);
  if (result != CUDA_SUCCESS) {
    (void)driver.address_free(va, bytes);
    return Status::CudaError(
        DriverError(result, "cuMemCreate(" + std::to_string(bytes) + " bytes)"));
  }
  result = driver.map(va, bytes, 0, handle, 0);
  if (result != CUDA_SUCCESS) {
    (void)driver.release(handle);
    (void)driver.address_free(va, bytes);
    return Status::CudaError(DriverError(result, "cuMemMap"));
  }
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  result = driver.set_access(va, bytes, &access, 1);
  if (result != CUDA_SUCCESS) {
    (void)driver.unmap(va, bytes);
    (void)driver.release(handle);
    (void)driver.address_free(va, bytes);
    return Status::CudaError(DriverError(result, "cuMemSetAccess"));
  }
  data_ = reinterpret_cast<void*>(static_cast<uintptr_t>(va));
  mapped_bytes_ = bytes;
  granularity_ = granule;
  vmm_handle_ = handle;
  return Status::Ok();
}

Status DeviceArena::AllocateCudaMalloc() {
  granularity_ = kArenaAlignment;
  mapped_bytes_ = RoundUp(size_, kArenaAlignment);
  // Large cudaMalloc blocks are 2 MiB-aligned in practice but not by contract: retry with one
  // granule of slack when this one is not.
  for (const uint64_t slack : {uint64_t{0}, kArenaAlignment}) {
    void* base = nullptr;
    const cudaError_t err = cudaMalloc(&base, mapped_bytes_ + slack);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      (void)cudaMemGetInfo(&free_bytes, &total_bytes);
      (void)cudaGetLastError();
      std::string message = "cannot allocate a device arena of " +
                            std::to_string(mapped_bytes_ + slack) + " bytes on device " +
                            std::to_string(device_) + " (" + std::to_string(free_bytes) + " of " +
                            std::to_string(total_bytes) +
                            " bytes free; cudaMalloc: " + cudaGetErrorName(err) + ")";
      if (!fallback_reason_.empty()) message += "; VMM was not used: " + fallback_reason_;
      if (err == cudaErrorMemoryAllocation) {
        return Status::OutOfMemory(message + "; lower the device budget");
      }
      return Status::CudaError(message);
    }
    const uintptr_t address = reinterpret_cast<uintptr_t>(base);
    const uintptr_t aligned = RoundUp(address, kArenaAlignment);
    if (aligned + mapped_bytes_ <= address + mapped_bytes_ + slack) {
      malloc_base_ = base;
      malloc_bytes_ = mapped_bytes_ + slack;
      data_ = reinterpret_cast<void*>(aligned);
      return Status::Ok();
    }
    (void)cudaFree(base);
  }
  return Status::Internal("cudaMalloc with 2 MiB of slack still gave no 2 MiB-aligned range");
}

DeviceArena::~DeviceArena() { Release(); }

void DeviceArena::Release() {
  if (data_ == nullptr) return;
  ScopedDevice scope;
  const Status entered = scope.Enter(device_);
  if (!entered.ok()) CountReleaseError(entered.message());
  if (kind_ == Kind::kCudaMalloc) {
    // cudaFree waits for the device by itself.
    const cudaError_t err = cudaFree(malloc_base_);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      CountReleaseError(std::string("cudaFree: ") + cudaGetErrorName(err));
    }
  } else {
    // Unmapping does not wait for kernels that may still read the range; freeing happens at the
    // end of a run, so a device-wide wait costs nothing that matters.
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      CountReleaseError(std::string("cudaDeviceSynchronize before unmapping: ") +
                        cudaGetErrorName(err));
    }
    const DriverApi& driver = Driver();
    const CUdeviceptr va = reinterpret_cast<uintptr_t>(data_);
    CUresult result = driver.unmap(va, mapped_bytes_);
    if (result != CUDA_SUCCESS) CountReleaseError(DriverError(result, "cuMemUnmap"));
    result = driver.release(vmm_handle_);
    if (result != CUDA_SUCCESS) CountReleaseError(DriverError(result, "cuMemRelease"));
    result = driver.address_free(va, mapped_bytes_);
    if (result != CUDA_SUCCESS) CountReleaseError(DriverError(result, "cuMemAddressFree"));
  }
  data_ = nullptr;
  malloc_base_ = nullptr;
  vmm_handle_ = 0;
}

#endif  // EMSA_HAVE_CUDA

}  // namespace emsa
