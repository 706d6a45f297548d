// device_update.cc — DeviceUpdateTable: the bind-time uploads and the per-step launches (host
// side; the kernels are in the .cu files beside this one; DeviceScalars is device_scalars.cc).
// Validation runs first (device_validate.h); a build without CUDA has device_update_nocuda.cc.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "common/cuda_util.h"
#include "emsa/cuda_update.h"
#include "kernels/cuda/device_table.h"
#include "kernels/cuda/device_validate.h"

namespace emsa {
namespace {

using cuda::ParamKind;
using cuda::Variant;
using device_checks::Name;
using device_checks::TableShape;
using device_checks::ValidateTable;

}  // namespace
}  // namespace emsa

#if EMSA_HAVE_CUDA

#include "kernels/cuda/device_host.h"

namespace emsa {
namespace {

using device_host::Allocate;
using device_host::CurrentDevice;
using device_host::DeviceMemory;
using device_host::FinishUploads;
using device_host::NoDevice;
using device_host::RoundUp;
using device_host::Upload;

// Each pointer the update touches must be memory of `device` that kernels can read.
Status CheckDevicePointer(size_t i, const char* field, const void* p, int device) {
  if (p == nullptr) return Status::Ok();
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::InvalidArgument(Name(i) + "." + field + " is not a CUDA pointer (" +
                                   cudaGetErrorString(err) + "); pass device memory");
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return Status::InvalidArgument(Name(i) + "." + field +
                                   " is not device memory (a host or unknown address); the "
                                   "device tier updates device memory (the host tier is "
                                   "CpuUpdater)");
  }
  if (attr.device != device) {
    return Status::InvalidArgument(Name(i) + "." + field + " is on device " +
                                   std::to_string(attr.device) + ", the table on device " +
                                   std::to_string(device) +
                                   "; create the table with that device current");
  }
  return Status::Ok();
}

uint64_t BytesPerElement(const TensorUpdate& t, OptimizerKind optimizer) {
  const uint64_t state = DTypeSize(t.state_dtype) * (optimizer == OptimizerKind::kLion ? 2 : 4);
  const uint64_t grad = DTypeSize(t.grad_dtype);
  const uint64_t param = t.master != nullptr ? 8 + DTypeSize(t.param_dtype)  // master r+w, param w
                                             : 2 * DTypeSize(t.param_dtype);
  return state + grad + param;
}

constexpr int kGradSlots = DeviceUpdateTable::kGradStagingSlots;

}  // namespace

namespace {

// The table's image before upload: one DeviceTensor per tensor, and the tensors' variants.
struct TableImage {
  std::vector<cuda::DeviceTensor> tensors;
  std::vector<int> variant_of;  // cuda::VariantIndex of each tensor
  uint64_t bytes = 0;           // moved by one update
};

// Each pointer an update touches must be memory of `device` that kernels can read.
// (A stats_only table reads only the gradients.)
Status CheckTablePointers(const TensorUpdate* tensors, size_t count,
                          const DeviceTableOptions& options, int device) {
  const OptimizerKind optimizer = options.optimizer;
  for (size_t i = 0; i < count; ++i) {
    const TensorUpdate& t = tensors[i];
    if (t.numel == 0) continue;
    if (!options.stats_only) {
      EMSA_RETURN_IF_ERROR(CheckDevicePointer(i, "param", t.param, device));
    }
    EMSA_RETURN_IF_ERROR(CheckDevicePointer(i, "grad", t.grad, device));
    if (options.stats_only) continue;
    EMSA_RETURN_IF_ERROR(CheckDevicePointer(i, "exp_avg", t.exp_avg, device));
    if (optimizer != OptimizerKind::kLion) {
      EMSA_RETURN_IF_ERROR(CheckDevicePointer(i, "exp_avg_sq", t.exp_avg_sq, device));
    }
    EMSA_RETURN_IF_ERROR(CheckDevicePointer(i, "master", t.master, device));
  }
  return Status::Ok();
}

// A stats_only table keeps only the gradients; its chunks all go to variant 0, which it never
// launches (the statistics walk every chunk whatever the variant).
TableImage MakeTableImage(const TensorUpdate* tensors, const int32_t* groups, const int64_t* slots,
                          size_t count, const DeviceTableOptions& options) {
  TableImage image;
  image.tensors.resize(count);
  image.variant_of.resize(count);
  const bool stats = options.stats_only;
  for (size_t i = 0; i < count; ++i) {
    const TensorUpdate& t = tensors[i];
    const bool lion = options.optimizer == OptimizerKind::kLion;
    cuda::DeviceTensor& d = image.tensors[i];
    d.param = stats ? nullptr : t.param;
    d.grad = t.grad;
    d.exp_avg = stats ? nullptr : t.exp_avg;
    d.exp_avg_sq = stats || lion ? nullptr : t.exp_avg_sq;
    d.master = stats ? nullptr : t.master;
    d.numel = t.numel;
    d.group = groups != nullptr ? groups[i] : 0;
    d.flags = cuda::TensorFlags(d.param, d.grad, d.exp_avg, d.exp_avg_sq, d.master, d.numel);
    d.grad_dtype = static_cast<uint16_t>(t.grad_dtype);
    d.step_index = slots != nullptr ? static_cast<int32_t>(slots[i]) : d.group;
    d.key = slots != nullptr ? static_cast<int32_t>(i) : d.group;
    if (stats) continue;
    image.variant_of[i] = cuda::VariantIndex(
        {ParamKindOf(t), t.grad_dtype == DType::kFloat32, t.state_dtype == DType::kBFloat16});
    image.bytes += static_cast<uint64_t>(t.numel) * BytesPerElement(t, options.optimizer);
  }
  return image;
}

}  // namespace

// ---- DeviceUpdateTable -------------------------------------------------------------------------

struct DeviceUpdateTable::Impl {
  struct Launch {
    Variant variant;
    int64_t first_chunk = 0;
    int64_t chunk_count = 0;
    int grid = 0;
    bool bulk = false;  // the bulk-copy kernel
  };
  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    for (cudaEvent_t e : slot_done) {
      if (e != nullptr) (void)cudaEventDestroy(e);
    }
    if (pinned != nullptr) (void)cudaFreeHost(pinned);
    if (memory != nullptr) (void)cudaFree(memory);
  }
  // Create's steps, in order.
  std::vector<cuda::DeviceChunk> SortChunks(const TensorUpdate* tensors, size_t count,
                                            const std::vector<int>& variant_of,
                                            int64_t chunk_total);
  Status SizeGrids(const DeviceTableOptions& options, int device, int64_t chunk_total);
  Status AllocateMemory(size_t count, size_t chunk_count);
  Status KeepGrads(const TensorUpdate* tensors, size_t count);
  Status UploadImage(const TableImage& image, const std::vector<cuda::DeviceChunk>& chunks);

  void* memory = nullptr;  // one allocation: tensors | chunks | partials | stats | staged
  cuda::DeviceTensor* tensors = nullptr;
  cuda::DeviceChunk* chunks = nullptr;
  cuda::GradPartial* partials = nullptr;
  cuda::GradTableStats* stats = nullptr;
  std::vector<Launch> launches;
  int stats_grid = 0;

  // SetGradPointers: kGradSlots slots of tensor-count pointers in pinned host memory and their
  // device twins (in `memory`); a slot is reused once its event says the copy and the scatter
  // that read it are done.
  const void** pinned = nullptr;
  const void** staged = nullptr;
  cudaEvent_t slot_done[kGradSlots] = {};
  uint64_t grad_calls = 0;
  std::vector<const void*> grads;  // what the table points at, as of the last enqueued call
  std::vector<int64_t> numels;
  std::vector<uint32_t> grad_sizes;  // bytes per gradient element
};

// The chunks sorted by variant, so one launch per variant.
std::vector<cuda::DeviceChunk> DeviceUpdateTable::Impl::SortChunks(
    const TensorUpdate* tensors, size_t count, const std::vector<int>& variant_of,
    int64_t chunk_total) {
  std::vector<cuda::DeviceChunk> dev_chunks;
  dev_chunks.reserve(static_cast<size_t>(chunk_total));
  for (int v = 0; v < cuda::kVariants; ++v) {
    Launch launch;
    launch.variant = {static_cast<ParamKind>(v / 4), (v & 2) != 0, (v & 1) != 0};
    launch.first_chunk = static_cast<int64_t>(dev_chunks.size());
    for (size_t i = 0; i < count; ++i) {
      if (variant_of[i] != v) continue;
      for (int64_t begin = 0; begin < tensors[i].numel; begin += cuda::kChunkElems) {
        dev_chunks.push_back({begin, static_cast<int32_t>(i), 0});
      }
    }
    launch.chunk_count = static_cast<int64_t>(dev_chunks.size()) - launch.first_chunk;
    if (launch.chunk_count > 0) launches.push_back(launch);
  }
  return dev_chunks;
}

// A persistent grid per launch: as many blocks as fit on the device at once, fewer when there
// are fewer chunks.
Status DeviceUpdateTable::Impl::SizeGrids(const DeviceTableOptions& options, int device,
                                          int64_t chunk_total) {
  int sms = 0;
  EMSA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  bool bulk_available = false;
  if (options.bulk_copy) {
    EMSA_ASSIGN_OR_RETURN(bulk_available, cuda::BulkAvailable(options.optimizer));
  }
  for (Launch& launch : launches) {
    launch.bulk = bulk_available && cuda::BulkVariant(launch.variant);
    EMSA_ASSIGN_OR_RETURN(int per_sm,
                          cuda::UpdateBlocksPerSm(options.optimizer, launch.variant, launch.bulk));
    const int64_t resident = static_cast<int64_t>(per_sm) * sms;
    launch.grid = static_cast<int>(std::min<int64_t>(launch.chunk_count, resident));
  }
  EMSA_ASSIGN_OR_RETURN(int stats_per_sm, cuda::GradStatsBlocksPerSm());
  stats_grid = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(chunk_total, static_cast<int64_t>(stats_per_sm) * sms)));
  return Status::Ok();
}

// One allocation: tensors | chunks | partials | stats | staged, each 256-byte aligned.
Status DeviceUpdateTable::Impl::AllocateMemory(size_t count, size_t chunk_count) {
  const size_t tensors_bytes = RoundUp(count * sizeof(cuda::DeviceTensor), 256);
  const size_t chunks_bytes = RoundUp(chunk_count * sizeof(cuda::DeviceChunk), 256);
  const size_t partials_bytes =
      RoundUp(static_cast<size_t>(stats_grid) * sizeof(cuda::GradPartial), 256);
  const size_t stats_bytes = RoundUp(sizeof(cuda::GradTableStats), 256);
  const size_t slots_bytes = kGradSlots * count * sizeof(void*);
  const size_t alloc =
      tensors_bytes + chunks_bytes + partials_bytes + stats_bytes + RoundUp(slots_bytes, 256);
  DeviceMemory mem;
  EMSA_RETURN_IF_ERROR(Allocate(&mem, alloc, "DeviceUpdateTable::Create"));
  memory = mem.release();
  char* base = static_cast<char*>(memory);
  tensors = reinterpret_cast<cuda::DeviceTensor*>(base);
  chunks = reinterpret_cast<cuda::DeviceChunk*>(base + tensors_bytes);
  partials = reinterpret_cast<cuda::GradPartial*>(base + tensors_bytes + chunks_bytes);
  stats =
      reinterpret_cast<cuda::GradTableStats*>(base + tensors_bytes + chunks_bytes + partials_bytes);
  staged = reinterpret_cast<const void**>(base + tensors_bytes + chunks_bytes + partials_bytes +
                                          stats_bytes);
  return Status::Ok();
}

// SetGradPointers' pinned staging and events, and the gradients the table points at now.
Status DeviceUpdateTable::Impl::KeepGrads(const TensorUpdate* tensors, size_t count) {
  if (count > 0) {
    const size_t slots_bytes = kGradSlots * count * sizeof(void*);
    void* host = nullptr;
    const cudaError_t err = cudaHostAlloc(&host, slots_bytes, cudaHostAllocDefault);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::OutOfMemory(
          "DeviceUpdateTable::Create: cudaHostAlloc of " + std::to_string(slots_bytes) +
          " bytes of pinned staging for SetGradPointers failed (" + cudaGetErrorName(err) + ")");
    }
    pinned = static_cast<const void**>(host);
    for (cudaEvent_t& e : slot_done) {
      EMSA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
  }
  grads.resize(count);
  numels.resize(count);
  grad_sizes.resize(count);
  for (size_t i = 0; i < count; ++i) {
    grads[i] = tensors[i].grad;
    numels[i] = tensors[i].numel;
    grad_sizes[i] = static_cast<uint32_t>(DTypeSize(tensors[i].grad_dtype));
  }
  return Status::Ok();
}

Status DeviceUpdateTable::Impl::UploadImage(const TableImage& image,
                                            const std::vector<cuda::DeviceChunk>& dev_chunks) {
  const char* what = "DeviceUpdateTable::Create: upload";
  EMSA_RETURN_IF_ERROR(Upload(tensors, image.tensors.data(),
                              image.tensors.size() * sizeof(cuda::DeviceTensor), what));
  EMSA_RETURN_IF_ERROR(
      Upload(chunks, dev_chunks.data(), dev_chunks.size() * sizeof(cuda::DeviceChunk), what));
  const cuda::GradTableStats stats0{0.0, 0, -1, 0u, 0u};
  EMSA_RETURN_IF_ERROR(Upload(stats, &stats0, sizeof stats0, what));
  return FinishUploads(what);
}

Result<std::unique_ptr<DeviceUpdateTable>> DeviceUpdateTable::Create(
    const TensorUpdate* tensors, const int32_t* groups, size_t count,
    const DeviceTableOptions& options, const int64_t* slots) {
  TableShape shape;
  EMSA_RETURN_IF_ERROR(ValidateTable(tensors, groups, slots, count, options, &shape));
  if (!CudaDeviceUsable()) return NoDevice("DeviceUpdateTable::Create");
  int device = -1;
  EMSA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  EMSA_RETURN_IF_ERROR(CheckTablePointers(tensors, count, options, device));

  std::unique_ptr<DeviceUpdateTable> table(new DeviceUpdateTable());
  table->impl_ = std::make_unique<Impl>();
  Impl& impl = *table->impl_;
  const TableImage image = MakeTableImage(tensors, groups, slots, count, options);
  const std::vector<cuda::DeviceChunk> dev_chunks =
      impl.SortChunks(tensors, count, image.variant_of, shape.chunks);
  if (options.stats_only) impl.launches.clear();  // statistics only: nothing to launch
  EMSA_RETURN_IF_ERROR(impl.SizeGrids(options, device, shape.chunks));
  EMSA_RETURN_IF_ERROR(impl.AllocateMemory(count, dev_chunks.size()));
  EMSA_RETURN_IF_ERROR(impl.KeepGrads(tensors, count));
  EMSA_RETURN_IF_ERROR(impl.UploadImage(image, dev_chunks));

  table->device_ = device;
  table->options_ = options;
  table->tensor_count_ = count;
  table->total_numel_ = shape.total;
  table->chunk_count_ = shape.chunks;
  table->launch_count_ = impl.launches.size();
  for (const Impl::Launch& l : impl.launches) table->bulk_launch_count_ += l.bulk ? 1 : 0;
  table->bytes_per_update_ = image.bytes;
  table->groups_needed_ = count > 0 ? static_cast<size_t>(shape.max_group) + 1 : 0;
  table->slots_needed_ = static_cast<size_t>(shape.slots_needed);
  table->has_slots_ = slots != nullptr;
  return table;
}

DeviceUpdateTable::~DeviceUpdateTable() = default;

Status DeviceUpdateTable::Update(const DeviceScalars& scalars, cudaStream_t stream) {
  if (options_.stats_only) {
    return Status::InvalidArgument(
        "Update: this table was made with stats_only (gradient statistics only); update the "
        "tensors with a table made without it");
  }
  if (scalars.device() != device_) {
    return Status::InvalidArgument("Update: the scalars live on device " +
                                   std::to_string(scalars.device()) + ", the table on device " +
                                   std::to_string(device_));
  }
  if (scalars.group_count() < groups_needed_) {
    return Status::InvalidArgument("Update: the table uses group " +
                                   std::to_string(groups_needed_ - 1) + " but the scalars have " +
                                   std::to_string(scalars.group_count()) + " groups");
  }
  if (scalars.slot_count() < slots_needed_) {
    return Status::InvalidArgument("Update: the table uses slot " +
                                   std::to_string(slots_needed_ - 1) + " but the scalars have " +
                                   std::to_string(scalars.slot_count()) +
                                   " slots; make them with DeviceScalars::Create(..., slot_count)");
  }
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceUpdateTable::Update"));
  // Slots: the present tensors' steps advance first, on the same stream, so the update kernels
  // below read the advanced steps (torch adds 1 before the update).
  int64_t* slot_steps = has_slots_ ? scalars.device_slot_steps() : nullptr;
  if (slot_steps != nullptr) {
    EMSA_RETURN_IF_ERROR(cuda::LaunchAdvanceSlots(scalars.device_header(), impl_->tensors,
                                                  static_cast<int64_t>(tensor_count_), slot_steps,
                                                  stream));
  }
  for (const Impl::Launch& l : impl_->launches) {
    cuda::UpdateLaunch launch;
    launch.chunks = impl_->chunks + l.first_chunk;
    launch.chunk_count = l.chunk_count;
    launch.tensors = impl_->tensors;
    launch.header = scalars.device_header();
    launch.groups = scalars.device_groups();
    // step_index is the slot with slots, else the group (its step is the record's first field).
    static_assert(offsetof(DeviceGroupScalars, step) == 0 && sizeof(DeviceGroupScalars) % 8 == 0,
                  "group steps are read as an int64 array with a stride");
    launch.steps = slot_steps != nullptr ? slot_steps : &scalars.device_groups()->step;
    launch.step_stride =
        slot_steps != nullptr ? 1 : static_cast<int64_t>(sizeof(DeviceGroupScalars) / 8);
    launch.stochastic_state = options_.rounding == Rounding::kStochastic ? 1 : 0;
    launch.bulk = l.bulk ? 1 : 0;
    launch.grid = l.grid;
    EMSA_RETURN_IF_ERROR(
        cuda::LaunchUpdate(options_.optimizer, l.variant, launch, stream, &window_));
  }
  return Status::Ok();
}

Status DeviceUpdateTable::SetAccessWindow(const DeviceAccessWindow& window) {
  if (window.bytes > 0 && window.base == nullptr) {
    return Status::InvalidArgument("SetAccessWindow: base is null with bytes " +
                                   std::to_string(window.bytes) + "; pass bytes 0 to turn it off");
  }
  if (!(window.hit_ratio >= 0.0f && window.hit_ratio <= 1.0f)) {
    return Status::InvalidArgument("SetAccessWindow: hit_ratio must be in [0, 1], got " +
                                   std::to_string(window.hit_ratio));
  }
  window_ = window;
  return Status::Ok();
}

Status DeviceUpdateTable::AccumulateGradStats(DeviceScalars& scalars, cudaStream_t stream) {
  if (scalars.device() != device_) {
    return Status::InvalidArgument("AccumulateGradStats: the scalars live on device " +
                                   std::to_string(scalars.device()) + ", the table on device " +
                                   std::to_string(device_));
  }
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceUpdateTable::AccumulateGradStats"));
  if (chunk_count_ == 0) return Status::Ok();
  cuda::GradStatsLaunch launch;
  launch.chunks = impl_->chunks;
  launch.chunk_count = chunk_count_;
  launch.tensors = impl_->tensors;
  launch.partials = impl_->partials;
  launch.table_stats = impl_->stats;
  launch.header = scalars.device_header();
  launch.grid = impl_->stats_grid;
  return cuda::LaunchGradStats(launch, stream);
}

Status DeviceUpdateTable::SetGradPointers(const void* const* grads, size_t count,
                                          cudaStream_t stream) {
  if (count != tensor_count_) {
    return Status::InvalidArgument("SetGradPointers: count is " + std::to_string(count) +
                                   " but the table holds " + std::to_string(tensor_count_) +
                                   " tensors; pass one gradient per tensor, in Create's order");
  }
  if (count == 0) return Status::Ok();
  if (grads == nullptr) return Status::InvalidArgument("SetGradPointers: grads is null");
  Impl& impl = *impl_;
  bool changed = false;
  for (size_t i = 0; i < count; ++i) {
    const void* g = grads[i];  // null: the tensor is absent this step (numel 0: nothing to read)
    if (reinterpret_cast<uintptr_t>(g) % impl.grad_sizes[i] != 0) {
      return Status::InvalidArgument(
          "SetGradPointers: grads[" + std::to_string(i) + "] is not aligned to its " +
          std::to_string(impl.grad_sizes[i]) +
          "-byte elements; pass the address of the gradient's first element");
    }
    changed = changed || g != impl.grads[i];
  }
  if (!changed) return Status::Ok();
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceUpdateTable::SetGradPointers"));
  const size_t slot = static_cast<size_t>(impl.grad_calls % kGradSlots);
  // The slot's last copy and scatter must be done before the host overwrites it: normally long
  // ago, unless the host runs kGradSlots calls ahead of the device.
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(impl.slot_done[slot]));
  const void** host = impl.pinned + slot * count;
  const void** dev = impl.staged + slot * count;
  std::memcpy(host, grads, count * sizeof(void*));
  EMSA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dev, host, count * sizeof(void*), cudaMemcpyHostToDevice, stream));
  EMSA_RETURN_IF_ERROR(
      cuda::LaunchSetGrads(impl.tensors, dev, static_cast<int64_t>(count), stream));
  ++impl.grad_calls;
  std::copy(grads, grads + count, impl.grads.begin());
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(impl.slot_done[slot], stream));
  return Status::Ok();
}

Status DeviceUpdateTable::ReadStats(DeviceTableStats* stats, cudaStream_t stream) const {
  if (stats == nullptr) return Status::InvalidArgument("ReadStats: stats is null");
  EMSA_RETURN_IF_ERROR(CurrentDevice(device_, "DeviceUpdateTable::ReadStats"));
  cuda::GradTableStats s{};
  EMSA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&s, impl_->stats, sizeof s, cudaMemcpyDeviceToHost, stream));
  EMSA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  stats->sum_sq = s.sum_sq;
  stats->nonfinite_count = s.nonfinite;
  stats->first_nonfinite_tensor = s.first_bad;
  return Status::Ok();
}

}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
