// Tests for include/emsa/host_arena.h: sizes, alignment, zero fill (serial and pooled), views,
// the host-memory check before allocation, the facts, the background population, and the pinned
// path, whole or a locked prefix (GPU only).
#include "emsa/host_arena.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_util.h"
#include "common/thread_pool.h"

namespace emsa {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// Index of the first non-zero byte, or -1.
int64_t FirstNonZero(const void* data, uint64_t bytes) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (uint64_t i = 0; i < bytes; ++i) {
    if (p[i] != 0) return static_cast<int64_t>(i);
  }
  return -1;
}

TEST(HostArena, PageableIsAlignedSizedAndZeroed) {
  const uint64_t bytes = 5 * kMiB + 3;
  Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, /*want_pinned=*/false);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  const HostArena& a = **arena;
  EXPECT_EQ(a.kind(), HostArena::Kind::kPageable);
  EXPECT_EQ(a.size(), bytes);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % (2 * kMiB), 0u);
  EXPECT_EQ(FirstNonZero(a.data(), bytes), -1);
}

// Pages of [data, data + bytes) that are not resident in RAM.
int64_t NonResidentPages(const void* data, uint64_t bytes) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  if (mincore(const_cast<void*>(data), bytes, resident.data()) != 0) {
    ADD_FAILURE() << "mincore failed";
    return -1;
  }
  int64_t missing = 0;
  for (unsigned char r : resident) missing += (r & 1) ? 0 : 1;
  return missing;
}

// Creation must touch every page (no page faults later, during steps) and leave zeros, whether
// the fill runs on this thread or on a pool; memory the allocator hands back dirty must not
// leak through either.
TEST(HostArena, ZeroFilledAndResidentAtCreation) {
  ThreadPool pool(3);
  for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
    for (int round = 0; round < 3; ++round) {
      const uint64_t bytes = 9 * kMiB + 4097;
      Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, false, p);
      ASSERT_TRUE(arena.ok()) << arena.status().ToString();
      EXPECT_EQ(NonResidentPages((*arena)->data(), bytes), 0) << "round " << round;
      EXPECT_EQ(FirstNonZero((*arena)->data(), bytes), -1) << "round " << round;
      std::memset((*arena)->data(), 0xAB, bytes);
    }
  }
}

TEST(HostArena, PinnedRequestFallsBackWithoutADevice) {
  Result<std::unique_ptr<HostArena>> arena = HostArena::Create(3 * kMiB, /*want_pinned=*/true);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  // Pinned where a device is usable (the GPU host), pageable here; either way zeroed memory.
  const HostArena& a = **arena;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 4096, 0u);
  EXPECT_EQ(FirstNonZero(a.data(), a.size()), -1);
  std::memset(a.data(), 1, a.size());
#if EMSA_HAVE_CUDA
  const bool device_usable = CudaDeviceUsable();
#else
  const bool device_usable = false;
#endif
  EXPECT_EQ(a.kind(), device_usable ? HostArena::Kind::kPinned : HostArena::Kind::kPageable);
  // Never a silent fallback: a pageable arena that was asked to be pinned says why.
  EXPECT_EQ(a.facts().fallback_reason.empty(), device_usable) << a.facts().fallback_reason;
}

#if EMSA_HAVE_CUDA
// Fills host[0, bytes) with a pattern, copies it to the device and back over zeros: the device
// reads and writes the memory directly.
void ExpectDeviceRoundTrip(unsigned char* host, uint64_t bytes) {
  for (uint64_t i = 0; i < bytes; ++i) host[i] = static_cast<unsigned char>(i * 7 + 1);
  void* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, bytes), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  std::vector<unsigned char> expect(host, host + bytes);
  ASSERT_EQ(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::memset(host, 0, bytes);
  ASSERT_EQ(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(std::memcmp(host, expect.data(), bytes), 0);
  EXPECT_EQ(cudaFree(dev), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}
#endif

// Pinned memory is memory the device copies to and from directly (the pointer is registered
// host memory), zero-filled, and freed without error. GPU only.
TEST(HostArena, PinnedIsCopyableByTheDevice) {
#if EMSA_HAVE_CUDA
  if (!CudaDeviceUsable()) GTEST_SKIP() << "no usable CUDA device";
  {
    const uint64_t bytes = 5 * kMiB + 12;  // not a multiple of the huge page
    ThreadPool pool(2);
    Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, true, &pool);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    const HostArena& a = **arena;
    ASSERT_EQ(a.kind(), HostArena::Kind::kPinned);
    // Registered, not the cudaHostAlloc fallback, and every byte of it accounted as locked.
    EXPECT_EQ(a.facts().pin, HostPin::kRegistered) << a.facts().fallback_reason;
    EXPECT_EQ(a.facts().fallback_reason, "");
    EXPECT_GE(a.facts().locked_bytes, bytes);
    EXPECT_EQ(a.facts().pageable_bytes, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % (2 * kMiB), 0u);
    EXPECT_EQ(FirstNonZero(a.data(), bytes), -1);
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, a.data()), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost);
    // The last byte is registered too (the whole mapping is).
    ASSERT_EQ(cudaPointerGetAttributes(&attr, static_cast<char*>(a.data()) + bytes - 1),
              cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost);
    ExpectDeviceRoundTrip(static_cast<unsigned char*>(a.data()), bytes);
  }
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

TEST(HostArena, ViewsAreBoundsAndAlignmentChecked) {
  const uint64_t bytes = 4096 + 8;
  Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, false);
  ASSERT_TRUE(arena.ok());
  const HostArena& a = **arena;
  char* base = static_cast<char*>(a.data());

  float* all = a.View<float>(0, bytes / sizeof(float));
  ASSERT_EQ(static_cast<void*>(all), a.data());
  all[bytes / sizeof(float) - 1] = 3.5f;  // the last element is inside the arena
  EXPECT_EQ(a.View<double>(bytes - 8, 1), reinterpret_cast<double*>(base + bytes - 8));
  EXPECT_EQ(a.View<float>(bytes, 0), reinterpret_cast<float*>(base + bytes));  // empty, at end

  EXPECT_EQ(a.View<float>(0, bytes / sizeof(float) + 1), nullptr);  // one past the end
  EXPECT_EQ(a.View<double>(bytes - 4, 1), nullptr);                 // straddles the end
  EXPECT_EQ(a.View<float>(bytes + 4, 0), nullptr);                  // starts past the end
  EXPECT_EQ(a.View<float>(2, 1), nullptr);                          // misaligned
  EXPECT_EQ(a.View<float>(4, UINT64_MAX), nullptr);                 // count overflow
  EXPECT_EQ(a.View<float>(UINT64_MAX - 3, 1), nullptr);             // offset overflow
}

TEST(HostArena, BadSizesAreRejected) {
  for (uint64_t bytes : {uint64_t{0}, (uint64_t{1} << 50) + 1, UINT64_MAX}) {
    Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, false);
    ASSERT_FALSE(arena.ok()) << bytes;
    EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument) << bytes;
    EXPECT_NE(arena.status().message().find(std::to_string(bytes)), std::string::npos)
        << arena.status().message();
  }
}

// 1 PiB is a legal size but more than any machine has: the failure must be a value with the
// size in it, not a crash or a visit from the OOM killer during the zero fill.
TEST(HostArena, FailedAllocationIsOutOfMemoryWithTheSize) {
  const uint64_t bytes = uint64_t{1} << 50;
  Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, false);
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(arena.status().message().find(std::to_string(bytes)), std::string::npos)
      << arena.status().message();
}

// A host without room fails before anything is mapped, with the size that fits in bytes and
// GiB; the available memory is injected, so nothing of that size is ever allocated.
TEST(HostArena, ShortfallFailsBeforeAllocationNamingTheSizeThatFits) {
  HostArenaOptions options;
  options.want_pinned = false;
  options.available_bytes = 64 * kMiB;
  // The reserve is an eighth of 64 MiB here; 56 MiB fits.
  const std::string fits = std::to_string(56 * kMiB) + " bytes (0.05 GiB)";
  for (uint64_t bytes : {57 * kMiB, uint64_t{1} << 49}) {
    const Status checked = HostArena::CheckFits(bytes, options);
    EXPECT_EQ(checked.code(), StatusCode::kOutOfMemory) << bytes;
    EXPECT_NE(checked.message().find("largest host arena that fits now is " + fits),
              std::string::npos)
        << checked.message();
    EXPECT_NE(checked.message().find(std::to_string(bytes) + " bytes"), std::string::npos)
        << checked.message();
    EXPECT_NE(checked.message().find("Nothing was allocated"), std::string::npos);
    Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, options);
    ASSERT_FALSE(arena.ok());
    EXPECT_EQ(arena.status().message(), checked.message());
  }
  EXPECT_TRUE(HostArena::CheckFits(56 * kMiB, options).ok());
  Result<std::unique_ptr<HostArena>> fits_now = HostArena::Create(56 * kMiB, options);
  ASSERT_TRUE(fits_now.ok()) << fits_now.status().ToString();
  // Sizes are checked before memory.
  EXPECT_EQ(HostArena::CheckFits(0, options).code(), StatusCode::kInvalidArgument);
}

// The default options fill on a pool of their own; the facts account every mapped byte as
// pageable when nothing is pinned, and the memory is unmapped when the arena goes.
TEST(HostArena, OwnPoolFillsFactsAccountAndDestructionUnmaps) {
  HostArenaOptions options;
  options.want_pinned = false;
  options.fill_threads = 3;
  const uint64_t bytes = 11 * kMiB + 5;
  void* data = nullptr;
  {
    Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, options);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    const HostArena& a = **arena;
    data = a.data();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(data) % (2 * kMiB), 0u);
    EXPECT_EQ(NonResidentPages(data, bytes), 0);
    EXPECT_EQ(FirstNonZero(data, bytes), -1);
    const HostArenaFacts& f = a.facts();
    EXPECT_EQ(f.pin, HostPin::kNone);
    EXPECT_EQ(f.fallback_reason, "");  // pinning was not asked for
    EXPECT_EQ(f.fill_threads, 3);
    EXPECT_EQ(f.locked_bytes, 0u);
    EXPECT_EQ(f.pageable_bytes, 12 * kMiB);  // whole 2 MiB pages
    EXPECT_GE(f.fill_seconds, 0.0);
    EXPECT_GT(f.locked_limit_bytes, 0u);
    std::memset(data, 0x5A, bytes);
  }
  // mincore fails with ENOMEM on a range that is no longer mapped.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((12 * kMiB) / page);
  errno = 0;
  EXPECT_NE(mincore(data, 12 * kMiB, resident.data()), 0);
  EXPECT_EQ(errno, ENOMEM);
}

// Registered memory is unregistered before it is unmapped: afterwards the runtime no longer
// knows the pointer. GPU only.
TEST(HostArena, PinnedIsUnregisteredOnDestruction) {
#if EMSA_HAVE_CUDA
  if (!CudaDeviceUsable()) GTEST_SKIP() << "no usable CUDA device";
  void* data = nullptr;
  {
    Result<std::unique_ptr<HostArena>> arena = HostArena::Create(4 * kMiB, HostArenaOptions{});
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    ASSERT_EQ((*arena)->facts().pin, HostPin::kRegistered) << (*arena)->facts().fallback_reason;
    data = (*arena)->data();
  }
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, data), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeUnregistered);
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// A fork does not inherit registered memory (the kernel would otherwise copy every pinned page
// into the child): in the child the range is not mapped. The child calls no CUDA. GPU only.
TEST(HostArena, PinnedIsNotInheritedByAFork) {
#if EMSA_HAVE_CUDA
  if (!CudaDeviceUsable()) GTEST_SKIP() << "no usable CUDA device";
  Result<std::unique_ptr<HostArena>> arena = HostArena::Create(4 * kMiB, HostArenaOptions{});
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  ASSERT_EQ((*arena)->facts().pin, HostPin::kRegistered) << (*arena)->facts().fallback_reason;
  void* data = (*arena)->data();
  std::vector<unsigned char> resident(4 * kMiB / static_cast<uint64_t>(sysconf(_SC_PAGESIZE)));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const bool unmapped = mincore(data, 4 * kMiB, resident.data()) != 0 && errno == ENOMEM;
    _exit(unmapped ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child inherited the registered arena";
  EXPECT_EQ(FirstNonZero(data, 4 * kMiB), -1);  // the parent's memory is untouched
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// The part after the locked prefix populated in the background: what is written meanwhile (the
// binding's masters) survives it, everything else stays zero, and once waited for every page is
// resident. More than one of the population's pieces, so that waiting for a prefix can return
// before the end.
TEST(HostArena, BackgroundPopulationKeepsWritesAndEndsResident) {
  HostArenaOptions options;
  options.want_pinned = false;
  options.locked_bytes = 3 * kMiB;  // a prefix of 4 MiB, populated before Create returns
  options.populate_in_background = true;
  options.fill_threads = 3;
  const uint64_t bytes = 600 * kMiB + 7;
  Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, options);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  const HostArena& a = **arena;
  EXPECT_EQ(NonResidentPages(a.data(), 4 * kMiB), 0);
  EXPECT_TRUE(a.facts().populate_in_background);
  auto* base = static_cast<unsigned char*>(a.data());
  const uint64_t stride = 3 * kMiB + 4093;  // lands at different places in pages and pieces
  for (uint64_t at = 0; at < bytes; at += stride)
    base[at] = static_cast<unsigned char>(at % 251 + 1);
  ASSERT_TRUE(a.WaitPopulated(bytes / 2).ok());
  EXPECT_EQ(NonResidentPages(a.data(), bytes / 2 / 4096 * 4096), 0);
  ASSERT_TRUE(a.WaitPopulated(UINT64_MAX).ok());  // clamped to the size
  EXPECT_EQ(NonResidentPages(a.data(), bytes), 0);
  const HostArenaFacts f = a.facts();
  EXPECT_TRUE(f.populated);
  EXPECT_GT(f.populate_seconds, 0.0);
  EXPECT_EQ(f.locked_bytes, 0u);  // pinning was not asked for
  EXPECT_EQ(f.pageable_bytes, 602 * kMiB);
  for (uint64_t at = 0; at < bytes; ++at) {
    const unsigned char want = at % stride == 0 ? static_cast<unsigned char>(at % 251 + 1) : 0;
    if (base[at] != want) {
      ADD_FAILURE() << "byte " << at << " is " << int{base[at]} << ", not " << int{want};
      break;
    }
  }
}

// An arena destroyed while its background population runs stops it first (nothing touches the
// pages once they are unmapped); without one, waiting returns at once.
TEST(HostArena, DestroyedWhilePopulatingAndWaitingWithoutPopulation) {
  HostArenaOptions options;
  options.want_pinned = false;
  options.locked_bytes = 0;
  options.populate_in_background = true;
  options.fill_threads = 2;
  for (int round = 0; round < 3; ++round) {
    Result<std::unique_ptr<HostArena>> arena = HostArena::Create(700 * kMiB, options);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  }
  options.populate_in_background = false;
  Result<std::unique_ptr<HostArena>> arena = HostArena::Create(5 * kMiB, options);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_TRUE((*arena)->WaitPopulated(5 * kMiB).ok());
  EXPECT_FALSE((*arena)->facts().populate_in_background);
  EXPECT_TRUE((*arena)->facts().populated);
  EXPECT_EQ(NonResidentPages((*arena)->data(), 5 * kMiB), 0);
}

// Only the locked prefix is page-locked (whole pages: 3 MiB + 1 locks 4 MiB), the rest is
// pageable, populated before Create returns or in the background, and the facts say which bytes
// are which. The device copies from and to the prefix; the pageable part is unknown to CUDA.
// GPU only.
TEST(HostArena, LockedPrefixIsRegisteredAndTheRestPageable) {
#if EMSA_HAVE_CUDA
  if (!CudaDeviceUsable()) GTEST_SKIP() << "no usable CUDA device";
  for (bool background : {false, true}) {
    HostArenaOptions options;
    options.locked_bytes = 3 * kMiB + 1;
    options.populate_in_background = background;
    const uint64_t bytes = 9 * kMiB + 5;  // 10 MiB mapped
    Result<std::unique_ptr<HostArena>> arena = HostArena::Create(bytes, options);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    const HostArena& a = **arena;
    ASSERT_TRUE(a.WaitPopulated(bytes).ok());
    const HostArenaFacts f = a.facts();
    ASSERT_EQ(f.pin, HostPin::kRegistered) << f.fallback_reason;
    EXPECT_EQ(a.kind(), HostArena::Kind::kPinned);
    EXPECT_EQ(f.locked_bytes, 4 * kMiB);
    EXPECT_EQ(f.pageable_bytes, 6 * kMiB);
    EXPECT_EQ(f.populate_in_background, background);
    EXPECT_TRUE(f.populated);
    EXPECT_EQ(NonResidentPages(a.data(), bytes), 0);
    EXPECT_EQ(FirstNonZero(a.data(), bytes), -1);
    auto* host = static_cast<unsigned char*>(a.data());
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, host + 4 * kMiB - 1), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost);
    ASSERT_EQ(cudaPointerGetAttributes(&attr, host + 4 * kMiB), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeUnregistered);
    ExpectDeviceRoundTrip(host, 4 * kMiB);  // the locked prefix
  }
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

}  // namespace
}  // namespace emsa
