// host_tier_copies.h — the host tier's copies of one bucket: its gradients down into their
// pinned staging buffers (GradCopies) and its new parameters, or their deltas, up (Uploads).
//
// Each object belongs to one bucket and is touched by one thread at a time (the host tier's
// Submit caller or its worker, ordered by the tier's queue). Built at Create: nothing is
// allocated per step. Every copy and event goes through the tier's CopyEngine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "emsa/update.h"
#include "engine/copy_engine.h"

namespace emsa {

// A bucket's gradients, copied down whole at Submit or, paced, a piece at a time by the worker.
// Pieces are elements [first, last) of the bucket (counted across its tensors), cut where
// CpuUpdater::StepRange accepts a cut, so the CPU can update each piece as it lands.
class GradCopies {
 public:
  // piece_elements: where to cut (0: one piece for the bucket). timed: each piece's copy gets
  // its own start event (paced copies wait between pieces, and that wait is not copy time).
  Status Init(CopyEngine* engine, const std::vector<TensorUpdate>& updates, int64_t piece_elements,
              bool timed);

  // Paced: Submit's device pointers, read when the pieces are enqueued; the next piece is the
  // first.
  void Hold(const void* const* grads, size_t count);
  // Enqueues every piece on `d2h` from `grads` (Submit's device pointers, one per tensor; a
  // null one, an absent tensor, is not copied).
  Status EnqueueAll(const void* const* grads, cudaStream_t d2h);
  // Paced: enqueues the next piece on `d2h` from the held pointers.
  Status EnqueueNext(cudaStream_t d2h);

  size_t pieces() const { return pieces_.size(); }
  size_t enqueued() const { return enqueued_; }
  bool all_enqueued() const { return enqueued_ == pieces_.size(); }
  // Marks every piece enqueued (copied by EnqueueAll in its place).
  void SetAllEnqueued() { enqueued_ = pieces_.size(); }
  int64_t last(size_t piece) const { return pieces_[piece].last; }
  int64_t elements() const { return pieces_.back().last; }
  cudaEvent_t landed(size_t piece) const { return pieces_[piece].landed.get(); }
  cudaEvent_t first_landed() const { return landed(0); }
  // The last piece has landed: all of them have (one stream, in order).
  cudaEvent_t all_landed() const { return pieces_.back().landed.get(); }
  // The copies' own time, once all have landed.
  Status Seconds(double* out) const;

 private:
  struct Copy {  // part of one tensor's gradient: `bytes` at byte `offset`
    size_t tensor;
    size_t offset;
    size_t bytes;
  };
  struct Piece {
    int64_t first = 0, last = 0;
    size_t copy_begin = 0, copy_end = 0;
    EngineEvent landed;  // recorded on the D2H stream after the piece's copies
    EngineEvent start;   // timed only: recorded before them
  };
  Status EnqueuePiece(const Piece& piece, const void* const* grads, cudaStream_t d2h);

  CopyEngine* engine_ = nullptr;
  std::vector<char*> staging_;  // per tensor: its host staging buffer
  std::vector<Copy> copies_;
  std::vector<Piece> pieces_;
  EngineEvent start_;  // not timed: before the first piece, for the copies' span
  bool timed_ = false;
  std::vector<const void*> held_;  // paced: Submit's device pointers
  size_t enqueued_ = 0;            // paced: pieces enqueued this step
};

// A bucket's upload: each tensor's new parameter or, where TensorUpdate::delta is set (device
// delta), its change copied into the device staging buffer a part at a time, each part applied
// by a kernel (p = p * decay + delta) before the next overwrites it. All on the H2D stream.
class Uploads {
 public:
  // staging: device, staging_elements floats (null without deltas). copies: false for a bucket
  // the GPU updates, whose done() event its own path records.
  Status Init(CopyEngine* engine, const std::vector<TensorUpdate>& updates,
              const std::vector<void*>& device_params, const std::vector<int32_t>& groups,
              float* staging, int64_t staging_elements, bool copies);
  // Enqueues the copies (and kernels) on h2d between its start and done events; decays: per
  // group, this step's 1 - lr*wd as the CPU kernels round it; present: per tensor, whether it
  // was updated this step (the others are not uploaded).
  Status Enqueue(const std::vector<float>& decays, const std::vector<uint8_t>& present,
                 cudaStream_t h2d);
  // The upload is done (for a GPU-updated bucket: its kernels).
  cudaEvent_t done() const { return done_.get(); }
  // Whether it reads the gradient staging (a delta, or a 16-bit parameter rounded over its
  // gradient): the next gradient copy into it must wait for done().
  bool reads_grads() const { return reads_grads_; }
  // The last upload's time, once done.
  Status Seconds(double* out) const;

 private:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    float* apply = nullptr;  // device parameters p = p * decay + dst, bytes / 4 of them
    int32_t group = 0;
    size_t tensor = 0;  // of the bucket
  };
  CopyEngine* engine_ = nullptr;
  std::vector<Copy> copies_;
  bool reads_grads_ = false;
  EngineEvent start_, done_;
};

}  // namespace emsa
