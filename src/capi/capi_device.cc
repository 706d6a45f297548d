// capi_device.cc — the C ABI's device tier: scalars, update tables, device arena, DLPack.
#include "capi/capi_internal.h"

using namespace emsa::capi;  // NOLINT(google-build-using-namespace)

// The C header mirrors the device layout byte for byte.
static_assert(sizeof(emsa_device_step_header) == sizeof(emsa::DeviceStepHeader),
              "emsa_device_step_header must mirror emsa::DeviceStepHeader");
#define EMSA_SAME_OFFSET(field)                                                            \
  static_assert(                                                                           \
      offsetof(emsa_device_step_header, field) == offsetof(emsa::DeviceStepHeader, field), \
      "emsa_device_step_header." #field " must sit where the device has it")
EMSA_SAME_OFFSET(grad_multiplier);
EMSA_SAME_OFFSET(found_inf);
EMSA_SAME_OFFSET(grad_unscale);
EMSA_SAME_OFFSET(max_norm);
EMSA_SAME_OFFSET(seed);
EMSA_SAME_OFFSET(sum_sq);
EMSA_SAME_OFFSET(nonfinite_count);
EMSA_SAME_OFFSET(grad_norm);
EMSA_SAME_OFFSET(clip_coef);
#undef EMSA_SAME_OFFSET

namespace {

// The scalars handle and one group's hyperparameters checked and converted, then fn(h)'s status.
template <class Fn>
emsa_status WithHyper(emsa_device_scalars* scalars, const emsa_hyperparams* hyper, Fn&& fn) {
  return Guard([&] {
    if (scalars == nullptr || hyper == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and hyper must not be NULL");
    }
    emsa::HyperParams h;
    emsa::Status st = ToHyper(hyper, "hyper", &h);
    if (!st.ok()) return Report(st);
    return Report(fn(h));
  });
}

// The tables handle list: non-NULL where count > 0, no NULL entry.
emsa_status CheckTables(emsa_device_table* const* tables, size_t count) {
  if (tables == nullptr && count > 0) {
    return Fail(EMSA_INVALID_ARGUMENT, "tables is NULL but count is " + std::to_string(count));
  }
  for (size_t i = 0; i < count; ++i) {
    if (tables[i] == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "tables[" + std::to_string(i) + "] is NULL");
    }
  }
  return EMSA_OK;
}

// finish_stats, the group steps' advance, then each table's update.
emsa::Status FinishStep(emsa::DeviceScalars& sc, emsa_device_table* const* tables, size_t count,
                        cudaStream_t s) {
  EMSA_RETURN_IF_ERROR(sc.FinishGradStats(s));
  EMSA_RETURN_IF_ERROR(sc.AdvanceSteps(s));
  for (size_t i = 0; i < count; ++i) EMSA_RETURN_IF_ERROR(tables[i]->table->Update(sc, s));
  return emsa::Status::Ok();
}

// The C scalars' groups as HyperParams, then DeviceScalars::Create.
emsa_status CreateScalars(const emsa_hyperparams* groups, size_t count, size_t slot_count,
                          emsa_device_scalars** scalars_out) {
  return Guard([&] {
    if (scalars_out == nullptr || (groups == nullptr && count > 0)) {
      return Fail(EMSA_INVALID_ARGUMENT, "groups and scalars_out must not be NULL");
    }
    std::vector<emsa::HyperParams> hypers(count);
    for (size_t i = 0; i < count; ++i) {
      emsa::Status st = ToHyper(&groups[i], "groups[" + std::to_string(i) + "]", &hypers[i]);
      if (!st.ok()) return Report(st);
    }
    auto scalars = emsa::DeviceScalars::Create(hypers.data(), count, slot_count);
    if (!scalars.ok()) return Report(scalars.status());
    *scalars_out = new emsa_device_scalars{std::move(scalars).value()};
    return Report(emsa::Status::Ok());
  });
}

// The C table options checked and converted (NULL: the defaults).
emsa_status ToTableOptions(const emsa_device_table_options* options, emsa::DeviceTableOptions* o) {
  if (options == nullptr) return EMSA_OK;
  if (emsa_status s =
          CheckSize(options, "emsa_device_table_options", "emsa_device_table_options_init")) {
    return s;
  }
  auto opt = ToOptimizer(options->optimizer);
  if (!opt.ok()) return Report(opt.status());
  if (!IsRounding(options->rounding)) {
    return Fail(EMSA_INVALID_ARGUMENT, "rounding must be an EMSA_ROUNDING_* value");
  }
  if (!IsFlag(options->bulk_copy)) return Fail(EMSA_INVALID_ARGUMENT, "bulk_copy must be 0 or 1");
  if (!IsFlag(options->stats_only)) {
    return Fail(EMSA_INVALID_ARGUMENT, "stats_only must be 0 or 1");
  }
  CopyFields(*options, o);
  return EMSA_OK;
}

// emsa_device_table_create(_slots): slots NULL for group steps.
emsa_status CreateTable(const emsa_tensor_update* tensors, const int32_t* groups,
                        const int64_t* slots, size_t count, size_t slot_count,
                        const emsa_device_table_options* options, emsa_device_table** table_out) {
  return Guard([&] {
    if (table_out == nullptr || (tensors == nullptr && count > 0)) {
      return Fail(EMSA_INVALID_ARGUMENT, "tensors and table_out must not be NULL");
    }
    emsa::DeviceTableOptions o;
    if (emsa_status s = ToTableOptions(options, &o)) return s;
    for (size_t i = 0; slots != nullptr && i < count; ++i) {
      if (slots[i] < 0 || static_cast<uint64_t>(slots[i]) >= slot_count) {
        return Fail(EMSA_INVALID_ARGUMENT, "slots[" + std::to_string(i) + "] is " +
                                               std::to_string(slots[i]) + "; slots are in [0, " +
                                               std::to_string(slot_count) + ")");
      }
    }
    std::vector<emsa::TensorUpdate> updates(count);  // bind time: allocation is fine here
    for (size_t i = 0; i < count; ++i) {
      emsa::Status st = ConvertTensor(tensors[i], i, false, &updates[i], nullptr);
      if (!st.ok()) return Report(st);
    }
    auto table = emsa::DeviceUpdateTable::Create(updates.data(), groups, count, o, slots);
    if (!table.ok()) return Report(table.status());
    *table_out = new emsa_device_table{std::move(table).value()};
    return Report(emsa::Status::Ok());
  });
}

}  // namespace

extern "C" {

// ---- device tier
// ---------------------------------------------------------------------------------

void emsa_device_table_options_init(emsa_device_table_options* o) {
  if (o == nullptr) return;
  InitFields(o);
}

void emsa_device_step_report_init(emsa_device_step_report* r) {
  if (r == nullptr) return;
  *r = emsa_device_step_report{};
  r->struct_size = sizeof(emsa_device_step_report);
}

emsa_status emsa_device_scalars_create(const emsa_hyperparams* groups, size_t count,
                                       emsa_device_scalars** scalars_out) {
  return CreateScalars(groups, count, 0, scalars_out);
}

emsa_status emsa_device_scalars_create_slots(const emsa_hyperparams* groups, size_t group_count,
                                             size_t slot_count, emsa_device_scalars** scalars_out) {
  return CreateScalars(groups, group_count, slot_count, scalars_out);
}

void emsa_device_scalars_destroy(emsa_device_scalars* scalars) { delete scalars; }

emsa_status emsa_device_scalars_set_group(emsa_device_scalars* scalars, size_t group,
                                          const emsa_hyperparams* hyper, int64_t step,
                                          void* stream) {
  return WithHyper(scalars, hyper, [&](const emsa::HyperParams& h) {
    return scalars->scalars->SetGroup(group, h, step, static_cast<cudaStream_t>(stream));
  });
}

emsa_status emsa_device_scalars_set_inputs(emsa_device_scalars* scalars, float grad_unscale,
                                           float max_norm, uint64_t seed, void* stream) {
  return OnHandle(scalars, "scalars", [&](auto& h) {
    return h.scalars->SetInputs(grad_unscale, max_norm, seed, static_cast<cudaStream_t>(stream));
  });
}

emsa_status emsa_device_step(emsa_device_scalars* scalars, emsa_device_table** tables, size_t count,
                             int32_t check_stats, void* stream) {
  return Guard([&] {
    if (scalars == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "scalars is NULL");
    if (emsa_status e = CheckTables(tables, count)) return e;
    auto s = static_cast<cudaStream_t>(stream);
    emsa::DeviceScalars& sc = *scalars->scalars;
    emsa::Status st = sc.BeginStep(s);
    for (size_t i = 0; st.ok() && check_stats && i < count; ++i) {
      st = tables[i]->table->AccumulateGradStats(sc, s);
    }
    if (st.ok()) st = FinishStep(sc, tables, count, s);
    return Report(st);
  });
}

emsa_status emsa_device_begin_step(emsa_device_scalars* scalars, void* stream) {
  return OnHandle(scalars, "scalars",
                  [&](auto& h) { return h.scalars->BeginStep(static_cast<cudaStream_t>(stream)); });
}

emsa_status emsa_device_table_accumulate_stats(emsa_device_table* table,
                                               emsa_device_scalars* scalars, void* stream) {
  return Guard([&] {
    if (table == nullptr || scalars == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "table and scalars must not be NULL");
    }
    return Report(
        table->table->AccumulateGradStats(*scalars->scalars, static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_finish_stats(emsa_device_scalars* scalars, void* stream) {
  return OnHandle(scalars, "scalars", [&](auto& h) {
    return h.scalars->FinishGradStats(static_cast<cudaStream_t>(stream));
  });
}

emsa_status emsa_device_finish_step(emsa_device_scalars* scalars, emsa_device_table** tables,
                                    size_t count, void* stream) {
  return Guard([&] {
    if (scalars == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "scalars is NULL");
    if (emsa_status e = CheckTables(tables, count)) return e;
    return Report(FinishStep(*scalars->scalars, tables, count, static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_scalars_set_unscale_from(emsa_device_scalars* scalars,
                                                 const float* device_scale, void* stream) {
  return Guard([&] {
    if (scalars == nullptr || device_scale == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and device_scale must not be NULL");
    }
    return Report(
        scalars->scalars->SetUnscaleFrom(device_scale, static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_scalars_write_found_inf(const emsa_device_scalars* scalars,
                                                float* device_dst, void* stream) {
  return Guard([&] {
    if (scalars == nullptr || device_dst == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and device_dst must not be NULL");
    }
    return Report(scalars->scalars->WriteFoundInf(device_dst, static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_scalars_read_slot_steps(const emsa_device_scalars* scalars,
                                                int64_t* steps_out, size_t count, void* stream) {
  return Guard([&] {
    if (scalars == nullptr || (steps_out == nullptr && count > 0)) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and steps_out must not be NULL");
    }
    return Report(
        scalars->scalars->ReadSlotSteps(steps_out, count, static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_scalars_set_slot_steps(emsa_device_scalars* scalars, const int64_t* steps,
                                               size_t count, void* stream) {
  return Guard([&] {
    if (scalars == nullptr || (steps == nullptr && count > 0)) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and steps must not be NULL");
    }
    return Report(scalars->scalars->SetSlotSteps(steps, count, static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_table_update(emsa_device_table* table, const emsa_device_scalars* scalars,
                                     void* stream) {
  return Guard([&] {
    if (table == nullptr || scalars == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "table and scalars must not be NULL");
    }
    return Report(table->table->Update(*scalars->scalars, static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_scalars_read(const emsa_device_scalars* scalars,
                                     emsa_device_step_report* report, void* stream) {
  return Guard([&] {
    if (scalars == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "scalars is NULL");
    if (emsa_status s =
            CheckSize(report, "emsa_device_step_report", "emsa_device_step_report_init")) {
      return s;
    }
    emsa::DeviceStepHeader h;
    emsa::Status st = scalars->scalars->Read(&h, nullptr, static_cast<cudaStream_t>(stream));
    if (!st.ok()) return Report(st);
    report->found_inf = h.found_inf != 0;
    report->grad_multiplier = h.grad_multiplier;
    report->clip_coef = h.clip_coef;
    report->sum_sq = h.sum_sq;
    report->grad_norm = h.grad_norm;
    report->nonfinite_count = h.nonfinite_count;
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_device_table_create(const emsa_tensor_update* tensors, const int32_t* groups,
                                     size_t count, const emsa_device_table_options* options,
                                     emsa_device_table** table_out) {
  return CreateTable(tensors, groups, nullptr, count, 0, options, table_out);
}

emsa_status emsa_device_table_create_slots(const emsa_tensor_update* tensors, const int32_t* groups,
                                           const int64_t* slots, size_t count, size_t slot_count,
                                           const emsa_device_table_options* options,
                                           emsa_device_table** table_out) {
  return Guard([&] {
    if (slots == nullptr && count > 0) {
      return Fail(EMSA_INVALID_ARGUMENT,
                  "slots is NULL; pass one slot per tensor (or use emsa_device_table_create)");
    }
    return CreateTable(tensors, groups, slots, count, slot_count, options, table_out);
  });
}

void emsa_device_table_destroy(emsa_device_table* table) { delete table; }

emsa_status emsa_device_scalars_set_hyper(emsa_device_scalars* scalars, size_t group,
                                          const emsa_hyperparams* hyper, void* stream) {
  return WithHyper(scalars, hyper, [&](const emsa::HyperParams& h) {
    return scalars->scalars->SetGroupHyper(group, h, static_cast<cudaStream_t>(stream));
  });
}

emsa_status emsa_device_scalars_read_steps(const emsa_device_scalars* scalars, int64_t* steps_out,
                                           size_t count, void* stream) {
  return Guard([&] {
    if (scalars == nullptr || steps_out == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and steps_out must not be NULL");
    }
    const size_t groups = scalars->scalars->group_count();
    if (count != groups) {
      return Fail(EMSA_INVALID_ARGUMENT, "count is " + std::to_string(count) +
                                             " but the scalars hold " + std::to_string(groups) +
                                             " groups");
    }
    emsa::DeviceStepHeader header;
    std::vector<emsa::DeviceGroupScalars> records(groups);
    emsa::Status st =
        scalars->scalars->Read(&header, records.data(), static_cast<cudaStream_t>(stream));
    if (!st.ok()) return Report(st);
    for (size_t i = 0; i < groups; ++i) steps_out[i] = records[i].step;
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_device_scalars_copy_header(const emsa_device_scalars* scalars,
                                            emsa_device_step_header* dst, void* stream) {
  return Guard([&] {
    if (scalars == nullptr || dst == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and dst must not be NULL");
    }
    return Report(scalars->scalars->CopyHeader(reinterpret_cast<emsa::DeviceStepHeader*>(dst),
                                               static_cast<cudaStream_t>(stream)));
  });
}

emsa_status emsa_device_scalars_header_address(const emsa_device_scalars* scalars,
                                               emsa_device_step_header** header_out) {
  return Guard([&] {
    if (scalars == nullptr || header_out == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "scalars and header_out must not be NULL");
    }
    *header_out = reinterpret_cast<emsa_device_step_header*>(scalars->scalars->device_header());
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_device_table_set_grads(emsa_device_table* table, const void* const* grads,
                                        size_t count, void* stream) {
  return OnHandle(table, "table", [&](auto& h) {
    return h.table->SetGradPointers(grads, count, static_cast<cudaStream_t>(stream));
  });
}

// ---- device arena
// --------------------------------------------------------------------------------

emsa_status emsa_device_arena_create(uint64_t bytes, int32_t device,
                                     emsa_device_arena** arena_out) {
  return Guard([&] {
    if (arena_out == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "arena_out is NULL");
    auto arena = emsa::DeviceArena::Create(bytes, device);
    if (!arena.ok()) return Report(arena.status());
    *arena_out = new emsa_device_arena{std::move(arena).value()};
    return Report(emsa::Status::Ok());
  });
}

void emsa_device_arena_destroy(emsa_device_arena* arena) { delete arena; }

emsa_status emsa_device_arena_info(const emsa_device_arena* arena, void** data_out,
                                   uint64_t* bytes_out, int32_t* kind_out,
                                   char** fallback_reason_out) {
  return Guard([&] {
    if (arena == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "arena is NULL");
    const emsa::DeviceArena& a = *arena->arena;
    char* reason = nullptr;
    if (fallback_reason_out != nullptr) {
      reason = CopyString(a.fallback_reason());
      if (reason == nullptr) return Fail(EMSA_OUT_OF_MEMORY, "cannot allocate the reason");
      *fallback_reason_out = reason;
    }
    if (data_out != nullptr) *data_out = a.data();
    if (bytes_out != nullptr) *bytes_out = a.size();
    if (kind_out != nullptr) {
      *kind_out = a.kind() == emsa::DeviceArena::Kind::kVmm ? EMSA_DEVICE_ARENA_VMM
                                                            : EMSA_DEVICE_ARENA_CUDA_MALLOC;
    }
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_device_arena_export(const emsa_device_arena* arena, uint64_t offset,
                                     const int64_t* shape, int32_t ndim, int32_t dtype,
                                     void** dlmanaged_out) {
  return ExportArenaView(arena, offset, shape, ndim, dtype, dlmanaged_out);
}

void emsa_dlpack_delete(void* dlmanaged) {
  auto* managed = static_cast<DLManagedTensor*>(dlmanaged);
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

emsa_status emsa_device_table_info(const emsa_device_table* table, int64_t* numel_out,
                                   int32_t* launches_out, uint64_t* bytes_out) {
  if (table == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "table is NULL");
  if (numel_out != nullptr) *numel_out = table->table->total_numel();
  if (launches_out != nullptr) *launches_out = table->table->launches_per_update();
  if (bytes_out != nullptr) *bytes_out = table->table->bytes_per_update();
  return Report(emsa::Status::Ok());
}

}  // extern "C"
