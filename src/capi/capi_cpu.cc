// capi_cpu.cc — the C ABI's host arena, CPU updater and CPU step.
#include <cmath>

#include "capi/capi_internal.h"
#include "kernels/step_verdict.h"

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

// One pass over a whole batch's gradients, chunk by chunk, before any update: the sum of
// squares, the non-finite count and the first tensor holding a non-finite element.
struct BatchStats {
  double sum_sq = 0.0;
  int64_t nonfinite = 0;
  int64_t first_bad = -1;
};

emsa::Status ScanBatch(emsa::CpuUpdater& updater, const emsa_tensor_update* tensors, size_t count,
                       BatchStats* out) {
  *out = BatchStats{};
  return ForEachChunk(tensors, count, [&](const emsa::TensorUpdate* u, size_t n, size_t base) {
    double sq = 0.0;
    int64_t nf = 0;
    EMSA_RETURN_IF_ERROR(updater.GradStats(u, n, &sq, &nf));
    if (nf > 0 && out->first_bad < 0) {
      for (size_t i = 0; i < n && out->first_bad < 0; ++i) {
        double sqi = 0.0;
        int64_t nfi = 0;
        EMSA_RETURN_IF_ERROR(updater.GradStats(u + i, 1, &sqi, &nfi));
        if (nfi > 0) out->first_bad = static_cast<int64_t>(base + i);
      }
    }
    out->sum_sq += sq;
    out->nonfinite += nf;
    return emsa::Status::Ok();
  });
}

// Every chunk of the batch validated, before anything is read or written.
emsa::Status ValidateChunks(emsa::CpuUpdater& updater, const emsa_tensor_update* tensors,
                            size_t count, const emsa::StepOptions& step) {
  return ForEachChunk(tensors, count, [&](const emsa::TensorUpdate* u, size_t n, size_t base) {
    emsa::Status st = updater.Validate(u, n, step);
    return st.ok() || count <= kChunk ? st
                                      : st.Annotate("tensors from index " + std::to_string(base));
  });
}

// The update of a batch that is not skipped: every chunk validated before the first update, so
// an invalid tensor late in the batch leaves the early ones untouched. step.check_finite, when
// set, applies per chunk, which is the whole batch when it fits one chunk.
emsa::Status UpdateBatch(emsa::CpuUpdater& updater, const emsa_tensor_update* tensors, size_t count,
                         const emsa::StepOptions& step, emsa::StepReport* result) {
  if (count > kChunk) EMSA_RETURN_IF_ERROR(ValidateChunks(updater, tensors, count, step));
  return ForEachChunk(tensors, count, [&](const emsa::TensorUpdate* u, size_t n, size_t base) {
    emsa::StepReport part;
    emsa::Status st = updater.Step(u, n, step, &part);
    if (part.skipped) {
      result->skipped = true;
      result->nonfinite_count += part.nonfinite_count;
      if (result->first_nonfinite_tensor < 0) {
        result->first_nonfinite_tensor = static_cast<int64_t>(base) + part.first_nonfinite_tensor;
      }
    }
    return st;
  });
}

// The checks every CPU step makes of its inputs, before anything is read.
emsa::Result<emsa::StepOptions> StepInputs(const emsa_cpu_updater* updater,
                                           const emsa_tensor_update* tensors, size_t count,
                                           const emsa_step_options* options) {
  if (updater == nullptr) return emsa::Status::InvalidArgument("updater is NULL");
  if (tensors == nullptr && count > 0) return emsa::Status::InvalidArgument("tensors is NULL");
  return ToStepOptions(options);
}

emsa::Status CheckGate(const emsa_step_gate& gate) {
  if (!IsFlag(gate.stats_given)) {
    return emsa::Status::InvalidArgument("gate->stats_given is " +
                                         std::to_string(gate.stats_given) + "; use 0 or 1");
  }
  if (!(gate.max_norm >= 0.0f)) {
    return emsa::Status::InvalidArgument("gate->max_norm is " + std::to_string(gate.max_norm) +
                                         "; use a positive number, or 0 for no clipping");
  }
  if (gate.stats_given && gate.nonfinite_count < 0) {
    return emsa::Status::InvalidArgument("gate->nonfinite_count is " +
                                         std::to_string(gate.nonfinite_count) +
                                         "; it counts elements, >= 0");
  }
  return emsa::Status::Ok();
}

}  // namespace

extern "C" {

emsa_status emsa_cpu_step(emsa_cpu_updater* updater, const emsa_tensor_update* tensors,
                          size_t count, const emsa_step_options* options,
                          emsa_step_report* report) {
  return Guard([&] {
    if (report != nullptr && report->struct_size != sizeof(emsa_step_report)) {
      return Fail(EMSA_INVALID_ARGUMENT,
                  "emsa_step_report.struct_size mismatch; call emsa_step_report_init() first");
    }
    auto opts = StepInputs(updater, tensors, count, options);
    if (!opts.ok()) return Report(opts.status());
    emsa::StepOptions step = *opts;
    emsa::StepReport result;
    // Batches larger than one chunk: the finite check must see every tensor before any update,
    // so it runs over all chunks first and the chunked updates then run without it.
    if (count > kChunk && step.check_finite) {
      BatchStats stats;
      emsa::Status s = ScanBatch(*updater->updater, tensors, count, &stats);
      if (!s.ok()) return Report(s);
      if (stats.nonfinite > 0) {
        result.skipped = true;
        result.nonfinite_count = stats.nonfinite;
        result.first_nonfinite_tensor = stats.first_bad;
      }
      step.check_finite = false;
    }
    if (!result.skipped) {
      emsa::Status s = UpdateBatch(*updater->updater, tensors, count, step, &result);
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

void emsa_step_gate_init(emsa_step_gate* gate) {
  if (gate == nullptr) return;
  *gate = emsa_step_gate{};
  gate->struct_size = sizeof(emsa_step_gate);
  gate->loss_scale = 1.0f;
}

void emsa_step_verdict_init(emsa_step_verdict* verdict) {
  if (verdict == nullptr) return;
  *verdict = emsa_step_verdict{};
  verdict->struct_size = sizeof(emsa_step_verdict);
  verdict->first_nonfinite_tensor = -1;
  verdict->clip_coef = 1.0f;
  verdict->grad_multiplier = 1.0f;
}

emsa_status emsa_cpu_step_gated(emsa_cpu_updater* updater, const emsa_tensor_update* tensors,
                                size_t count, const emsa_step_options* options,
                                const emsa_step_gate* gate, emsa_step_verdict* verdict) {
  return Guard([&] {
    if (gate == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "gate is NULL");
    emsa_status size = CheckSize(gate, "emsa_step_gate", "emsa_step_gate_init");
    if (size != EMSA_OK) return size;
    if (verdict != nullptr) {
      size = CheckSize(verdict, "emsa_step_verdict", "emsa_step_verdict_init");
      if (size != EMSA_OK) return size;
    }
    emsa::Status checked = CheckGate(*gate);
    if (!checked.ok()) return Report(checked);
    auto opts = StepInputs(updater, tensors, count, options);
    if (!opts.ok()) return Report(opts.status());
    emsa::StepOptions step = *opts;
    // An invalid batch fails before the scan.
    emsa::Status valid = ValidateChunks(*updater->updater, tensors, count, step);
    if (!valid.ok()) return Report(valid);
    BatchStats stats;
    if (gate->stats_given) {
      stats.sum_sq = gate->sum_sq;
      stats.nonfinite = gate->nonfinite_count;
    } else {
      emsa::Status s = ScanBatch(*updater->updater, tensors, count, &stats);
      if (!s.ok()) return Report(s);
    }
    const emsa::verdict::Decision d = emsa::verdict::Decide(
        stats.sum_sq, stats.nonfinite, emsa::verdict::UnscaleOf(gate->loss_scale), gate->max_norm);
    if (d.skip && gate->stats_given) {
      // The first offending tensor, where this caller's part of the batch holds one.
      BatchStats local;
      emsa::Status s = ScanBatch(*updater->updater, tensors, count, &local);
      if (!s.ok()) return Report(s);
      stats.first_bad = local.first_bad;
    }
    if (!d.skip) {
      step.grad_multiplier = d.grad_multiplier;
      step.check_finite = false;
      emsa::StepReport result;
      emsa::Status s = UpdateBatch(*updater->updater, tensors, count, step, &result);
      if (!s.ok()) return Report(s);
    }
    if (verdict != nullptr) {
      verdict->skipped = d.skip ? 1 : 0;
      verdict->nonfinite_count = stats.nonfinite;
      verdict->first_nonfinite_tensor = d.skip ? stats.first_bad : -1;
      verdict->sum_sq = stats.sum_sq;
      verdict->grad_norm = d.grad_norm;
      verdict->clip_coef = d.clip_coef;
      verdict->grad_multiplier = d.grad_multiplier;
    }
    return Report(emsa::Status::Ok());
  });
}

}  // extern "C"
