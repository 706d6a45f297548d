// host_tier_copies.cc — GradCopies and Uploads (host_tier_copies.h).
#include "engine/host_tier_copies.h"

#include <algorithm>

#include "emsa/cpu_update.h"

namespace emsa {

Status GradCopies::Init(CopyEngine* engine, const std::vector<TensorUpdate>& updates,
                        int64_t piece_elements, bool timed) {
  engine_ = engine;
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
    EMSA_RETURN_IF_ERROR(piece.landed.Create(engine, /*timed=*/true, /*blocking=*/true));
    if (timed) EMSA_RETURN_IF_ERROR(piece.start.Create(engine, true, false));
    pieces_.push_back(std::move(piece));
    if (last >= total) break;
    first = last;
  }
  return start_.Create(engine, true, false);
}

void GradCopies::Hold(const void* const* grads, size_t count) {
  std::copy(grads, grads + count, held_.begin());
  enqueued_ = 0;
}

Status GradCopies::EnqueuePiece(const Piece& piece, const void* const* grads, cudaStream_t d2h) {
  if (piece.start) EMSA_RETURN_IF_ERROR(engine_->Record(piece.start.get(), d2h));
  for (size_t c = piece.copy_begin; c < piece.copy_end; ++c) {
    const Copy& copy = copies_[c];
    if (grads[copy.tensor] == nullptr) continue;  // absent this step
    EMSA_RETURN_IF_ERROR(engine_->CopyToHost(
        staging_[copy.tensor] + copy.offset,
        static_cast<const char*>(grads[copy.tensor]) + copy.offset, copy.bytes, d2h));
  }
  EMSA_RETURN_IF_ERROR(engine_->Record(piece.landed.get(), d2h));
  return Status::Ok();
}

Status GradCopies::EnqueueAll(const void* const* grads, cudaStream_t d2h) {
  EMSA_RETURN_IF_ERROR(engine_->Record(start_.get(), d2h));
  for (const Piece& piece : pieces_) EMSA_RETURN_IF_ERROR(EnqueuePiece(piece, grads, d2h));
  return Status::Ok();
}

Status GradCopies::EnqueueNext(cudaStream_t d2h) {
  EMSA_RETURN_IF_ERROR(EnqueuePiece(pieces_[enqueued_], held_.data(), d2h));
  ++enqueued_;
  return Status::Ok();
}

Status GradCopies::Seconds(double* out) const {
  if (!timed_) return engine_->ElapsedSeconds(start_.get(), all_landed(), out);
  *out = 0.0;  // the copies' own times: the span between them is the pacing's wait
  for (const Piece& piece : pieces_) {
    double seconds = 0.0;
    EMSA_RETURN_IF_ERROR(engine_->ElapsedSeconds(piece.start.get(), piece.landed.get(), &seconds));
    *out += seconds;
  }
  return Status::Ok();
}

Status Uploads::Init(CopyEngine* engine, const std::vector<TensorUpdate>& updates,
                     const std::vector<void*>& device_params, const std::vector<int32_t>& groups,
                     float* staging, int64_t staging_elements, bool copies) {
  engine_ = engine;
  for (size_t k = 0; copies && k < updates.size(); ++k) {
    const TensorUpdate& u = updates[k];
    if (u.numel == 0) continue;
    reads_grads_ = reads_grads_ || u.delta != nullptr || u.param == u.grad;
    if (u.delta == nullptr) {
      copies_.push_back({device_params[k], u.param,
                         static_cast<size_t>(u.numel) * DTypeSize(u.param_dtype), nullptr, 0, k});
      continue;
    }
    for (int64_t at = 0; at < u.numel; at += staging_elements) {
      copies_.push_back(
          {staging, u.delta + at,
           static_cast<size_t>(std::min(u.numel - at, staging_elements)) * sizeof(float),
           static_cast<float*>(device_params[k]) + at, groups[k], k});
    }
  }
  EMSA_RETURN_IF_ERROR(start_.Create(engine, /*timed=*/true, /*blocking=*/false));
  return done_.Create(engine, true, true);  // the worker and Synchronize wait on it
}

Status Uploads::Enqueue(const std::vector<float>& decays, const std::vector<uint8_t>& present,
                        cudaStream_t h2d) {
  EMSA_RETURN_IF_ERROR(engine_->Record(start_.get(), h2d));
  for (const Copy& copy : copies_) {
    if (present[copy.tensor] == 0) continue;  // not updated this step
    EMSA_RETURN_IF_ERROR(engine_->CopyToDevice(copy.dst, copy.src, copy.bytes, h2d));
    if (copy.apply != nullptr) {
      EMSA_RETURN_IF_ERROR(engine_->ApplyDelta(copy.apply, static_cast<const float*>(copy.dst),
                                               static_cast<int64_t>(copy.bytes / sizeof(float)),
                                               decays[static_cast<size_t>(copy.group)], h2d));
    }
  }
  EMSA_RETURN_IF_ERROR(engine_->Record(done_.get(), h2d));
  return Status::Ok();
}

Status Uploads::Seconds(double* out) const {
  return engine_->ElapsedSeconds(start_.get(), done_.get(), out);
}

}  // namespace emsa
