// capi_host_tier.cc — the C ABI's host tier.
#include "capi/capi_internal.h"

using namespace emsa::capi;  // NOLINT(google-build-using-namespace)

extern "C" {

// ---- host tier ----------------------------------------------------------------------------------
void emsa_host_tier_tensor_init(emsa_host_tier_tensor* tensor) {
  if (tensor == nullptr) return;
  std::memset(tensor, 0, sizeof(*tensor));
  tensor->struct_size = sizeof(emsa_host_tier_tensor);
  emsa_tensor_update_init(&tensor->update);
}

// The C options' defaults are HostTierOptions'.
void emsa_host_tier_options_init(emsa_host_tier_options* options) {
  if (options == nullptr) return;
  InitFields(options);
}

void emsa_host_tier_step_stats_init(emsa_host_tier_step_stats* stats) {
  if (stats == nullptr) return;
  std::memset(stats, 0, sizeof(*stats));
  stats->struct_size = sizeof(emsa_host_tier_step_stats);
}

int32_t emsa_host_tier_threads(int32_t cores) { return emsa::HostTierThreads(cores); }

emsa_status emsa_host_tier_create(emsa_cpu_updater* updater, const emsa_host_tier_tensor* tensors,
                                  size_t count, size_t bucket_count, size_t group_count,
                                  void* d2h_stream, void* h2d_stream,
                                  const emsa_host_tier_options* options,
                                  emsa_host_tier** tier_out) {
  return Guard([&] {
    if (updater == nullptr || tier_out == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "updater and tier_out must not be NULL");
    }
    if (tensors == nullptr && count > 0) return Fail(EMSA_INVALID_ARGUMENT, "tensors is NULL");
    if (emsa_status s =
            CheckSize(options, "emsa_host_tier_options", "emsa_host_tier_options_init")) {
      return s;
    }
    emsa::HostTierOptions o;
    auto kind = ToOptimizer(options->optimizer);
    if (!kind.ok()) return Report(kind.status());
    if (!IsRounding(options->rounding)) {
      return Fail(EMSA_INVALID_ARGUMENT, "rounding must be EMSA_ROUNDING_NEAREST or _STOCHASTIC");
    }
    if (!IsFlag(options->submit_in_backward)) {
      return Fail(EMSA_INVALID_ARGUMENT, "submit_in_backward must be 0 or 1");
    }
    if (!IsFlag(options->device_delta)) {
      return Fail(EMSA_INVALID_ARGUMENT, "device_delta must be 0 or 1");
    }
    if (!IsFlag(options->gated)) return Fail(EMSA_INVALID_ARGUMENT, "gated must be 0 or 1");
    CopyFields(*options, &o);
    std::vector<emsa::HostTierTensor> converted(count);
    for (size_t i = 0; i < count; ++i) {
      const emsa_host_tier_tensor& t = tensors[i];
      if (t.struct_size != sizeof(emsa_host_tier_tensor)) {
        return Fail(EMSA_INVALID_ARGUMENT, "tensors[" + std::to_string(i) +
                                               "].struct_size mismatch; call "
                                               "emsa_host_tier_tensor_init() first");
      }
      emsa::Status st = ConvertTensor(t.update, i, false, &converted[i].update, nullptr);
      if (!st.ok()) return Report(st);
      converted[i].group = t.group;
      converted[i].bucket = t.bucket;
      converted[i].device_param = t.device_param;
      if (t.device_update != 0 && t.device_update != 1) {
        return Fail(EMSA_INVALID_ARGUMENT,
                    "tensors[" + std::to_string(i) + "].device_update must be 0 or 1");
      }
      converted[i].device_update = t.device_update == 1;
    }
    auto tier = emsa::HostTier::Create(
        updater->updater.get(), converted.data(), count, bucket_count, group_count,
        static_cast<cudaStream_t>(d2h_stream), static_cast<cudaStream_t>(h2d_stream), o);
    if (!tier.ok()) return Report(tier.status());
    *tier_out =
        new emsa_host_tier{std::move(tier).value(), std::vector<emsa::HyperParams>(group_count)};
    return Report(emsa::Status::Ok());
  });
}

void emsa_host_tier_destroy(emsa_host_tier* tier) { delete tier; }

emsa_status emsa_host_tier_begin_step(emsa_host_tier* tier, const emsa_hyperparams* hypers,
                                      const int64_t* steps, size_t group_count) {
  return Guard([&] {
    if (tier == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "tier is NULL");
    if ((hypers == nullptr || steps == nullptr) && group_count > 0) {
      return Fail(EMSA_INVALID_ARGUMENT, "hypers and steps must not be NULL");
    }
    std::vector<emsa::HyperParams>& h = tier->hypers;  // sized at create: no allocation here
    if (group_count != h.size()) {
      return Report(tier->tier->BeginStep(nullptr, steps, group_count));  // names the count
    }
    for (size_t g = 0; g < group_count; ++g) {
      emsa::Status st = ToHyper(&hypers[g], "hypers[" + std::to_string(g) + "]", &h[g]);
      if (!st.ok()) return Report(st);
    }
    return Report(tier->tier->BeginStep(h.data(), steps, group_count));
  });
}

emsa_status emsa_host_tier_begin_step_gated(emsa_host_tier* tier, const emsa_hyperparams* hypers,
                                            size_t group_count, int32_t gated) {
  return Guard([&] {
    if (tier == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "tier is NULL");
    if (hypers == nullptr && group_count > 0) {
      return Fail(EMSA_INVALID_ARGUMENT, "hypers must not be NULL");
    }
    if (!IsFlag(gated)) return Fail(EMSA_INVALID_ARGUMENT, "gated must be 0 or 1");
    std::vector<emsa::HyperParams>& h = tier->hypers;  // sized at create: no allocation here
    if (group_count != h.size()) {
      return Report(tier->tier->BeginStepGated(nullptr, group_count, gated == 1));  // names it
    }
    for (size_t g = 0; g < group_count; ++g) {
      emsa::Status st = ToHyper(&hypers[g], "hypers[" + std::to_string(g) + "]", &h[g]);
      if (!st.ok()) return Report(st);
    }
    return Report(tier->tier->BeginStepGated(h.data(), group_count, gated == 1));
  });
}

emsa_status emsa_host_tier_release(emsa_host_tier* tier, const emsa_device_scalars* scalars,
                                   void* stream) {
  if (scalars == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "scalars is NULL");
  return OnHandle(tier, "tier", [&](auto& h) {
    return h.tier->Release(scalars->scalars->device_header(), static_cast<cudaStream_t>(stream));
  });
}

emsa_status emsa_host_tier_release_values(emsa_host_tier* tier, float grad_multiplier,
                                          int32_t found_inf) {
  if (!IsFlag(found_inf)) return Fail(EMSA_INVALID_ARGUMENT, "found_inf must be 0 or 1");
  return OnHandle(tier, "tier",
                  [&](auto& h) { return h.tier->ReleaseValues(grad_multiplier, found_inf == 1); });
}

emsa_status emsa_host_tier_read_steps(const emsa_host_tier* tier, int64_t* out, size_t count) {
  if (tier == nullptr) return Fail(EMSA_INVALID_ARGUMENT, "tier is NULL");
  if (out == nullptr && count > 0) return Fail(EMSA_INVALID_ARGUMENT, "out is NULL");
  return Guard([&] { return Report(tier->tier->ReadSteps(out, count)); });
}

emsa_status emsa_host_tier_set_steps(emsa_host_tier* tier, const int64_t* steps, size_t count) {
  if (steps == nullptr && count > 0) return Fail(EMSA_INVALID_ARGUMENT, "steps is NULL");
  return OnHandle(tier, "tier", [&](auto& h) { return h.tier->SetSteps(steps, count); });
}

int32_t emsa_host_tier_last_skipped(const emsa_host_tier* tier) {
  return tier == nullptr ? -1 : (tier->tier->last_skipped() ? 1 : 0);
}

emsa_status emsa_host_tier_submit(emsa_host_tier* tier, size_t bucket, const void* const* grads,
                                  size_t count, void* stream) {
  return OnHandle(tier, "tier", [&](auto& h) {
    return h.tier->Submit(bucket, grads, count, static_cast<cudaStream_t>(stream));
  });
}

emsa_status emsa_host_tier_wait(emsa_host_tier* tier, size_t bucket, void* stream) {
  return OnHandle(tier, "tier",
                  [&](auto& h) { return h.tier->Wait(bucket, static_cast<cudaStream_t>(stream)); });
}

emsa_status emsa_host_tier_wait_grads_copied(emsa_host_tier* tier, void* stream) {
  return OnHandle(tier, "tier", [&](auto& h) {
    return h.tier->WaitGradsCopied(static_cast<cudaStream_t>(stream));
  });
}

emsa_status emsa_host_tier_synchronize(emsa_host_tier* tier) {
  return OnHandle(tier, "tier", [&](auto& h) { return h.tier->Synchronize(); });
}

int64_t emsa_host_tier_copies_enqueued(const emsa_host_tier* tier) {
  return tier == nullptr ? -1 : tier->tier->copies_enqueued();
}

void* emsa_host_tier_update_stream(const emsa_host_tier* tier) {
  return tier == nullptr ? nullptr : static_cast<void*>(tier->tier->update_stream());
}

int64_t emsa_host_tier_stream_staging_bytes(const emsa_host_tier_options* options,
                                            int32_t state_dtype, int64_t largest) {
  if (options == nullptr || options->struct_size != sizeof(emsa_host_tier_options) || largest < 1) {
    return -1;
  }
  auto dtype = ToDType(state_dtype, "state_dtype");
  auto kind = ToOptimizer(options->optimizer);
  if (!dtype.ok() || !kind.ok()) return -1;
  emsa::HostTierOptions o;
  o.optimizer = *kind;
  o.stream_piece_elements = options->stream_piece_elements;
  o.stream_slots = options->stream_slots;
  return emsa::HostTier::StreamStagingBytes(o, *dtype, largest);
}

int32_t emsa_host_tier_bucket_copies_enqueued(const emsa_host_tier* tier, size_t bucket) {
  if (tier == nullptr || bucket >= tier->tier->bucket_count()) return -1;
  return tier->tier->BucketCopiesEnqueued(bucket) ? 1 : 0;
}

emsa_status emsa_host_tier_trace(const emsa_host_tier* tier, double* submit, double* start,
                                 double* end, size_t count) {
  return Guard([&] {
    if (tier == nullptr || submit == nullptr || start == nullptr || end == nullptr) {
      return Fail(EMSA_INVALID_ARGUMENT, "tier and the three output arrays must not be NULL");
    }
    if (count != tier->tier->bucket_count()) {
      return Fail(EMSA_INVALID_ARGUMENT, "count must be the tier's bucket count, " +
                                             std::to_string(tier->tier->bucket_count()));
    }
    tier->tier->Trace(submit, start, end, count);
    return Report(emsa::Status::Ok());
  });
}

emsa_status emsa_host_tier_stats(const emsa_host_tier* tier, int64_t first,
                                 emsa_host_tier_step_stats* out, size_t capacity,
                                 size_t* count_out) {
  return Guard([&] {
    if (tier == nullptr || count_out == nullptr || (out == nullptr && capacity > 0)) {
      return Fail(EMSA_INVALID_ARGUMENT, "tier, count_out and out must not be NULL");
    }
    std::vector<emsa::HostTierStepStats> got(capacity);
    size_t n = tier->tier->Stats(first, got.data(), capacity);
    for (size_t i = 0; i < n; ++i) {
      if (out[i].struct_size != sizeof(emsa_host_tier_step_stats)) {
        return Fail(EMSA_INVALID_ARGUMENT,
                    "out[" + std::to_string(i) +
                        "].struct_size mismatch; call emsa_host_tier_step_stats_init() first");
      }
      out[i].step = got[i].step;
      out[i].d2h_s = got[i].d2h_s;
      out[i].cpu_s = got[i].cpu_s;
      out[i].h2d_s = got[i].h2d_s;
      out[i].wait_s = got[i].wait_s;
      out[i].buckets = got[i].buckets;
      out[i].complete = got[i].complete ? 1 : 0;
      out[i].grad_wait_s = got[i].grad_wait_s;
      out[i].worker_s = got[i].worker_s;
      out[i].device_buckets = got[i].device_buckets;
      out[i].stream_up_s = got[i].stream_up_s;
      out[i].gated = got[i].gated ? 1 : 0;
      out[i].skipped = got[i].skipped ? 1 : 0;
    }
    *count_out = n;
    return Report(emsa::Status::Ok());
  });
}

}  // extern "C"
