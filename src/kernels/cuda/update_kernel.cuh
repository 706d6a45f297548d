// update_kernel.cuh — the fused multi-tensor update kernel, one instantiation per variant.
//
// A persistent grid (a few blocks per SM, sized from occupancy) walks the variant's chunks
// round-robin: block b takes chunks b, b + grid, ... Within a chunk each thread takes
// kElemsPerThread elements per pass as kUnroll vectors of kVec consecutive elements, vectors of
// one pass kThreads apart, so every warp access is one contiguous, fully used span. All loads of
// a pass are issued before the first is used: kUnroll independent 16-byte (or 8-byte) loads per
// stream in flight per thread. Tensors whose streams are not all 16-byte aligned, and the last
// n % kVec elements of a tensor, take the scalar path (same arithmetic, element by element).
//
// The kernel reads found_inf, grad_multiplier and the seed once, and a group's constants
// (two double pow) only when the chunk's group or step differs from the block's previous chunk
// (the step is the group's, or in a table with slots the tensor's own slot step). Chunks of
// absent tensors (kTensorAbsent: no gradient this step) are skipped whole.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/bulk_copy.cuh"
#include "kernels/cuda/device_table.h"
#include "kernels/cuda/update_kernels.h"
#include "kernels/cuda/update_math.cuh"

namespace emsa {
namespace cuda {

// ---- launch geometry ---------------------------------------------------------------------------

constexpr int kUpdateThreads = 256;
// Elements per thread per pass: 8 gives 32 bytes per fp32 stream, 16 per 16-bit stream. A build
// may override it for the tuning sweep (scripts/gpu-check sweep); the product keeps the default.
#ifndef EMSA_CUDA_ELEMS_PER_THREAD
#define EMSA_CUDA_ELEMS_PER_THREAD 8
#endif
constexpr int kElemsPerThread = EMSA_CUDA_ELEMS_PER_THREAD;
// Blocks per SM the compiler must fit (it trims registers to do so), a tuning knob like the one
// above. Unset by default: __launch_bounds__(256, 1) is not the same as __launch_bounds__(256)
// to nvcc 13, and the register trimming a minimum forces makes the bf16 kernel slower.
#ifdef EMSA_CUDA_MIN_BLOCKS
#define EMSA_UPDATE_LAUNCH_BOUNDS __launch_bounds__(kUpdateThreads, EMSA_CUDA_MIN_BLOCKS)
#else
#define EMSA_UPDATE_LAUNCH_BOUNDS __launch_bounds__(kUpdateThreads)
#endif
constexpr int kWidestVec = 8;  // 16 bytes of bf16/fp16
static_assert(kElemsPerThread % kWidestVec == 0, "a pass holds whole vectors of every width");
static_assert(kChunkElems % (kUpdateThreads * kElemsPerThread) == 0,
              "full chunks are whole passes");
static_assert(kChunkElems <= (int64_t{1} << 30), "offsets within a chunk are int");

// ---- the variant's memory layout ---------------------------------------------------------------

template <ParamKind kP, bool kGradF32, bool kStateBf16>
struct Layout {
  static constexpr bool kMaster = kP == ParamKind::kBf16Master || kP == ParamKind::kF16Master;
  static constexpr bool kParamF32 = kP == ParamKind::kF32;
  static constexpr bool kHalf = kP == ParamKind::kF16 || kP == ParamKind::kF16Master;
  static constexpr bool kParamRounded = kP == ParamKind::kBf16 || kP == ParamKind::kF16;
  static constexpr bool kGradWide = kGradF32 || kParamF32;
  // A vector is 16 bytes of the widest stream: 4 elements when any stream is fp32, else 8.
  static constexpr bool kAnyF32 = kParamF32 || kMaster || kGradWide || !kStateBf16;
  static constexpr int kVec = kAnyF32 ? 4 : 8;
  static constexpr int kUnroll = kElemsPerThread / kVec;
  static_assert(kElemsPerThread % kVec == 0, "whole vectors per pass");
};

// kVec elements of one stream, as loaded: float4 for fp32 (kVec 4); uint4 (8 x 16 bit) or uint2
// (4 x 16 bit) for 16-bit streams.
template <bool kF32, int kVec>
struct Raw;
template <>
struct Raw<true, 4> {
  uint4 w;
};
template <>
struct Raw<false, 4> {
  uint2 w;
};
template <>
struct Raw<false, 8> {
  uint4 w;
};

// Every byte is touched once per step, so loads and stores are marked evict-first (.cs); a
// tuning build may set EMSA_CUDA_STREAMING_HINTS=0 for plain accesses (scripts/gpu-check sweep).
#ifndef EMSA_CUDA_STREAMING_HINTS
#define EMSA_CUDA_STREAMING_HINTS 1
#endif
template <typename T>
__device__ __forceinline__ T LoadHinted(const T* p) {
#if EMSA_CUDA_STREAMING_HINTS
  return __ldcs(p);
#else
  return *p;
#endif
}
template <typename T>
__device__ __forceinline__ void StoreHinted(T* p, const T& v) {
#if EMSA_CUDA_STREAMING_HINTS
  __stcs(p, v);
#else
  *p = v;
#endif
}

template <bool kF32, int kVec>
__device__ __forceinline__ Raw<kF32, kVec> LoadRaw(const void* base, int offset) {
  Raw<kF32, kVec> r;
  if constexpr (kF32 || kVec == 8) {
    r.w = LoadHinted(
        reinterpret_cast<const uint4*>(static_cast<const char*>(base) + offset * (kF32 ? 4 : 2)));
  } else {
    r.w = LoadHinted(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + offset));
  }
  return r;
}

template <bool kF32, int kVec>
__device__ __forceinline__ void StoreRaw(void* base, int offset, const Raw<kF32, kVec>& r) {
  if constexpr (kF32 || kVec == 8) {
    StoreHinted(reinterpret_cast<uint4*>(static_cast<char*>(base) + offset * (kF32 ? 4 : 2)), r.w);
  } else {
    StoreHinted(reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + offset), r.w);
  }
}

__device__ __forceinline__ uint32_t Word(const uint4& w, int k) {
  return k == 0 ? w.x : k == 1 ? w.y : k == 2 ? w.z : w.w;
}
__device__ __forceinline__ uint32_t Word(const uint2& w, int k) { return k == 0 ? w.x : w.y; }
__device__ __forceinline__ void SetWord(uint4& w, int k, uint32_t x) {
  if (k == 0) w.x = x;
  if (k == 1) w.y = x;
  if (k == 2) w.z = x;
  if (k == 3) w.w = x;
}
__device__ __forceinline__ void SetWord(uint2& w, int k, uint32_t x) {
  if (k == 0) w.x = x;
  if (k == 1) w.y = x;
}

// Element k of a vector as float. kHalf: the 16-bit format is fp16, else bf16.
template <bool kF32, bool kHalf, int kVec>
__device__ __forceinline__ float Unpack(const Raw<kF32, kVec>& r, int k) {
  if constexpr (kF32) {
    return BitsFloat(Word(r.w, k));
  } else {
    const uint32_t bits = (Word(r.w, k >> 1) >> ((k & 1) * 16)) & 0xFFFFu;
    return kHalf ? HalfToFloat(bits) : Bf16ToFloat(bits);
  }
}

// Sets element k from float bits (kF32) or from 16-bit bits in the low half.
template <bool kF32, int kVec>
__device__ __forceinline__ void Pack(Raw<kF32, kVec>& r, int k, uint32_t bits) {
  if constexpr (kF32) {
    SetWord(r.w, k, bits);
  } else if ((k & 1) == 0) {
    SetWord(r.w, k >> 1, bits);
  } else {
    SetWord(r.w, k >> 1, Word(r.w, k >> 1) | (bits << 16));
  }
}

// ---- one chunk ---------------------------------------------------------------------------------

// A chunk's streams, already offset to its first element.
struct ChunkPtrs {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  float* master;
};

// Elements [first, n) of the chunk, one at a time per thread (misaligned tensors; tails).
template <OptimizerKind kOpt, ParamKind kP, bool kGradF32, bool kStateBf16>
__device__ __forceinline__ void UpdateScalar(const ChunkPtrs& t, const StepConsts& c,
                                             const Keys& keys, bool stochastic, uint32_t index_low,
                                             int first, int n) {
  using L = Layout<kP, kGradF32, kStateBf16>;
  constexpr bool kLion = kOpt == OptimizerKind::kLion;
  for (int i = first + static_cast<int>(threadIdx.x); i < n; i += kUpdateThreads) {
    float p;
    if constexpr (L::kMaster) {
      p = t.master[i];
    } else if constexpr (L::kParamF32) {
      p = static_cast<const float*>(t.param)[i];
    } else {
      const uint32_t bits = static_cast<const uint16_t*>(t.param)[i];
      p = L::kHalf ? HalfToFloat(bits) : Bf16ToFloat(bits);
    }
    float g;
    if constexpr (L::kGradWide) {
      g = static_cast<const float*>(t.grad)[i];
    } else {
      const uint32_t bits = static_cast<const uint16_t*>(t.grad)[i];
      g = L::kHalf ? HalfToFloat(bits) : Bf16ToFloat(bits);
    }
    float m, v = 0.0f;
    if constexpr (kStateBf16) {
      m = Bf16ToFloat(static_cast<const uint16_t*>(t.exp_avg)[i]);
      if constexpr (!kLion) v = Bf16ToFloat(static_cast<const uint16_t*>(t.exp_avg_sq)[i]);
    } else {
      m = static_cast<const float*>(t.exp_avg)[i];
      if constexpr (!kLion) v = static_cast<const float*>(t.exp_avg_sq)[i];
    }

    const Stored out = StepElement<kOpt, kP, kStateBf16>(
        c, keys, stochastic, index_low + static_cast<uint32_t>(i), p, g, m, v);
    if constexpr (kStateBf16) {
      static_cast<uint16_t*>(t.exp_avg)[i] = static_cast<uint16_t>(out.exp_avg);
      if constexpr (!kLion)
        static_cast<uint16_t*>(t.exp_avg_sq)[i] = static_cast<uint16_t>(out.exp_avg_sq);
    } else {
      static_cast<float*>(t.exp_avg)[i] = BitsFloat(out.exp_avg);
      if constexpr (!kLion) static_cast<float*>(t.exp_avg_sq)[i] = BitsFloat(out.exp_avg_sq);
    }
    if constexpr (L::kMaster) t.master[i] = out.master;
    if constexpr (L::kParamF32) {
      static_cast<float*>(t.param)[i] = out.master;
    } else {
      static_cast<uint16_t*>(t.param)[i] = static_cast<uint16_t>(out.param);
    }
  }
}

// The chunk's first n / kVec vectors; every stream is 16-byte aligned at the chunk's start.
template <OptimizerKind kOpt, ParamKind kP, bool kGradF32, bool kStateBf16>
__device__ __forceinline__ void UpdateVectors(const ChunkPtrs& t, const StepConsts& c,
                                              const Keys& keys, bool stochastic, uint32_t index_low,
                                              int n) {
  using L = Layout<kP, kGradF32, kStateBf16>;
  constexpr int kVec = L::kVec;
  constexpr int kUnroll = L::kUnroll;
  constexpr bool kLion = kOpt == OptimizerKind::kLion;
  constexpr bool kPF32 = L::kParamF32 || L::kMaster;  // the stream the parameter is read from
  using PRaw = Raw<kPF32, kVec>;
  using GRaw = Raw<L::kGradWide, kVec>;
  using SRaw = Raw<!kStateBf16, kVec>;
  const void* p_src = L::kMaster ? static_cast<const void*>(t.master) : t.param;

  const int vectors = n / kVec;
  for (int v0 = 0; v0 < vectors; v0 += kUpdateThreads * kUnroll) {
    PRaw pr[kUnroll];
    GRaw gr[kUnroll];
    SRaw mr[kUnroll], vr[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int vi = v0 + u * kUpdateThreads + static_cast<int>(threadIdx.x);
      if (vi < vectors) {
        const int off = vi * kVec;
        pr[u] = LoadRaw<kPF32, kVec>(p_src, off);
        gr[u] = LoadRaw<L::kGradWide, kVec>(t.grad, off);
        mr[u] = LoadRaw<!kStateBf16, kVec>(t.exp_avg, off);
        if constexpr (!kLion) vr[u] = LoadRaw<!kStateBf16, kVec>(t.exp_avg_sq, off);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int vi = v0 + u * kUpdateThreads + static_cast<int>(threadIdx.x);
      if (vi < vectors) {
        const int off = vi * kVec;
        PRaw po;               // master / fp32 param out
        Raw<false, kVec> p16;  // 16-bit param out
        SRaw mo, vo;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float p = Unpack<kPF32, L::kHalf, kVec>(pr[u], k);
          const float g = Unpack<L::kGradWide, L::kHalf, kVec>(gr[u], k);
          const float m = Unpack<!kStateBf16, false, kVec>(mr[u], k);
          float v = 0.0f;
          if constexpr (!kLion) v = Unpack<!kStateBf16, false, kVec>(vr[u], k);

          const Stored out = StepElement<kOpt, kP, kStateBf16>(
              c, keys, stochastic, index_low + static_cast<uint32_t>(off + k), p, g, m, v);
          Pack<!kStateBf16, kVec>(mo, k, out.exp_avg);
          if constexpr (!kLion) Pack<!kStateBf16, kVec>(vo, k, out.exp_avg_sq);
          if constexpr (kPF32) Pack<true, kVec>(po, k, FloatBits(out.master));
          if constexpr (!L::kParamF32) Pack<false, kVec>(p16, k, out.param);
        }
        StoreRaw<!kStateBf16, kVec>(t.exp_avg, off, mo);
        if constexpr (!kLion) StoreRaw<!kStateBf16, kVec>(t.exp_avg_sq, off, vo);
        if constexpr (L::kParamF32) StoreRaw<true, kVec>(t.param, off, po);
        if constexpr (L::kMaster) StoreRaw<true, kVec>(t.master, off, po);
        if constexpr (!L::kParamF32) StoreRaw<false, kVec>(t.param, off, p16);
      }
    }
  }
  // The tensor's last n % kVec elements.
  UpdateScalar<kOpt, kP, kGradF32, kStateBf16>(t, c, keys, stochastic, index_low, vectors * kVec,
                                               n);
}

// ---- the kernel --------------------------------------------------------------------------------

// The constants of tensor t's step, recomputed only when its group or step differs from the
// ones `c` was made for. With slots the tensor's slot step stands in for the group's: the same
// double arithmetic and one rounding, so a slot step equal to the group step gives the same bits.
template <OptimizerKind kOpt>
__device__ __forceinline__ void TensorConsts(const UpdateLaunch& a, const DeviceTensor& t,
                                             float grad_multiplier, int32_t& group, int64_t& step,
                                             StepConsts& c) {
  const int64_t s = a.slot_steps != nullptr ? a.slot_steps[t.slot] : 0;
  if (t.group == group && s == step) return;
  group = t.group;
  step = s;
  DeviceGroupScalars g = a.groups[group];
  if (a.slot_steps != nullptr) g.step = s;
  c = MakeStepConsts<kOpt>(g, grad_multiplier);
}

template <OptimizerKind kOpt, ParamKind kP, bool kGradF32, bool kStateBf16>
__global__ void EMSA_UPDATE_LAUNCH_BOUNDS FusedUpdateKernel(const UpdateLaunch a) {
  using L = Layout<kP, kGradF32, kStateBf16>;
  if (a.header->found_inf != 0) return;
  const float grad_multiplier = a.header->grad_multiplier;
  const uint64_t seed = a.header->seed;
  const bool stochastic = a.stochastic_state != 0;
  constexpr bool kNeedKeys = kStateBf16 || L::kParamRounded;

  int32_t group = -1;
  int64_t step = 0;
  StepConsts c{};
  for (int64_t ci = blockIdx.x; ci < a.chunk_count; ci += gridDim.x) {
    const DeviceChunk chunk = a.chunks[ci];
    const DeviceTensor& t = a.tensors[chunk.tensor];
    if (t.flags & kTensorAbsent) continue;
    TensorConsts<kOpt>(a, t, grad_multiplier, group, step, c);
    const int64_t begin = chunk.begin;
    const int64_t left = t.numel - begin;
    const int n = static_cast<int>(left < kChunkElems ? left : kChunkElems);

    Keys keys{0u, 0u};
    if constexpr (kNeedKeys) {
      const uint32_t high = static_cast<uint32_t>(static_cast<uint64_t>(begin) >> 32);
      keys = MakeKeys(seed, c.step, high);
    }
    const uint32_t index_low = static_cast<uint32_t>(static_cast<uint64_t>(begin));

    const int psize = L::kParamF32 ? 4 : 2;
    const int gsize = L::kGradWide ? 4 : 2;
    const int ssize = kStateBf16 ? 2 : 4;
    ChunkPtrs p;
    p.param = static_cast<char*>(t.param) + begin * psize;
    p.grad = static_cast<const char*>(t.grad) + begin * gsize;
    p.exp_avg = static_cast<char*>(t.exp_avg) + begin * ssize;
    p.exp_avg_sq = kOpt == OptimizerKind::kLion
                       ? nullptr
                       : static_cast<void*>(static_cast<char*>(t.exp_avg_sq) + begin * ssize);
    p.master = L::kMaster ? t.master + begin : nullptr;

    if (t.flags & kTensorVector) {
      UpdateVectors<kOpt, kP, kGradF32, kStateBf16>(p, c, keys, stochastic, index_low, n);
    } else {
      UpdateScalar<kOpt, kP, kGradF32, kStateBf16>(p, c, keys, stochastic, index_low, 0, n);
    }
  }
}

// ---- the bulk-copy kernel: fp32 parameters, gradients and states on sm_90 ----------------------
//
// Loads and stores by Hopper bulk copies instead of per-thread 16-byte accesses: with many
// streams at once, bulk copies of 1024-element tiles in a 2-stage ring come closer to a device
// copy's bandwidth than per-thread accesses do. Per block (persistent grid, the chunks round-robin
// as above): thread 0 fills stage k % 2 with tile k of every input stream (one mbarrier per stage,
// its phase completing when the bytes have landed) two tiles ahead; all threads wait for the stage,
// compute from shared memory into one of two output tiles, and thread 0 bulk-stores those after a
// barrier (the output tile is rewritten only once its store has read it: wait_group.read). Tiles
// cover each vector-path chunk's whole 4-element vectors (a tensor's last chunk may end in a
// shorter tile); the rest (tensors off 16-byte alignment, the last n % 4 elements) takes the scalar
// path after the pipeline. The arithmetic is StepElement's, so results are the bits of the other
// path.

constexpr int kBulkTile = 1024;  // elements per tile per stream: 4 KiB of fp32
constexpr int kBulkStages = 2;

template <OptimizerKind kOpt>
struct BulkShape {
  static constexpr int kIn = kOpt == OptimizerKind::kLion ? 3 : 4;  // p, g, m (, v)
  static constexpr int kOut = kIn - 1;                              // p, m (, v)
  static constexpr int kTileVecs = kBulkTile / 4;
  static constexpr size_t kSmemBytes =
      sizeof(float) * (size_t{kBulkStages} * kIn * kBulkTile + size_t{2} * kOut * kBulkTile);
};
static_assert(kBulkTile % (4 * kUpdateThreads) == 0, "a full tile is whole float4s per thread");
static_assert(kChunkElems % kBulkTile == 0, "full chunks are whole tiles");

// A block's walk over its tiles.
struct TileCursor {
  int64_t chunk = 0;  // the chunk's index in the launch
  int tile = 0;       // within the chunk
  int vec_elems = 0;  // the chunk's elements on the bulk path (whole 4-element vectors)
  int64_t begin = 0;  // the chunk's first element within its tensor
  const DeviceTensor* tensor = nullptr;
  __device__ int elems() const {
    const int left = vec_elems - tile * kBulkTile;
    return left < kBulkTile ? left : kBulkTile;
  }
  __device__ int64_t first() const { return begin + int64_t{tile} * kBulkTile; }
};

// Loads chunk ci into the cursor; false when it has no whole vector on the bulk path (or its
// tensor is absent). A tile never leaves its chunk, so it never spans two tensors.
__device__ __forceinline__ bool LoadChunk(const UpdateLaunch& a, int64_t ci, TileCursor& c) {
  const DeviceChunk chunk = a.chunks[ci];
  const DeviceTensor* t = &a.tensors[chunk.tensor];
  if ((t->flags & kTensorVector) == 0 || (t->flags & kTensorAbsent) != 0) return false;
  const int64_t left = t->numel - chunk.begin;
  const int n = static_cast<int>(left < kChunkElems ? left : kChunkElems);
  c.vec_elems = n & ~3;
  c.begin = chunk.begin;
  c.tensor = t;
  return c.vec_elems > 0;
}

// The block's first chunk with whole vectors on the bulk path at or after chunk `from`
// (stepping by the grid), at its first tile; false when none is left.
__device__ __forceinline__ bool SeekTile(const UpdateLaunch& a, int64_t from, TileCursor& c) {
  for (int64_t ci = from; ci < a.chunk_count; ci += gridDim.x) {
    if (LoadChunk(a, ci, c)) {
      c.chunk = ci;
      c.tile = 0;
      return true;
    }
  }
  return false;
}

__device__ __forceinline__ bool NextTile(const UpdateLaunch& a, TileCursor& c) {
  if (++c.tile * kBulkTile < c.vec_elems) return true;
  return SeekTile(a, c.chunk + gridDim.x, c);
}

// The update of one tile in shared memory: `vecs` float4 of each input stream (param, grad,
// exp_avg, exp_avg_sq) from `in`, the results (param, exp_avg, exp_avg_sq) to `out`.
template <OptimizerKind kOpt>
__device__ __forceinline__ void UpdateSharedTile(const StepConsts& c, const float4* in, float4* out,
                                                 int vecs, int tid) {
  using S = BulkShape<kOpt>;
  constexpr bool kLion = kOpt == OptimizerKind::kLion;
  const Keys keys{0u, 0u};  // fp32 stores do not round
  for (int i = tid; i < vecs; i += kUpdateThreads) {
    const float4 p4 = in[i], g4 = in[S::kTileVecs + i], m4 = in[2 * S::kTileVecs + i];
    const float4 v4 = kLion ? float4{} : in[3 * S::kTileVecs + i];
    const float ps[4] = {p4.x, p4.y, p4.z, p4.w}, gs[4] = {g4.x, g4.y, g4.z, g4.w};
    const float ms[4] = {m4.x, m4.y, m4.z, m4.w}, vs[4] = {v4.x, v4.y, v4.z, v4.w};
    float po[4], mo[4], vo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const Stored o =
          StepElement<kOpt, ParamKind::kF32, false>(c, keys, false, 0u, ps[e], gs[e], ms[e], vs[e]);
      po[e] = o.master;
      mo[e] = BitsFloat(o.exp_avg);
      vo[e] = BitsFloat(o.exp_avg_sq);
    }
    out[i] = float4{po[0], po[1], po[2], po[3]};
    out[S::kTileVecs + i] = float4{mo[0], mo[1], mo[2], mo[3]};
    if constexpr (!kLion) out[2 * S::kTileVecs + i] = float4{vo[0], vo[1], vo[2], vo[3]};
  }
}

// What the tiles left: whole chunks of tensors off 16-byte alignment, and the last n % 4
// elements of the others (absent tensors: nothing). `group`, `step` and `c` carry the last
// constants over.
template <OptimizerKind kOpt>
__device__ __forceinline__ void UpdateTileLeftovers(const UpdateLaunch& a, float grad_multiplier,
                                                    int32_t& group, int64_t& step, StepConsts& c) {
  constexpr bool kLion = kOpt == OptimizerKind::kLion;
  const Keys keys{0u, 0u};  // fp32 stores do not round
  for (int64_t ci = blockIdx.x; ci < a.chunk_count; ci += gridDim.x) {
    const DeviceChunk chunk = a.chunks[ci];
    const DeviceTensor& t = a.tensors[chunk.tensor];
    if (t.flags & kTensorAbsent) continue;
    const int64_t left = t.numel - chunk.begin;
    const int n = static_cast<int>(left < kChunkElems ? left : kChunkElems);
    const int from = (t.flags & kTensorVector) ? (n & ~3) : 0;
    if (from == n) continue;
    TensorConsts<kOpt>(a, t, grad_multiplier, group, step, c);
    ChunkPtrs p;
    p.param = static_cast<float*>(t.param) + chunk.begin;
    p.grad = static_cast<const float*>(t.grad) + chunk.begin;
    p.exp_avg = static_cast<float*>(t.exp_avg) + chunk.begin;
    p.exp_avg_sq = kLion ? nullptr : static_cast<float*>(t.exp_avg_sq) + chunk.begin;
    p.master = nullptr;
    UpdateScalar<kOpt, ParamKind::kF32, true, false>(
        p, c, keys, false, static_cast<uint32_t>(static_cast<uint64_t>(chunk.begin)), from, n);
  }
}

template <OptimizerKind kOpt>
__global__ void EMSA_UPDATE_LAUNCH_BOUNDS BulkUpdateKernel(const UpdateLaunch a) {
#if EMSA_HAVE_BULK_COPY
  using S = BulkShape<kOpt>;
  constexpr bool kLion = kOpt == OptimizerKind::kLion;
  if (a.header->found_inf != 0) return;
  const float grad_multiplier = a.header->grad_multiplier;
  extern __shared__ __align__(128) float smem[];
  __shared__ uint64_t full[kBulkStages];
  const int tid = static_cast<int>(threadIdx.x);
  const uint64_t policy = EvictFirstPolicy();
  if (tid == 0) {
    for (int st = 0; st < kBulkStages; ++st) MbarInit(&full[st], 1);
    FenceMbarInit();
  }
  __syncthreads();

  TileCursor use;
  bool more = SeekTile(a, blockIdx.x, use);
  TileCursor fill = use;  // thread 0's, kBulkStages tiles ahead
  bool fill_more = more;
  // Thread 0: loads tile `fill` of every input stream into stage st.
  const auto load = [&](int st) {
    const int64_t at = fill.first();
    const uint32_t bytes = static_cast<uint32_t>(fill.elems()) * 4u;
    const DeviceTensor& t = *fill.tensor;
    const float* src[4] = {static_cast<const float*>(t.param) + at,
                           static_cast<const float*>(t.grad) + at,
                           static_cast<const float*>(t.exp_avg) + at,
                           kLion ? nullptr : static_cast<const float*>(t.exp_avg_sq) + at};
    MbarArriveExpectTx(&full[st], bytes * S::kIn);
    for (int q = 0; q < S::kIn; ++q) {
      BulkLoad(smem + (st * S::kIn + q) * kBulkTile, src[q], bytes, &full[st], policy);
    }
    fill_more = NextTile(a, fill);
  };
  if (tid == 0) {
    for (int st = 0; st < kBulkStages && fill_more; ++st) load(st);
  }

  int32_t group = -1;
  int64_t step = 0;
  StepConsts c{};
  float* const outputs = smem + kBulkStages * S::kIn * kBulkTile;
  for (int64_t k = 0; more; ++k) {
    const int st = static_cast<int>(k % kBulkStages);
    TensorConsts<kOpt>(a, *use.tensor, grad_multiplier, group, step, c);
    const int vecs = use.elems() / 4;
    MbarWait(&full[st], static_cast<uint32_t>((k / kBulkStages) & 1));
    const float4* in = reinterpret_cast<const float4*>(smem + st * S::kIn * kBulkTile);
    float4* out = reinterpret_cast<float4*>(outputs + (k & 1) * S::kOut * kBulkTile);
    UpdateSharedTile<kOpt>(c, in, out, vecs, tid);
    FenceProxyAsyncShared();          // this thread's st.shared before the bulk stores read them
    if (tid == 0) BulkWaitRead<0>();  // the other output tile's stores have read it
    __syncthreads();                  // stage st and the output tile are complete
    if (tid == 0) {
      const int64_t at = use.first();
      const uint32_t bytes = static_cast<uint32_t>(vecs) * 16u;
      const DeviceTensor& t = *use.tensor;
      if (fill_more) load(st);
      const float* o = reinterpret_cast<const float*>(out);
      BulkStore(static_cast<float*>(t.param) + at, o, bytes, policy);
      BulkStore(static_cast<float*>(t.exp_avg) + at, o + kBulkTile, bytes, policy);
      if constexpr (!kLion) {
        BulkStore(static_cast<float*>(t.exp_avg_sq) + at, o + 2 * kBulkTile, bytes, policy);
      }
      BulkCommit();
    }
    more = NextTile(a, use);
  }
  if (tid == 0) BulkWait<0>();  // shared memory must outlive the stores' reads
  UpdateTileLeftovers<kOpt>(a, grad_multiplier, group, step, c);
#endif
}

// ---- dispatch over variants --------------------------------------------------------------------

template <OptimizerKind kOpt, ParamKind kP, bool kGradF32, bool kStateBf16>
UpdateKernelFn KernelOf() {
  if constexpr (kP == ParamKind::kF32 && !kGradF32) {
    return nullptr;  // an fp32 param's own dtype is fp32: that is the kGradF32 variant
  } else {
    return &FusedUpdateKernel<kOpt, kP, kGradF32, kStateBf16>;
  }
}

template <OptimizerKind kOpt, ParamKind kP>
void FillParam(UpdateKernelFn* table) {
  table[VariantIndex({kP, false, false})] = KernelOf<kOpt, kP, false, false>();
  table[VariantIndex({kP, false, true})] = KernelOf<kOpt, kP, false, true>();
  table[VariantIndex({kP, true, false})] = KernelOf<kOpt, kP, true, false>();
  table[VariantIndex({kP, true, true})] = KernelOf<kOpt, kP, true, true>();
}

// Every variant's kernel for one optimizer (null where the variant does not exist).
template <OptimizerKind kOpt>
struct UpdateKernels {
  UpdateKernelFn fn[kVariants] = {};
  UpdateKernelFn bulk = &BulkUpdateKernel<kOpt>;  // the fp32 variant by bulk copies (sm_90)
  UpdateKernels() {
    FillParam<kOpt, ParamKind::kF32>(fn);
    FillParam<kOpt, ParamKind::kBf16>(fn);
    FillParam<kOpt, ParamKind::kF16>(fn);
    FillParam<kOpt, ParamKind::kBf16Master>(fn);
    FillParam<kOpt, ParamKind::kF16Master>(fn);
    static_assert(kParamKinds == 5, "fill every ParamKind");
  }
};

}  // namespace cuda
}  // namespace emsa
