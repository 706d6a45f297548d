// bulk_copy.cuh — Hopper bulk copies (cp.async.bulk, PTX ISA 8.0, sm_90) and the mbarriers they
// complete on: what the fp32 update kernel's load pipeline uses (update_kernel.cuh), and the
// stream-mix benchmark (bench/stream_mix_bench.cu).
//
// Below sm_90 every function compiles to nothing (EMSA_HAVE_BULK_COPY 0): callers must not take
// a bulk path there (the launcher checks the device's compute capability).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace emsa {
namespace cuda {

// cp.async.bulk with a shared::cluster destination takes the CTA's own shared address without a
// cluster launch (every launch is an implicit 1-CTA cluster). Sizes and both addresses must be
// multiples of 16 bytes.

__device__ __forceinline__ uint32_t SharedAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define EMSA_HAVE_BULK_COPY 1
#else
#define EMSA_HAVE_BULK_COPY 0
#endif

__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
#if EMSA_HAVE_BULK_COPY
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SharedAddr(bar)), "r"(count)
               : "memory");
#endif
}

// Makes the initialized barriers visible to the async proxy (the bulk copies complete on them).
__device__ __forceinline__ void FenceMbarInit() {
#if EMSA_HAVE_BULK_COPY
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One arrival (the barrier's count is 1) that also adds `bytes` to the phase's expected
// transaction count: the phase completes when the copies have delivered that many bytes.
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
#if EMSA_HAVE_BULK_COPY
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SharedAddr(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// Waits until the phase of parity `parity` has completed (acquire: the copied bytes are visible).
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
#if EMSA_HAVE_BULK_COPY
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(SharedAddr(bar)), "r"(parity)
        : "memory");
  } while (done == 0);
#endif
}

__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy = 0;
#if EMSA_HAVE_BULK_COPY
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
  return policy;
}

// global -> this CTA's shared memory, completing `bytes` on `bar`.
__device__ __forceinline__ void BulkLoad(void* smem_dst, const void* gmem_src, uint32_t bytes,
                                         uint64_t* bar, uint64_t policy) {
#if EMSA_HAVE_BULK_COPY
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(SharedAddr(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(SharedAddr(bar)), "l"(policy)
      : "memory");
#endif
}

// shared -> global, in the thread's current bulk group.
__device__ __forceinline__ void BulkStore(void* gmem_dst, const void* smem_src, uint32_t bytes,
                                          uint64_t policy) {
#if EMSA_HAVE_BULK_COPY
  asm volatile(
      "cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;" ::"l"(
          gmem_dst),
      "r"(SharedAddr(smem_src)), "r"(bytes), "l"(policy)
      : "memory");
#endif
}

__device__ __forceinline__ void BulkCommit() {
#if EMSA_HAVE_BULK_COPY
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// At most kPending of this thread's bulk groups still reading their shared source.
template <int kPending>
__device__ __forceinline__ void BulkWaitRead() {
#if EMSA_HAVE_BULK_COPY
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
#endif
}

// At most kPending of this thread's bulk groups not yet complete (writes done).
template <int kPending>
__device__ __forceinline__ void BulkWait() {
#if EMSA_HAVE_BULK_COPY
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads.
__device__ __forceinline__ void FenceProxyAsyncShared() {
#if EMSA_HAVE_BULK_COPY
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

}  // namespace cuda
}  // namespace emsa
