// emsa/device_engine.h — the device tier's step in backward: each bucket's fused update runs on
// a side stream as soon as its gradients are final, overlapped with the rest of backward.
//
// Per bucket b (a DeviceUpdateTable, in gradient-ready order), per step:
//
//   Submit(b, compute)   records ready[b] on the compute stream (everything enqueued there so
//                        far: the bucket's gradients, its new gradient pointers, the step's
//                        scalars); the side stream waits on it, runs b's update and records
//                        done[b]. The compute stream goes on with backward at once.
//   Wait(b, stream)      `stream` waits on done[b] (before it reads b's parameters or writes its
//                        gradients); nothing when b was never submitted.
//   WaitAll(stream)      `stream` waits for every update submitted so far (one event recorded
//                        on the side stream): the end of a pass, before the next forward.
//
// Why it is safe to update a parameter while backward goes on: a bucket is submitted only when
// every gradient in it is final, and after a parameter's gradient is accumulated nothing later
// in the same backward reads the parameter (its gradient's producers were its last readers).
// The caller keeps gradients alive until the side stream is done with them (torch:
// Tensor.record_stream on the side stream) and makes the next forward wait (WaitAll, or Wait
// per bucket).
//
// Nothing is allocated after Create(): two events per bucket and one for WaitAll are made
// there. The tables, the scalars and the side stream belong to the caller and must outlive the
// engine; the destructor waits for the side stream. Not thread-safe: one host thread (or a
// lock) drives an engine. Without a CUDA build Create() returns kUnsupported.
#pragma once

#include <cstddef>
#include <memory>

#include "emsa/status.h"

typedef struct CUstream_st* cudaStream_t;

namespace emsa {

class DeviceScalars;
class DeviceUpdateTable;

class DeviceEngine {
 public:
  // tables[b] is bucket b (none null; all on the device current now, as the scalars and the
  // stream). Errors: kInvalidArgument for a null or foreign-device table or scalars;
  // kUnsupported without CUDA.
  static Result<std::unique_ptr<DeviceEngine>> Create(DeviceUpdateTable* const* tables,
                                                      size_t count, const DeviceScalars* scalars,
                                                      cudaStream_t side);
  ~DeviceEngine();
  DeviceEngine(const DeviceEngine&) = delete;
  DeviceEngine& operator=(const DeviceEngine&) = delete;

  Status Submit(size_t bucket, cudaStream_t compute);
  Status Wait(size_t bucket, cudaStream_t stream);
  Status WaitAll(cudaStream_t stream);
  // The host waits until every submitted update has finished.
  Status Synchronize();

  size_t bucket_count() const;
  // Updates submitted since Create (every Submit counts once).
  long long submitted() const;

 private:
  struct Impl;
  explicit DeviceEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace emsa
