// capi_cpu.cc — the C ABI's host arena, CPU updater and CPU step.
#include "capi/capi_internal.h"

using namespace emsa::capi;  // NOLINT(google-build-using-namespace)

static_assert(static_cast<int>(emsa::HostPin::kNone) == EMSA_HOST_PIN_NONE &&
                  static_cast<int>(emsa::HostPin::kRegistered) == EMSA_HOST_PIN_REGISTERED &&
                  static_cast<int>(emsa::HostPin::kHostAlloc) == EMSA_HOST_PIN_HOST_ALLOC,
              "emsa_host_arena_facts.pin mirrors emsa::HostPin");

namespace {

// The C options as HostArenaOptions; NULL stands for the defaults.
emsa_status ToArenaOptions(const emsa_host_arena_options* c, emsa::HostArenaOptions* out) {
  if (c == nullptr) return EMSA_OK;
  const emsa_status size = CheckSize(c, "emsa_host_arena_options", "emsa_host_arena_options_init");
  if (size != EMSA_OK) return size;
  if (!IsFlag(c->want_pinned)) {
    return Fail(EMSA_INVALID_ARGUMENT, "want_pinned is " + std::to_string(c->want_pinned) +
                                           "; use 0 (plain) or 1 (pinned)");
  }
  if (!IsFlag(c->populate_in_background)) {
    return Fail(EMSA_INVALID_ARGUMENT,
                "populate_in_background is " + std::to_string(c->populate_in_background) +
                    "; use 0 (before creation returns) or 1 (in the background)");
  }
  if (c->fill_threads < 0) {
    return Fail(EMSA_INVALID_ARGUMENT, "fill_threads is " + std::to_string(c->fill_threads) +
                                           "; use 0 (every CPU) or a thread count");
  }
  CopyFields(*c, out);
  return EMSA_OK;
}

}  // namespace

extern "C" {

// ---- host arena
// ----------------------------------------------------------------------------------

void emsa_host_arena_options_init(emsa_host_arena_options* options) {
  if (options == nullptr) return;
  InitFields(options);
}

emsa_status emsa_host_arena_check(uint64_t bytes, const emsa_host_arena_options* options) {
  return Guard([&] {
    emsa::HostArenaOptions o;
    const emsa_status converted = ToArenaOptions(options, &o);
    if (converted != EMSA_OK) return converted;
    return Report(emsa::HostArena::CheckFits(bytes, o));
  });
}

emsa_status emsa_host_arena_create_with(uint64_t bytes, const emsa_host_arena_options* options,
                                        emsa_host_arena** arena_out) {
  return Guard([&] {
    if (arena_out == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "arena_out is NULL");
    emsa::HostArenaOptions o;
    const emsa_status converted = ToArenaOptions(options, &o);
    if (converted != EMSA_OK) return converted;
    auto arena = emsa::HostArena::Create(bytes, o);
    if (!arena.ok()) return Report(arena.status());
    *arena_out = new emsa_host_arena{std::move(arena).value()};
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_host_arena_create(uint64_t bytes, int32_t want_pinned,
                                   emsa_host_arena** arena_out) {
  emsa_host_arena_options options;
  emsa_host_arena_options_init(&options);
  options.want_pinned = want_pinned;
  return emsa_host_arena_create_with(bytes, &options, arena_out);
}

void emsa_host_arena_destroy(emsa_host_arena* arena) { delete arena; }

emsa_status emsa_host_arena_export(const emsa_host_arena* arena, uint64_t offset,
                                   const int64_t* shape, int32_t ndim, int32_t dtype,
                                   void** dlmanaged_out) {
  return ExportArenaView(arena, offset, shape, ndim, dtype, dlmanaged_out);
}

emsa_status emsa_host_arena_info(const emsa_host_arena* arena, void** data_out, uint64_t* bytes_out,
                                 int32_t* pinned_out) {
  if (arena == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "arena is NULL");
  if (data_out != nullptr) *data_out = arena->arena->data();
  if (bytes_out != nullptr) *bytes_out = arena->arena->size();
  if (pinned_out != nullptr) *pinned_out = arena->arena->kind() == emsa::HostArena::Kind::kPinned;
  return Report(emsa::Status::Ok());
}

void emsa_host_arena_facts_init(emsa_host_arena_facts* facts) {
  if (facts == nullptr) return;
  *facts = emsa_host_arena_facts{};
  facts->struct_size = sizeof(emsa_host_arena_facts);
}

emsa_status emsa_host_arena_describe(const emsa_host_arena* arena, emsa_host_arena_facts* facts,
                                     char** fallback_reason_out) {
  return Guard([&] {
    if (arena == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "arena is NULL");
    const emsa_status size =
        CheckSize(facts, "emsa_host_arena_facts", "emsa_host_arena_facts_init");
    if (size != EMSA_OK) return size;
    const emsa::HostArenaFacts f = arena->arena->facts();
    if (fallback_reason_out != nullptr) {
      char* reason = CopyString(f.fallback_reason);
      if (reason == nullptr) return Fail(EMSA_OUT_OF_MEMORY, "cannot allocate the reason");
      *fallback_reason_out = reason;
    }
    Fields<emsa_host_arena_facts>::ForEach(*facts, f, [](auto& to, const auto& from) {
      to = static_cast<std::remove_reference_t<decltype(to)>>(from);
    });
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_host_arena_wait_populated(const emsa_host_arena* arena, uint64_t offset) {
  return Guard([&] {
    if (arena == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "arena is NULL");
    return Report(arena->arena->WaitPopulated(offset));
  });
}

// ---- CPU step
// ------------------------------------------------------------------------------------

void emsa_hyperparams_init(emsa_hyperparams* h) {
  if (h == nullptr) return;
  InitFields(h);
}

void emsa_tensor_update_init(emsa_tensor_update* t) {
  if (t == nullptr) return;
  *t = emsa_tensor_update{};
  t->struct_size = sizeof(emsa_tensor_update);
  t->step = 1;
}

void emsa_step_options_init(emsa_step_options* o) {
  if (o == nullptr) return;
  InitFields(o);
}

void emsa_step_report_init(emsa_step_report* r) {
  if (r == nullptr) return;
  *r = emsa_step_report{sizeof(emsa_step_report), 0, 0, -1};
}

emsa_status emsa_cpu_updater_create(int32_t threads, int32_t max_simd,
                                    emsa_cpu_updater** updater_out) {
  return Guard([&] {
    if (updater_out == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "updater_out is NULL");
    if (max_simd < EMSA_SIMD_SCALAR || max_simd > EMSA_SIMD_AVX512) {
      return Fail(EMSA_INVALID_ARGUMENT, "max_simd must be an EMSA_SIMD_* value");
    }
    emsa::CpuUpdaterOptions options;
    options.threads = threads;
    options.max_simd = static_cast<emsa::SimdLevel>(max_simd);
    auto updater = emsa::CpuUpdater::Create(options);
    if (!updater.ok()) return Report(updater.status());
    *updater_out = new emsa_cpu_updater{std::move(updater).value()};
    return Report(emsa::Status::Ok());
  });
}

void emsa_cpu_updater_destroy(emsa_cpu_updater* updater) { delete updater; }

emsa_status emsa_cpu_updater_info(const emsa_cpu_updater* updater, int32_t* threads_out,
                                  int32_t* simd_out) {
  if (updater == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "updater is NULL");
  if (threads_out != nullptr) *threads_out = updater->updater->threads();
  if (simd_out != nullptr) *simd_out = static_cast<int32_t>(updater->updater->simd());
  return Report(emsa::Status::Ok());
}

emsa_status emsa_cpu_grad_stats(emsa_cpu_updater* updater, const emsa_tensor_update* tensors,
                                size_t count, double* sum_sq_out, int64_t* nonfinite_out) {
  return Guard([&] {
    if (updater == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "updater is NULL");
    if (tensors == nullptr && count > 0) return Fail(EMSA_INVALID_ARGUMENT, "tensors is NULL");
    double total = 0.0;
    int64_t bad = 0;
    emsa::Status s =
        ForEachChunk(tensors, count, [&](const emsa::TensorUpdate* u, size_t n, size_t base) {
          double sq = 0.0;
          int64_t nf = 0;
          emsa::Status st = updater->updater->GradStats(u, n, &sq, &nf);
          total += sq;
          bad += nf;
          return st.ok() ? st : st.Annotate("chunk at tensor " + std::to_string(base));
        });
    if (!s.ok()) return Report(s);
    if (sum_sq_out != nullptr) *sum_sq_out = total;
    if (nonfinite_out != nullptr) *nonfinite_out = bad;
    return Report(emsa::Status::Ok());
  });
}

}  // extern "C"

namespace {

// The finite check over a whole batch, chunk by chunk, before any update: the non-finite count
// and the first tensor holding one go into *result, which is marked skipped if there are any.
emsa::Status ScanFinite(emsa::CpuUpdater& updater, const emsa_tensor_update* tensors, size_t count,
                        emsa::StepReport* result) {
  int64_t bad = 0, first_bad = -1;
  emsa::Status s =
      ForEachChunk(tensors, count, [&](const emsa::TensorUpdate* u, size_t n, size_t base) {
        double sq = 0.0;
        int64_t nf = 0;
        EMSA_RETURN_IF_ERROR(updater.GradStats(u, n, &sq, &nf));
        if (nf > 0 && first_bad < 0) {
          for (size_t i = 0; i < n && first_bad < 0; ++i) {
            double sqi = 0.0;
            int64_t nfi = 0;
            EMSA_RETURN_IF_ERROR(updater.GradStats(u + i, 1, &sqi, &nfi));
            if (nfi > 0) first_bad = static_cast<int64_t>(base + i);
          }
        }
        bad += nf;
        return emsa::Status::Ok();
      });
  EMSA_RETURN_IF_ERROR(s);
  if (bad > 0) {
    result->skipped = true;
    result->nonfinite_count = bad;
    result->first_nonfinite_tensor = first_bad;
  }
  return emsa::Status::Ok();
}

}  // namespace

extern "C" {

emsa_status emsa_cpu_step(emsa_cpu_updater* updater, const emsa_tensor_update* tensors,
                          size_t count, const emsa_step_options* options,
                          emsa_step_report* report) {
  return Guard([&] {
    if (updater == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "updater is NULL");
    if (tensors == nullptr && count > 0) return Fail(EMSA_INVALID_ARGUMENT, "tensors is NULL");
    if (report != nullptr && report->struct_size != sizeof(emsa_step_report)) {
      return Fail(EMSA_INVALID_ARGUMENT,
                  "emsa_step_report.struct_size mismatch; call emsa_step_report_init() first");
    }
    auto opts = ToStepOptions(options);
    if (!opts.ok()) return Report(opts.status());
    emsa::StepOptions step = *opts;
    emsa::StepReport result;
    // Batches larger than one chunk: the finite check must see every tensor before any update,
    // so it runs over all chunks first and the chunked updates then run without it.
    if (count > kChunk && step.check_finite) {
      emsa::Status s = ScanFinite(*updater->updater, tensors, count, &result);
      if (!s.ok()) return Report(s);
      step.check_finite = false;
    }
    if (!result.skipped) {
      // Validate every chunk before the first update so an invalid tensor late in the batch
      // leaves the early ones untouched.
      if (count > kChunk) {
        emsa::Status v =
            ForEachChunk(tensors, count, [&](const emsa::TensorUpdate* u, size_t n, size_t base) {
              emsa::Status st = updater->updater->Validate(u, n, step);
              return st.ok() ? st : st.Annotate("tensors from index " + std::to_string(base));
            });
        if (!v.ok()) return Report(v);
      }
      emsa::Status s =
          ForEachChunk(tensors, count, [&](const emsa::TensorUpdate* u, size_t n, size_t base) {
            emsa::StepReport part;
            emsa::Status st = updater->updater->Step(u, n, step, &part);
            if (part.skipped) {
              result.skipped = true;
              result.nonfinite_count += part.nonfinite_count;
              if (result.first_nonfinite_tensor < 0) {
                result.first_nonfinite_tensor =
                    static_cast<int64_t>(base) + part.first_nonfinite_tensor;
              }
            }
            return st;
          });
      if (!s.ok()) return Report(s);
    }
    if (report != nullptr) {
      report->skipped = result.skipped ? 1 : 0;
      report->nonfinite_count = result.nonfinite_count;
      report->first_nonfinite_tensor = result.first_nonfinite_tensor;
    }
    return Report(emsa::Status::Ok());
  });
}

}  // extern "C"
