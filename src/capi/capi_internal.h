// capi_internal.h — what the C ABI's translation units share: the opaque handles' definitions,
// the error plumbing (Report, Fail, Guard, OnHandle), string returns, struct_size checks and the
// converters from the C structs to the core's.
//
// Every entry point catches nothing because the core throws nothing; what can throw here is
// std::bad_alloc from building strings, which Guard turns into EMSA_OUT_OF_MEMORY at the boundary.
#ifndef EMSA_CAPI_CAPI_INTERNAL_H_
#define EMSA_CAPI_CAPI_INTERNAL_H_

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "capi/capi_fields.h"
#include "emsa/cpu_update.h"
#include "emsa/cuda_update.h"
#include "emsa/device_arena.h"
#include "emsa/emsa.h"
#include "emsa/host_arena.h"
#include "emsa/host_tier.h"
#include "emsa/model_config.h"
#include "emsa/plan.h"
#include "emsa/probe_record.h"
#include "emsa/profile.h"
#include "emsa/types.h"
#include "memory/dlpack_export.h"
#include "tools/cli.h"

struct emsa_plan {
  emsa::Plan plan;
};
struct emsa_host_arena {
  std::shared_ptr<emsa::HostArena> arena;  // shared with the DLPack exports of its views
};
struct emsa_device_arena {
  std::shared_ptr<emsa::DeviceArena> arena;
};
struct emsa_cpu_updater {
  std::unique_ptr<emsa::CpuUpdater> updater;
};
struct emsa_host_load {
  std::unique_ptr<emsa::HostLoad> load;
};
struct emsa_device_scalars {
  std::unique_ptr<emsa::DeviceScalars> scalars;
};
struct emsa_device_table {
  std::unique_ptr<emsa::DeviceUpdateTable> table;
};
struct emsa_host_tier {
  std::unique_ptr<emsa::HostTier> tier;
  std::vector<emsa::HyperParams> hypers;  // one per group: begin_step converts into it in place
};

namespace emsa::capi {

// The message emsa_last_error returns: this thread's last failure, empty after a success.
const char* LastError() noexcept;

emsa_status Report(const emsa::Status& status) noexcept;
emsa_status Fail(emsa_status code, const std::string& message) noexcept;
// For a literal message: no std::string is built at the call, so unguarded entries stay safe.
emsa_status Fail(emsa_status code, const char* message) noexcept;

// Wraps a body so an allocation failure becomes a status instead of crossing the C boundary.
template <typename Fn>
emsa_status Guard(Fn&& fn) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return Fail(EMSA_OUT_OF_MEMORY, "out of host memory inside emsa");
  } catch (...) {
    return Fail(EMSA_INTERNAL, "unexpected exception inside emsa; please report it");
  }
}

// A guarded call on a handle: NULL is EMSA_INVALID_ARGUMENT naming it; otherwise the Status
// fn(*handle) returns.
template <typename Handle, typename Fn>
emsa_status OnHandle(Handle* handle, const char* name, Fn&& fn) {
  return Guard([&] {
    if (handle == nullptr) return Fail(EMSA_INVALID_ARGUMENT, std::string(name) + " is NULL");
    return Report(fn(*handle));
  });
}

// A malloc'd copy the caller frees with emsa_free; NULL when out of memory.
char* CopyString(const std::string& s);
emsa_status ReturnString(const std::string& s, char** out);

// A versioned struct from the caller: struct_size must be one this library knows.
template <typename T>
emsa_status CheckSize(const T* s, const char* type, const char* init) {
  if (s == nullptr) return Fail(EMSA_INVALID_ARGUMENT, std::string(type) + " pointer is NULL");
  if (s->struct_size != sizeof(T)) {
    return Fail(EMSA_INVALID_ARGUMENT,
                std::string(type) + ".struct_size is " + std::to_string(s->struct_size) +
                    ", this library expects " + std::to_string(sizeof(T)) + "; call " + init +
                    "() first, and use the emsa.h that matches the library");
  }
  return EMSA_OK;
}

emsa::Result<emsa::DType> ToDType(int32_t v, const char* field);
emsa::Result<emsa::OptimizerKind> ToOptimizer(int32_t v);
emsa::Status ToHyper(const emsa_hyperparams* h, const std::string& where, emsa::HyperParams* out);
emsa::Result<emsa::StepOptions> ToStepOptions(const emsa_step_options* o);
// An EMSA_ROUNDING_* value; a 0/1 flag of a C struct.
bool IsRounding(int32_t v);
bool IsFlag(int32_t v);

// The C tensors are converted in fixed-size chunks on the stack: no heap allocation per step,
// whatever the tensor count.
constexpr size_t kChunk = 64;

// One C tensor to the core's form. With need_hyper, .hyper must be valid and is copied into
// *hyper (the device tier reads hyperparameters from its scalars instead and passes false).
emsa::Status ConvertTensor(const emsa_tensor_update& t, size_t index, bool need_hyper,
                           emsa::TensorUpdate* u, emsa::HyperParams* hyper);
emsa::Status ConvertChunk(const emsa_tensor_update* in, size_t base, size_t n,
                          emsa::TensorUpdate* out, emsa::HyperParams* hyper);

// Calls fn(updates, n, base) for each chunk of converted tensors.
template <typename Fn>
emsa::Status ForEachChunk(const emsa_tensor_update* tensors, size_t count, Fn&& fn) {
  emsa::TensorUpdate updates[kChunk];
  emsa::HyperParams hyper[kChunk];
  for (size_t base = 0; base < count; base += kChunk) {
    size_t n = count - base < kChunk ? count - base : kChunk;
    EMSA_RETURN_IF_ERROR(ConvertChunk(tensors + base, base, n, updates, hyper));
    EMSA_RETURN_IF_ERROR(fn(updates, n, base));
  }
  return emsa::Status::Ok();
}

// Shape and dtype of a DLPack export from the C arguments.
emsa::Status ExportArgs(const int64_t* shape, int32_t ndim, int32_t dtype,
                        std::vector<int64_t>* dims, emsa::DType* type);

// One view of a host or device arena (either handle holds a shared_ptr `arena`) as DLPack.
template <typename Handle>
emsa_status ExportArenaView(const Handle* handle, uint64_t offset, const int64_t* shape,
                            int32_t ndim, int32_t dtype, void** dlmanaged_out) {
  return Guard([&] {
    if (handle == nullptr || dlmanaged_out == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "arena and dlmanaged_out must not be NULL");
    }
    std::vector<int64_t> dims;
    emsa::DType type;
    emsa::Status st = ExportArgs(shape, ndim, dtype, &dims, &type);
    if (!st.ok()) return Report(st);
    emsa::Result<DLManagedTensor*> exported = emsa::ExportView(handle->arena, offset, dims, type);
    if (!exported.ok()) return Report(exported.status());
    *dlmanaged_out = *exported;
    return Report(emsa::Status::Ok());
  });
}

}  // namespace emsa::capi

#endif  // EMSA_CAPI_CAPI_INTERNAL_H_
