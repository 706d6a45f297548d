// Tests for the device arena (VMM and cudaMalloc kinds) and DLPack export of arena views.
// Host-side tests run everywhere; device tests skip without a usable CUDA device.
#include "emsa/device_arena.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common/cuda_util.h"
#include "emsa/host_arena.h"
#include "memory/dlpack.h"
#include "memory/dlpack_export.h"

namespace emsa {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

bool HaveDevice() {
#if EMSA_HAVE_CUDA
  return CudaDeviceUsable();
#else
  return false;
#endif
}

// ---- without a device ----------------------------------------------------------------------

TEST(DeviceArenaTest, RejectsBadSizes) {
  auto zero = DeviceArena::Create(0, 0);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  auto huge = DeviceArena::Create((uint64_t{1} << 50) + 1, 0);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument);
}

TEST(DeviceArenaTest, WithoutDeviceCreateIsUnsupportedNotACrash) {
  if (HaveDevice()) GTEST_SKIP() << "a CUDA device is usable here";
  for (const bool allow_vmm : {true, false}) {
    DeviceArena::Options options;
    options.allow_vmm = allow_vmm;
    auto arena = DeviceArena::Create(4 * kMiB, 0, options);
    ASSERT_FALSE(arena.ok());
    EXPECT_EQ(arena.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(arena.status().message().find("host tier"), std::string::npos)
        << arena.status().message();
  }
  EXPECT_EQ(DeviceArena::ReleaseErrorCount(), 0u);
}

TEST(DeviceArenaTest, KindNames) {
  EXPECT_STREQ(DeviceArenaKindName(DeviceArena::Kind::kVmm), "vmm");
  EXPECT_STREQ(DeviceArenaKindName(DeviceArena::Kind::kCudaMalloc), "cudaMalloc");
}

// ---- DLPack export of host memory (no device needed) ---------------------------------------

// An owner whose destruction is counted, over a buffer the test can inspect.
struct CountedBuffer {
  std::vector<float> values;
  int* destroyed;
  explicit CountedBuffer(size_t n, int* counter) : values(n), destroyed(counter) {}
  ~CountedBuffer() { ++*destroyed; }
};

TEST(DLPackExportTest, DTypeCodesFollowTheSpec) {
  const DLDataType f32 = ToDLDataType(DType::kFloat32);
  EXPECT_EQ(f32.code, kDLFloat);
  EXPECT_EQ(f32.bits, 32);
  EXPECT_EQ(f32.lanes, 1);
  const DLDataType bf16 = ToDLDataType(DType::kBFloat16);
  EXPECT_EQ(bf16.code, kDLBfloat);
  EXPECT_EQ(bf16.bits, 16);
  EXPECT_EQ(bf16.lanes, 1);
  const DLDataType f16 = ToDLDataType(DType::kFloat16);
  EXPECT_EQ(f16.code, kDLFloat);
  EXPECT_EQ(f16.bits, 16);
  EXPECT_EQ(f16.lanes, 1);
  // The numeric values are the ABI.
  EXPECT_EQ(static_cast<int>(kDLCPU), 1);
  EXPECT_EQ(static_cast<int>(kDLCUDA), 2);
  EXPECT_EQ(static_cast<int>(kDLCUDAHost), 3);
  EXPECT_EQ(static_cast<int>(kDLFloat), 2);
  EXPECT_EQ(static_cast<int>(kDLBfloat), 4);
}

TEST(DLPackExportTest, HostViewFieldsAndSingleRelease) {
  int destroyed = 0;
  auto buffer = std::make_shared<CountedBuffer>(64, &destroyed);
  for (size_t i = 0; i < buffer->values.size(); ++i) buffer->values[i] = static_cast<float>(i);
  std::weak_ptr<CountedBuffer> watch = buffer;

  DLPackSource source;
  source.base = buffer->values.data();
  source.bytes = buffer->values.size() * sizeof(float);
  source.device = {kDLCPU, 7};  // CPU views always report device 0
  source.owner = buffer;
  EXPECT_EQ(watch.use_count(), 2);

  auto exported = ExportDLPack(source, 4 * sizeof(float), {3, 4, 5}, DType::kFloat32);
  ASSERT_TRUE(exported.ok()) << exported.status().ToString();
  DLManagedTensor* managed = *exported;
  EXPECT_EQ(watch.use_count(), 3);  // the export holds one reference
  const DLTensor& t = managed->dl_tensor;
  EXPECT_EQ(t.data, buffer->values.data() + 4);
  EXPECT_EQ(t.byte_offset, 0u);
  EXPECT_EQ(t.device.device_type, kDLCPU);
  EXPECT_EQ(t.device.device_id, 0);
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.dtype.code, kDLFloat);
  EXPECT_EQ(t.dtype.bits, 32);
  EXPECT_EQ(t.dtype.lanes, 1);
  ASSERT_NE(t.shape, nullptr);
  ASSERT_NE(t.strides, nullptr);
  const int64_t want_shape[] = {3, 4, 5};
  const int64_t want_strides[] = {20, 5, 1};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(t.shape[i], want_shape[i]) << i;
    EXPECT_EQ(t.strides[i], want_strides[i]) << i;
  }
  // The view aliases the buffer: element [1][2][3] is flat 1*20+2*5+3 = 33, plus the offset 4.
  EXPECT_EQ(static_cast<float*>(t.data)[33], 37.0f);
  ASSERT_NE(managed->deleter, nullptr);
  EXPECT_NE(managed->manager_ctx, nullptr);

  // The consumer outlives emsa's handle: the memory stays until the deleter runs, then goes once.
  source.owner.reset();
  buffer.reset();
  EXPECT_EQ(destroyed, 0);
  EXPECT_EQ(watch.use_count(), 1);
  EXPECT_EQ(static_cast<float*>(t.data)[0], 4.0f);
  managed->deleter(managed);
  EXPECT_EQ(destroyed, 1);
  EXPECT_TRUE(watch.expired());
}

TEST(DLPackExportTest, SeveralViewsReleaseTheOwnerAfterTheLast) {
  int destroyed = 0;
  auto buffer = std::make_shared<CountedBuffer>(16, &destroyed);
  DLPackSource source;
  source.base = buffer->values.data();
  source.bytes = 16 * sizeof(float);
  source.owner = buffer;
  auto a = ExportDLPack(source, 0, {8}, DType::kFloat32);
  auto b = ExportDLPack(source, 8 * sizeof(float), {4, 2}, DType::kFloat32);
  ASSERT_TRUE(a.ok() && b.ok());
  source.owner.reset();
  buffer.reset();
  EXPECT_EQ(destroyed, 0);
  (*a)->deleter(*a);
  EXPECT_EQ(destroyed, 0);
  (*b)->deleter(*b);
  EXPECT_EQ(destroyed, 1);
}

TEST(DLPackExportTest, HalfTypesScalarsAndEmptyShapes) {
  auto owner = std::make_shared<std::vector<uint16_t>>(32);
  DLPackSource source;
  source.base = owner->data();
  source.bytes = owner->size() * sizeof(uint16_t);
  source.device = {kDLCUDAHost, 0};
  source.owner = owner;

  auto bf16 = ExportDLPack(source, 2, {5, 3}, DType::kBFloat16);
  ASSERT_TRUE(bf16.ok()) << bf16.status().ToString();
  EXPECT_EQ((*bf16)->dl_tensor.device.device_type, kDLCUDAHost);
  EXPECT_EQ((*bf16)->dl_tensor.dtype.code, kDLBfloat);
  EXPECT_EQ((*bf16)->dl_tensor.dtype.bits, 16);
  EXPECT_EQ((*bf16)->dl_tensor.strides[0], 3);
  EXPECT_EQ((*bf16)->dl_tensor.strides[1], 1);
  EXPECT_EQ((*bf16)->dl_tensor.data, owner->data() + 1);
  (*bf16)->deleter(*bf16);

  auto scalar = ExportDLPack(source, 62, {}, DType::kFloat16);  // the last element
  ASSERT_TRUE(scalar.ok()) << scalar.status().ToString();
  EXPECT_EQ((*scalar)->dl_tensor.ndim, 0);
  EXPECT_EQ((*scalar)->dl_tensor.dtype.code, kDLFloat);
  EXPECT_EQ((*scalar)->dl_tensor.dtype.bits, 16);
  (*scalar)->deleter(*scalar);

  // Zero elements fit anywhere in the range, even at its end; zeros keep strides positive.
  auto empty = ExportDLPack(source, 64, {0, 7}, DType::kFloat16);
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_EQ((*empty)->dl_tensor.shape[0], 0);
  EXPECT_EQ((*empty)->dl_tensor.strides[0], 7);
  EXPECT_EQ((*empty)->dl_tensor.strides[1], 1);
  (*empty)->deleter(*empty);
  EXPECT_EQ(owner.use_count(), 2);  // `source` and the test
}

TEST(DLPackExportTest, BadViewsExportNothingAndTakeNoReference) {
  auto owner = std::make_shared<std::vector<float>>(16);
  DLPackSource source;
  source.base = owner->data();
  source.bytes = 16 * sizeof(float);
  source.owner = owner;
  const long refs = owner.use_count();

  struct Case {
    uint64_t offset;
    std::vector<int64_t> shape;
    DType dtype;
    const char* expect;
  };
  const Case cases[] = {
      {0, {17}, DType::kFloat32, "holds 64 bytes"},
      {4, {16}, DType::kFloat32, "holds 64 bytes"},
      {65, {0}, DType::kFloat32, "holds 64 bytes"},
      {2, {2}, DType::kFloat32, "aligned"},
      {0, {2, -1}, DType::kFloat32, "dimension 1 is negative"},
      {0, {int64_t{1} << 40, int64_t{1} << 40}, DType::kFloat32, "overflows"},
      {0, {0, int64_t{1} << 40, int64_t{1} << 40}, DType::kFloat32, "overflows"},
  };
  for (const Case& c : cases) {
    auto result = ExportDLPack(source, c.offset, c.shape, c.dtype);
    ASSERT_FALSE(result.ok()) << c.expect;
    EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(result.status().message().find(c.expect), std::string::npos)
        << result.status().message();
    EXPECT_EQ(owner.use_count(), refs);
  }

  DLPackSource orphan = source;
  orphan.owner.reset();
  auto no_owner = ExportDLPack(orphan, 0, {4}, DType::kFloat32);
  ASSERT_FALSE(no_owner.ok());
  EXPECT_NE(no_owner.status().message().find("owner"), std::string::npos);
  DLPackSource null_base = source;
  null_base.base = nullptr;
  EXPECT_FALSE(ExportDLPack(null_base, 0, {4}, DType::kFloat32).ok());
  EXPECT_FALSE(ExportView(std::shared_ptr<DeviceArena>(), 0, {4}, DType::kFloat32).ok());
  EXPECT_FALSE(ExportView(std::shared_ptr<HostArena>(), 0, {4}, DType::kFloat32).ok());
}

TEST(DLPackExportTest, HostArenaViewIsCpuAndKeepsTheArenaAlive) {
  auto created = HostArena::Create(1 * kMiB, /*want_pinned=*/false);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  std::shared_ptr<HostArena> arena = std::move(created).value();
  std::weak_ptr<HostArena> watch = arena;
  float* through_arena = arena->View<float>(256, 6);
  ASSERT_NE(through_arena, nullptr);

  auto exported = ExportView(arena, 256, {2, 3}, DType::kFloat32);
  ASSERT_TRUE(exported.ok()) << exported.status().ToString();
  DLManagedTensor* managed = *exported;
  EXPECT_EQ(managed->dl_tensor.device.device_type, kDLCPU);
  EXPECT_EQ(managed->dl_tensor.data, through_arena);
  arena.reset();
  ASSERT_FALSE(watch.expired());
  // Writes through the export land in the arena, which is still allocated and zero-filled.
  float* through_export = static_cast<float*>(managed->dl_tensor.data);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(through_export[i], 0.0f);
    through_export[i] = 1.5f * i;
  }
  for (int i = 0; i < 6; ++i) EXPECT_EQ(through_arena[i], 1.5f * i);
  managed->deleter(managed);
  EXPECT_TRUE(watch.expired());

  auto outside = HostArena::Create(1024, false);
  ASSERT_TRUE(outside.ok());
  std::shared_ptr<HostArena> small = std::move(outside).value();
  EXPECT_FALSE(ExportView(small, 1024 - 8, {3}, DType::kFloat32).ok());
}

// ---- with a device -------------------------------------------------------------------------

#if EMSA_HAVE_CUDA

#define REQUIRE_DEVICE() \
  if (!HaveDevice()) GTEST_SKIP() << "no usable CUDA device"

uint64_t FreeDeviceBytes() {
  size_t free_bytes = 0, total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  return free_bytes;
}

std::vector<uint8_t> CopyToHost(const void* device_ptr, size_t bytes) {
  std::vector<uint8_t> host(bytes, 0xAB);
  EXPECT_EQ(cudaMemcpy(host.data(), device_ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

void CheckArena(const DeviceArena& arena, uint64_t bytes) {
  ASSERT_NE(arena.data(), nullptr);
  EXPECT_EQ(arena.size(), bytes);
  EXPECT_GE(arena.granularity(), 2 * kMiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(arena.data()) % (2 * kMiB), 0u);
  EXPECT_EQ(arena.mapped_bytes() % arena.granularity(), 0u);
  EXPECT_GE(arena.mapped_bytes(), bytes);
  EXPECT_LT(arena.mapped_bytes() - bytes, arena.granularity());

  cudaPointerAttributes attributes = {};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, arena.data()), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
  EXPECT_EQ(attributes.device, arena.device());

  // Zero-filled everywhere, padding included.
  const std::vector<uint8_t> all = CopyToHost(arena.data(), arena.mapped_bytes());
  size_t nonzero = 0;
  for (uint8_t b : all) nonzero += b != 0;
  EXPECT_EQ(nonzero, 0u);

  // Write through one view and read back through another covering the same bytes.
  std::vector<float> pattern(1000);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = 0.25f * static_cast<float>(i) - 7.0f;
  const uint64_t offset = bytes - pattern.size() * sizeof(float);
  float* typed = arena.TypedView<float>(offset, pattern.size());
  ASSERT_NE(typed, nullptr);
  ASSERT_EQ(
      cudaMemcpy(typed, pattern.data(), pattern.size() * sizeof(float), cudaMemcpyHostToDevice),
      cudaSuccess);
  void* raw = arena.View(offset, pattern.size() * sizeof(float));
  ASSERT_EQ(raw, static_cast<void*>(typed));
  std::vector<float> back(pattern.size());
  ASSERT_EQ(cudaMemcpy(back.data(), raw, back.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (size_t i = 0; i < pattern.size(); ++i) ASSERT_EQ(back[i], pattern[i]) << i;

  // Bounds: the last byte is addressable, one more is not; misaligned typed views are null.
  EXPECT_NE(arena.View(bytes - 1, 1), nullptr);
  EXPECT_EQ(arena.View(bytes - 1, 2), nullptr);
  EXPECT_EQ(arena.View(bytes + 1, 0), nullptr);
  EXPECT_EQ(arena.View(UINT64_MAX, 1), nullptr);
  EXPECT_EQ(arena.TypedView<float>(2, 1), nullptr);
  EXPECT_EQ(arena.TypedView<float>(bytes - 4, 2), nullptr);
}

TEST(DeviceArenaGpuTest, VmmArenaIsAlignedZeroedAndWritable) {
  REQUIRE_DEVICE();
  const uint64_t bytes = 3 * kMiB + 12345 * 4;  // not a multiple of the granule
  auto created = DeviceArena::Create(bytes, 0);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  const DeviceArena& arena = **created;
  EXPECT_EQ(arena.kind(), DeviceArena::Kind::kVmm) << arena.fallback_reason();
  EXPECT_TRUE(arena.fallback_reason().empty());
  CheckArena(arena, bytes);
}

TEST(DeviceArenaGpuTest, CudaMallocFallbackIsNamedAlignedZeroedAndWritable) {
  REQUIRE_DEVICE();
  DeviceArena::Options options;
  options.allow_vmm = false;
  const uint64_t bytes = 5 * kMiB + 4;
  auto created = DeviceArena::Create(bytes, 0, options);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  const DeviceArena& arena = **created;
  EXPECT_EQ(arena.kind(), DeviceArena::Kind::kCudaMalloc);
  EXPECT_NE(arena.fallback_reason().find("allow_vmm"), std::string::npos);
  CheckArena(arena, bytes);
}

TEST(DeviceArenaGpuTest, ZeroFillOnACallerStream) {
  REQUIRE_DEVICE();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  DeviceArena::Options options;
  options.zero_stream = stream;
  options.wait_for_zero_fill = false;
  auto created = DeviceArena::Create(8 * kMiB, 0, options);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const std::vector<uint8_t> all = CopyToHost((*created)->data(), 8 * kMiB);
  for (size_t i = 0; i < all.size(); i += 4096) ASSERT_EQ(all[i], 0) << i;
  created->reset();
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(DeviceArenaGpuTest, RestoresTheCallersDeviceAndRejectsBadOrdinals) {
  REQUIRE_DEVICE();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  auto bad = DeviceArena::Create(kMiB, count);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  auto negative = DeviceArena::Create(kMiB, -1);
  EXPECT_FALSE(negative.ok());

  const int last = count - 1;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  {
    auto arena = DeviceArena::Create(kMiB, last);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    EXPECT_EQ((*arena)->device(), last);
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 0);
  }
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0);
}

// Freed exactly once: free memory drops by the arena and comes back when it is destroyed.
TEST(DeviceArenaGpuTest, FreesItsMemoryOnDestruction) {
  REQUIRE_DEVICE();
  const uint64_t bytes = 256 * kMiB;
  for (const bool allow_vmm : {true, false}) {
    SCOPED_TRACE(allow_vmm ? "vmm" : "cudaMalloc");
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const uint64_t errors_before = DeviceArena::ReleaseErrorCount();
    const uint64_t baseline = FreeDeviceBytes();
    DeviceArena::Options options;
    options.allow_vmm = allow_vmm;
    auto created = DeviceArena::Create(bytes, 0, options);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    const uint64_t granule = (*created)->granularity();
    const uint64_t during = FreeDeviceBytes();
    EXPECT_GE(baseline - during + granule, bytes);
    created->reset();
    const uint64_t after = FreeDeviceBytes();
    EXPECT_LE(baseline > after ? baseline - after : 0, granule);
    EXPECT_EQ(DeviceArena::ReleaseErrorCount(), errors_before);
  }
}

TEST(DeviceArenaGpuTest, DLPackViewKeepsTheArenaAliveAfterTheHandleIsDropped) {
  REQUIRE_DEVICE();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const uint64_t baseline = FreeDeviceBytes();
  const uint64_t bytes = 64 * kMiB;
  auto created = DeviceArena::Create(bytes, 0);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  std::shared_ptr<DeviceArena> arena = std::move(created).value();
  const uint64_t granule = arena->granularity();
  std::weak_ptr<DeviceArena> watch = arena;

  const uint64_t offset = 4 * kMiB;
  std::vector<float> pattern(6 * 1024);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<float>(i) * 0.5f;
  ASSERT_EQ(cudaMemcpy(arena->View(offset, pattern.size() * 4), pattern.data(), pattern.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);

  auto exported = ExportView(arena, offset, {6, 1024}, DType::kFloat32);
  ASSERT_TRUE(exported.ok()) << exported.status().ToString();
  DLManagedTensor* managed = *exported;
  EXPECT_EQ(managed->dl_tensor.device.device_type, kDLCUDA);
  EXPECT_EQ(managed->dl_tensor.device.device_id, 0);
  EXPECT_EQ(managed->dl_tensor.data, arena->View(offset, 1));
  EXPECT_EQ(managed->dl_tensor.strides[0], 1024);
  EXPECT_FALSE(ExportView(arena, bytes - 4, {2}, DType::kFloat32).ok());

  arena.reset();  // emsa lets go; the "framework" still holds the view
  ASSERT_FALSE(watch.expired());
  std::vector<float> back(pattern.size());
  ASSERT_EQ(
      cudaMemcpy(back.data(), managed->dl_tensor.data, back.size() * 4, cudaMemcpyDeviceToHost),
      cudaSuccess);
  for (size_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], pattern[i]) << i;
  EXPECT_LE(FreeDeviceBytes() + bytes, baseline + granule);  // still allocated

  managed->deleter(managed);
  EXPECT_TRUE(watch.expired());
  const uint64_t after = FreeDeviceBytes();
  EXPECT_LE(baseline > after ? baseline - after : 0, granule);
}

#endif  // EMSA_HAVE_CUDA

}  // namespace
}  // namespace emsa
