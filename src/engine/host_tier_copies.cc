// host_tier_copies.cc — GradCopies and Uploads (host_tier_copies.h).
#include "engine/host_tier_copies.h"

#if EMSA_HAVE_CUDA

#include <algorithm>

#include "emsa/cpu_update.h"
#include "kernels/cuda/apply_delta.h"

namespace emsa {

namespace {

Status ElapsedSeconds(cudaEvent_t start, cudaEvent_t end, double* out) {
  float ms = 0.0f;
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, end));
  *out = ms * 1e-3;
  return Status::Ok();
}

}  // namespace

Status GradCopies::Init(const std::vector<TensorUpdate>& updates, int64_t piece_elements,
                        bool timed) {
  timed_ = timed;
  held_.assign(updates.size(), nullptr);
  int64_t total = 0;
  for (const TensorUpdate& u : updates) {
    staging_.push_back(static_cast<char*>(const_cast<void*>(u.grad)));
    total += u.numel;
  }
  for (int64_t first = 0;;) {
    const int64_t last =
        piece_elements == 0 || total - first <= piece_elements
            ? total
            : CpuUpdater::Aligned(updates.data(), updates.size(), first + piece_elements);
    Piece piece;
    piece.first = first;
    piece.last = last;
    piece.copy_begin = copies_.size();
    int64_t start = 0;  // tensor k's first element in the bucket
    for (size_t k = 0; k < updates.size(); start += updates[k].numel, ++k) {
      const int64_t lo = std::max(first, start) - start;
      const int64_t hi = std::min(last, start + updates[k].numel) - start;
      if (lo >= hi) continue;
      const size_t size = DTypeSize(updates[k].grad_dtype);
      copies_.push_back({k, static_cast<size_t>(lo) * size, static_cast<size_t>(hi - lo) * size});
    }
    piece.copy_end = copies_.size();
    // The worker waits on these: blocking sync lets it sleep instead of spinning on a core the
    // CPU pool and the thread launching the forward both need.
    EMSA_RETURN_IF_ERROR(piece.landed.Create(cudaEventBlockingSync));
    if (timed) EMSA_RETURN_IF_ERROR(piece.start.Create(cudaEventDefault));
    pieces_.push_back(std::move(piece));
    if (last >= total) break;
    first = last;
  }
  return start_.Create(cudaEventDefault);
}

void GradCopies::Hold(const void* const* grads, size_t count) {
  std::copy(grads, grads + count, held_.begin());
  enqueued_ = 0;
}

Status GradCopies::EnqueuePiece(const Piece& piece, const void* const* grads, cudaStream_t d2h) {
  if (piece.start) EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(piece.start.get(), d2h));
  for (size_t c = piece.copy_begin; c < piece.copy_end; ++c) {
    const Copy& copy = copies_[c];
    EMSA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(staging_[copy.tensor] + copy.offset,
                        static_cast<const char*>(grads[copy.tensor]) + copy.offset, copy.bytes,
                        cudaMemcpyDeviceToHost, d2h));
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(piece.landed.get(), d2h));
  return Status::Ok();
}

Status GradCopies::EnqueueAll(const void* const* grads, cudaStream_t d2h) {
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_.get(), d2h));
  for (const Piece& piece : pieces_) EMSA_RETURN_IF_ERROR(EnqueuePiece(piece, grads, d2h));
  return Status::Ok();
}

Status GradCopies::EnqueueNext(cudaStream_t d2h) {
  EMSA_RETURN_IF_ERROR(EnqueuePiece(pieces_[enqueued_], held_.data(), d2h));
  ++enqueued_;
  return Status::Ok();
}

Status GradCopies::Seconds(double* out) const {
  if (!timed_) return ElapsedSeconds(start_.get(), all_landed(), out);
  *out = 0.0;  // the copies' own times: the span between them is the pacing's wait
  for (const Piece& piece : pieces_) {
    double seconds = 0.0;
    EMSA_RETURN_IF_ERROR(ElapsedSeconds(piece.start.get(), piece.landed.get(), &seconds));
    *out += seconds;
  }
  return Status::Ok();
}

Status Uploads::Init(const std::vector<TensorUpdate>& updates,
                     const std::vector<void*>& device_params, const std::vector<int32_t>& groups,
                     float* staging, int64_t staging_elements, bool copies) {
  for (size_t k = 0; copies && k < updates.size(); ++k) {
    const TensorUpdate& u = updates[k];
    if (u.numel == 0) continue;
    if (u.delta == nullptr) {
      copies_.push_back(
          {device_params[k], u.param, static_cast<size_t>(u.numel) * DTypeSize(u.param_dtype)});
      continue;
    }
    for (int64_t at = 0; at < u.numel; at += staging_elements) {
      copies_.push_back(
          {staging, u.delta + at,
           static_cast<size_t>(std::min(u.numel - at, staging_elements)) * sizeof(float),
           static_cast<float*>(device_params[k]) + at, groups[k]});
    }
  }
  EMSA_RETURN_IF_ERROR(start_.Create(cudaEventDefault));
  return done_.Create(cudaEventBlockingSync);  // the worker and Synchronize wait on it
}

Status Uploads::Enqueue(const std::vector<float>& decays, cudaStream_t h2d) {
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_.get(), h2d));
  for (const Copy& copy : copies_) {
    EMSA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(copy.dst, copy.src, copy.bytes, cudaMemcpyHostToDevice, h2d));
    if (copy.apply != nullptr) {
      EMSA_RETURN_IF_ERROR(cuda::LaunchApplyDelta(copy.apply, static_cast<const float*>(copy.dst),
                                                  static_cast<int64_t>(copy.bytes / sizeof(float)),
                                                  decays[static_cast<size_t>(copy.group)], h2d));
    }
  }
  EMSA_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_.get(), h2d));
  return Status::Ok();
}

Status Uploads::Seconds(double* out) const {
  return ElapsedSeconds(start_.get(), done_.get(), out);
}

}  // namespace emsa

#endif  // EMSA_HAVE_CUDA
