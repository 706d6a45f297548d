// host_arena.cc — one host allocation per plan: mapped on 2 MiB boundaries, advised to huge
// pages, populated in parallel, its locked prefix then registered with CUDA when pinned memory
// is asked for (cudaHostAlloc only when registering fails), the rest populated before Create
// returns or in the background; checked against the host's free memory first.
#include "emsa/host_arena.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

#include "common/cuda_util.h"
#include "common/pinned_pages.h"
#include "common/thread_pool.h"

namespace emsa {
namespace {

constexpr uint64_t kHugePage = kHostArenaPageBytes;
static_assert(kHostArenaPageBytes == kLargePageBytes, "the arena's pages are common's large pages");
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kMaxBytes = uint64_t{1} << 50;  // 1 PiB: larger is a units mistake

uint64_t RoundUp(uint64_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// "N bytes (X.XX GiB)": exact for scripts, readable for people.
std::string Size(uint64_t bytes) {
  char gib[32];
  std::snprintf(gib, sizeof(gib), "%.2f", static_cast<double>(bytes) / static_cast<double>(kGiB));
  return std::to_string(bytes) + " bytes (" + gib + " GiB)";
}

// MemAvailable from /proc/meminfo in bytes: what the kernel can give without swapping
// (free memory plus reclaimable caches). 0 when it cannot be read.
uint64_t MemAvailableBytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  unsigned long long kib = 0;
  bool found = false;
  while (!found && std::fgets(line, sizeof(line), f) != nullptr) {
    found = std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
  }
  std::fclose(f);
  return found ? static_cast<uint64_t>(kib) * 1024 : 0;
}

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
  return pages > 0 && page_size > 0 ? static_cast<uint64_t>(pages) * page_size : 0;
}

uint64_t LockedLimitBytes() {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return UINT64_MAX;
  }
  return static_cast<uint64_t>(limit.rlim_cur);
}

// Kept out of the arena's share: the rest of this process (torch, the CUDA context, page
// tables, the probe's tensors) and the system need memory too, and locked pages cannot be
// reclaimed to make room for them.
uint64_t Reserve(uint64_t available) { return std::min(kGiB, available / 8); }

// The pool a fill runs on: the caller's, one made for this arena, or none (calling thread).
class FillPool {
 public:
  explicit FillPool(const HostArenaOptions& options) : pool_(options.fill_pool) {
    if (pool_ != nullptr || options.fill_threads == 1) return;
    try {
      own_ = std::make_unique<ThreadPool>(options.fill_threads);
      pool_ = own_.get();
    } catch (const std::system_error&) {
      // The OS refused a thread: the calling thread fills alone (facts().fill_threads says).
    }
  }
  ThreadPool* get() const { return pool_; }

 private:
  std::unique_ptr<ThreadPool> own_;
  ThreadPool* pool_;
};

// PopulateInParallel, with the error as a Status that says what to do.
Status Populate(void* data, uint64_t bytes, ThreadPool* pool) {
  const int e = PopulateInParallel(data, bytes, pool);
  if (e == 0) return Status::Ok();
  return Status::OutOfMemory("cannot populate " + Size(bytes) +
                             " of the host arena: " + std::strerror(e) +
                             "; keep less optimizer state on the host or free host memory");
}

#if EMSA_HAVE_CUDA
// Memory from an allocator may hold anything: zero every byte (the cudaHostAlloc fallback).
void ZeroFill(void* data, uint64_t bytes, ThreadPool* pool) {
  char* base = static_cast<char*>(data);
  ForLargePageShares(bytes, pool, [base](uint64_t begin, uint64_t end) {
    std::memset(base + begin, 0, static_cast<size_t>(end - begin));
  });
}
#endif

}  // namespace

Status HostArena::CheckFits(uint64_t bytes, const HostArenaOptions& options) {
  if (bytes == 0 || bytes > kMaxBytes) {
    return Status::InvalidArgument("host arena size must be between 1 byte and 1 PiB, got " +
                                   std::to_string(bytes) + " bytes");
  }
  uint64_t available = options.available_bytes;
  const char* source = "as given";
  if (available == 0) {
    available = MemAvailableBytes();
    source = "MemAvailable in /proc/meminfo";
  }
  if (available == 0) {
    available = PhysicalMemoryBytes();
    source = "the physical memory; /proc/meminfo is unreadable";
  }
  if (available == 0) return Status::Ok();  // nothing known: the allocation decides
  const uint64_t reserve = Reserve(available);
  const uint64_t fits = (available - reserve) / kHugePage * kHugePage;
  if (RoundUp(bytes) <= fits) return Status::Ok();
  return Status::OutOfMemory(
      "a host arena of " + Size(bytes) + " does not fit in this host's memory: " + Size(available) +
      " is available (" + source + "), " + Size(reserve) +
      " of it is kept for the rest of the process, so the largest host arena that fits now is " +
      Size(fits) +
      ". Nothing was allocated. Keep less optimizer state on the host (a larger device budget "
      "keeps more on the GPU; bf16 state halves the moments), or free host memory");
}

Result<std::unique_ptr<HostArena>> HostArena::Create(uint64_t bytes, bool want_pinned,
                                                     ThreadPool* zero_fill_pool) {
  HostArenaOptions options;
  options.want_pinned = want_pinned;
  options.fill_pool = zero_fill_pool;
  options.fill_threads = 1;
  return Create(bytes, options);
}

// The part after the locked prefix, populated front to back in pieces on a pool of its own, so
// that WaitPopulated returns as soon as the pages asked for are in: the plan lays the arena out
// in gradient-ready order, so the first step's first buckets come first.
class HostArena::Populator {
 public:
  Populator(char* data, uint64_t begin, uint64_t end, int32_t threads) : done_(begin), end_(end) {
    thread_ = std::thread([this, data, threads] { Run(data, threads); });
  }
  ~Populator() {  // stops after the piece under way
    stop_.store(true, std::memory_order_relaxed);
    if (thread_.joinable()) thread_.join();
  }
  Populator(const Populator&) = delete;
  Populator& operator=(const Populator&) = delete;

  Status Wait(uint64_t offset) const {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(lock, [&] { return done_ >= offset || finished_; });
    if (!status_.ok() || done_ >= offset) return status_;
    return Status::Internal("the host arena's population was stopped before it finished");
  }
  void Read(HostArenaFacts* facts) const {
    std::lock_guard<std::mutex> lock(mu_);
    facts->populated = status_.ok() && done_ >= end_;
    facts->populate_seconds = seconds_;
  }

 private:
  // One piece at a time, every thread on it, so what is done is a prefix.
  static constexpr uint64_t kPiece = uint64_t{256} << 20;

  void Run(char* data, int32_t threads) {
    const auto start = std::chrono::steady_clock::now();
    std::unique_ptr<ThreadPool> pool;
    if (threads != 1) {
      try {
        pool = std::make_unique<ThreadPool>(threads);
      } catch (const std::system_error&) {
        // The OS refused a thread: this thread populates alone.
      }
    }
    uint64_t at = done_;  // only this thread writes done_
    Status status;
    while (at < end_ && status.ok() && !stop_.load(std::memory_order_relaxed)) {
      const uint64_t n = std::min(kPiece, end_ - at);
      status = Populate(data + at, n, pool.get());
      if (status.ok()) at += n;
      std::lock_guard<std::mutex> lock(mu_);
      done_ = at;
      status_ = status;
      if (at >= end_) seconds_ = SecondsSince(start);  // with done_: a waiter sees both
      changed_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
    changed_.notify_all();
  }

  mutable std::mutex mu_;
  mutable std::condition_variable changed_;
  uint64_t done_;  // arena offset below which every page is resident (mu_)
  const uint64_t end_;
  bool finished_ = false;  // mu_
  Status status_;          // mu_
  double seconds_ = 0;     // mu_
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: it starts once every member above exists
};

HostArena::HostArena() = default;

Result<std::unique_ptr<HostArena>> HostArena::Create(uint64_t bytes,
                                                     const HostArenaOptions& options) {
  EMSA_RETURN_IF_ERROR(CheckFits(bytes, options));
  std::unique_ptr<HostArena> arena(new HostArena());
  arena->size_ = bytes;
  arena->facts_.locked_limit_bytes = LockedLimitBytes();
  EMSA_RETURN_IF_ERROR(arena->Map());
  const uint64_t locked = std::min(options.locked_bytes, bytes);
  arena->prefix_ = std::min(RoundUp(locked), arena->mapped_);
#if EMSA_HAVE_CUDA
  const bool pin = options.want_pinned && arena->prefix_ > 0 && CudaDeviceUsable();
#else
  const bool pin = false;
#endif
  // A fork (a DataLoader worker) must not inherit pinned pages: the kernel would copy every one
  // of them into the child at fork time, since a pinned page cannot be shared copy-on-write (and
  // a child cannot use this CUDA context anyway). Before populating: the advice changes the
  // mapping, which would wait for the background population's page faults.
  if (pin && madvise(arena->data_, arena->mapped_, MADV_DONTFORK) != 0) {
    return Status::Internal(std::string("madvise(MADV_DONTFORK) on the host arena: ") +
                            std::strerror(errno));
  }
  const FillPool pool(options);
  const bool background = options.populate_in_background && arena->prefix_ < arena->mapped_;
  EMSA_RETURN_IF_ERROR(arena->Fill(background ? arena->prefix_ : arena->mapped_, pool.get()));
  // Under way while the prefix is registered: the driver pins it on this thread. Where the OS
  // refuses the thread, the rest is populated now instead.
  if (background && !arena->PopulateInBackground(options.fill_threads)) {
    EMSA_RETURN_IF_ERROR(Populate(static_cast<char*>(arena->data_) + arena->prefix_,
                                  arena->mapped_ - arena->prefix_, pool.get()));
  }
  if (!options.want_pinned) return arena;
  if (arena->prefix_ == 0) {
    arena->facts_.fallback_reason = "locked_bytes is 0: nothing of the arena is page-locked";
    return arena;
  }
#if EMSA_HAVE_CUDA
  if (!pin) {
    arena->facts_.fallback_reason = "no usable CUDA device: the arena is pageable";
    return arena;
  }
  const Status registered = arena->Register();
  if (registered.ok()) return arena;
  arena->Release();
  arena->facts_.fallback_reason =
      registered.message() + "; pinned with cudaHostAlloc instead, which takes longer";
  EMSA_RETURN_IF_ERROR(arena->HostAllocFallback(pool.get()));
  return arena;
#else
  arena->facts_.fallback_reason = "built without CUDA: the arena is pageable";
  return arena;
#endif
}

Status HostArena::Map() {
  MappedPages pages;
  const int e = MapLargePages(size_, &pages);
  if (e != 0) {
    return Status::OutOfMemory("cannot map a host arena of " + Size(size_) + ": " +
                               std::strerror(e) +
                               "; keep less optimizer state on the host or free host memory");
  }
  data_ = pages.data;
  mapped_ = pages.bytes;
  // Advice only: where the kernel offers no transparent huge pages base pages serve; facts()
  // says which.
  facts_.huge_pages = pages.huge_pages;
  facts_.pageable_bytes = mapped_;
  return Status::Ok();
}

Status HostArena::Fill(uint64_t bytes, ThreadPool* pool) {
  facts_.fill_threads = pool != nullptr ? pool->size() : 1;
  const auto begin = std::chrono::steady_clock::now();
  const Status populated = Populate(data_, bytes, pool);
  facts_.fill_seconds = SecondsSince(begin);
  return populated;
}

bool HostArena::PopulateInBackground(int32_t threads) {
  try {
    populator_ = std::make_unique<Populator>(static_cast<char*>(data_), prefix_, mapped_, threads);
  } catch (const std::system_error&) {
    return false;
  }
  facts_.populate_in_background = true;
  facts_.populated = false;
  return true;
}

Status HostArena::Register() {
#if EMSA_HAVE_CUDA
  const auto begin = std::chrono::steady_clock::now();
  // Portable: any context may copy from it. The pages are resident already, so the driver
  // only pins and maps them.
  const cudaError_t err = RegisterPages(data_, prefix_);
  facts_.pin_seconds = SecondsSince(begin);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return CudaStatus(err, "cudaHostRegister of the host arena");
  }
  facts_.pin = HostPin::kRegistered;
  facts_.locked_bytes = prefix_;
  facts_.pageable_bytes = mapped_ - prefix_;
  return Status::Ok();
#else
  return Status::Internal("HostArena::Register without CUDA");
#endif
}

HostArenaFacts HostArena::facts() const {
  HostArenaFacts out = facts_;
  if (populator_ != nullptr) populator_->Read(&out);
  return out;
}

Status HostArena::WaitPopulated(uint64_t offset) const {
  if (populator_ == nullptr) return Status::Ok();
  return populator_->Wait(std::min(offset, size_));
}

Status HostArena::HostAllocFallback(ThreadPool* pool) {
#if EMSA_HAVE_CUDA
  const auto begin = std::chrono::steady_clock::now();
  // Portable as above; not write-combined: the CPU reads state back every step, and reads
  // from write-combined memory are uncached.
  const cudaError_t err = cudaHostAlloc(&data_, size_, cudaHostAllocPortable);
  facts_.pin_seconds = SecondsSince(begin);
  if (err != cudaSuccess) {
    data_ = nullptr;
    (void)cudaGetLastError();
    const uint64_t limit = facts_.locked_limit_bytes;
    return Status::OutOfMemory(
        "cannot pin a host arena of " + Size(size_) + ": " + facts_.fallback_reason +
        ", and cudaHostAlloc failed too (" + cudaGetErrorName(err) +
        "); the locked-memory limit (ulimit -l) is " +
        (limit == UINT64_MAX ? std::string("unlimited") : Size(limit)) +
        ". Keep less optimizer state on the host, free host memory, or raise the limit");
  }
  facts_.pin = HostPin::kHostAlloc;
  facts_.locked_bytes = size_;
  facts_.pageable_bytes = 0;
  facts_.populate_in_background = false;
  facts_.populated = true;
  const auto fill = std::chrono::steady_clock::now();
  ZeroFill(data_, size_, pool);
  facts_.fill_seconds = SecondsSince(fill);
  return Status::Ok();
#else
  (void)pool;
  return Status::Internal("HostArena::HostAllocFallback without CUDA");
#endif
}

// Frees what the arena holds with the call matching how it was obtained; safe to repeat.
void HostArena::Release() {
  populator_.reset();  // nothing may touch the pages once they are gone
  if (data_ == nullptr) return;
#if EMSA_HAVE_CUDA
  if (facts_.pin == HostPin::kHostAlloc) {
    (void)cudaFreeHost(data_);
    (void)cudaGetLastError();
    data_ = nullptr;
    facts_.pin = HostPin::kNone;
    facts_.locked_bytes = 0;
    return;
  }
  if (facts_.pin == HostPin::kRegistered) {
    // At interpreter exit the runtime may be unloading: the unmap below still returns the
    // memory, and the driver's pins go with the process.
    (void)cudaHostUnregister(data_);  // the locked prefix, registered at data_
    (void)cudaGetLastError();
  }
#endif
  UnmapPages({data_, mapped_, facts_.huge_pages});
  data_ = nullptr;
  mapped_ = 0;
  facts_.pin = HostPin::kNone;
  facts_.locked_bytes = 0;
  facts_.pageable_bytes = 0;
}

HostArena::~HostArena() { Release(); }

}  // namespace emsa
