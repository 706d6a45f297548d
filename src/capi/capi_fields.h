// capi_fields.h — one field list per C options struct of the C ABI (emsa.h and its parts),
// serving both directions.
//
// An emsa_*_init fills the C struct from the C++ struct's defaults through the list (InitFields),
// and a create call fills the C++ struct from the caller's C struct through the same list
// (CopyFields), so a field added to both structs is added in one place and the defaults stay in
// the C++ options. The list only copies: enums go through int32_t, bool through 0/1 (any non-zero
// C value is true), a stream through void*. A field whose C value must be checked first (an
// enum, a flag that must be 0 or 1) is checked by the caller before CopyFields, with its own
// message.
#ifndef EMSA_CAPI_CAPI_FIELDS_H_
#define EMSA_CAPI_CAPI_FIELDS_H_

#include <cstring>
#include <type_traits>

#include "emsa/cuda_update.h"
#include "emsa/emsa.h"
#include "emsa/host_arena.h"
#include "emsa/host_tier.h"
#include "emsa/model_config.h"
#include "emsa/plan.h"
#include "emsa/update.h"

namespace emsa::capi {

// Fields<C>::ForEach(c, cpp, fn) calls fn(c.field, cpp.field) for each field the two share;
// Fields<C>::Cpp is the C++ struct C mirrors.
template <typename C>
struct Fields;

template <>
struct Fields<emsa_plan_options> {
  using Cpp = emsa::PlanOptions;
  template <typename CRef, typename CppRef, typename Fn>
  static void ForEach(CRef& c, CppRef& cpp, Fn fn) {
    fn(c.optimizer, cpp.optimizer);
    fn(c.state_dtype, cpp.state_dtype);
    fn(c.allow_host_tier, cpp.allow_host_tier);
    fn(c.force_all_host, cpp.force_all_host);
    fn(c.budget_bytes, cpp.budget_bytes);
    fn(c.safety_margin_bytes, cpp.safety_margin_bytes);
    fn(c.bucket_bytes, cpp.bucket_bytes);
    fn(c.release_grads, cpp.release_grads);
    fn(c.device_update_share, cpp.device_update_share);
    fn(c.gated_steps, cpp.gated_steps);
  }
};

template <>
struct Fields<emsa_model_options> {
  using Cpp = emsa::ModelProbeOptions;
  template <typename CRef, typename CppRef, typename Fn>
  static void ForEach(CRef& c, CppRef& cpp, Fn fn) {
    fn(c.activation_checkpointing, cpp.activation_checkpointing);
    fn(c.batch, cpp.batch);
    fn(c.seq_len, cpp.seq_len);
    fn(c.param_dtype, cpp.param_dtype);
    fn(c.matmul_flops, cpp.matmul_flops);
    fn(c.eager_attention, cpp.eager_attention);
  }
};

template <>
struct Fields<emsa_host_arena_options> {
  using Cpp = emsa::HostArenaOptions;
  template <typename CRef, typename CppRef, typename Fn>
  static void ForEach(CRef& c, CppRef& cpp, Fn fn) {
    fn(c.want_pinned, cpp.want_pinned);
    fn(c.fill_threads, cpp.fill_threads);
    fn(c.available_bytes, cpp.available_bytes);
    fn(c.locked_bytes, cpp.locked_bytes);
    fn(c.populate_in_background, cpp.populate_in_background);
  }
};

// The other way: emsa_host_arena_describe fills the C facts from the arena's (pin goes through
// int32_t; HostPin's values are the EMSA_HOST_PIN_* ones, checked in capi_cpu.cc).
template <>
struct Fields<emsa_host_arena_facts> {
  using Cpp = emsa::HostArenaFacts;
  template <typename CRef, typename CppRef, typename Fn>
  static void ForEach(CRef& c, CppRef& cpp, Fn fn) {
    fn(c.pin, cpp.pin);
    fn(c.huge_pages, cpp.huge_pages);
    fn(c.fill_threads, cpp.fill_threads);
    fn(c.locked_bytes, cpp.locked_bytes);
    fn(c.pageable_bytes, cpp.pageable_bytes);
    fn(c.locked_limit_bytes, cpp.locked_limit_bytes);
    fn(c.fill_seconds, cpp.fill_seconds);
    fn(c.pin_seconds, cpp.pin_seconds);
    fn(c.populate_seconds, cpp.populate_seconds);
    fn(c.populate_in_background, cpp.populate_in_background);
    fn(c.populated, cpp.populated);
  }
};

template <>
struct Fields<emsa_hyperparams> {
  using Cpp = emsa::HyperParams;
  template <typename CRef, typename CppRef, typename Fn>
  static void ForEach(CRef& c, CppRef& cpp, Fn fn) {
    fn(c.lr, cpp.lr);
    fn(c.beta1, cpp.beta1);
    fn(c.beta2, cpp.beta2);
    fn(c.eps, cpp.eps);
    fn(c.weight_decay, cpp.weight_decay);
    fn(c.maximize, cpp.maximize);
  }
};

template <>
struct Fields<emsa_step_options> {
  using Cpp = emsa::StepOptions;
  template <typename CRef, typename CppRef, typename Fn>
  static void ForEach(CRef& c, CppRef& cpp, Fn fn) {
    fn(c.optimizer, cpp.optimizer);
    fn(c.grad_multiplier, cpp.grad_multiplier);
    fn(c.check_finite, cpp.check_finite);
    fn(c.rounding, cpp.rounding);
    fn(c.seed, cpp.seed);
  }
};

template <>
struct Fields<emsa_device_table_options> {
  using Cpp = emsa::DeviceTableOptions;
  template <typename CRef, typename CppRef, typename Fn>
  static void ForEach(CRef& c, CppRef& cpp, Fn fn) {
    fn(c.optimizer, cpp.optimizer);
    fn(c.rounding, cpp.rounding);
    fn(c.bulk_copy, cpp.bulk_copy);
    fn(c.stats_only, cpp.stats_only);
  }
};

template <>
struct Fields<emsa_host_tier_options> {
  using Cpp = emsa::HostTierOptions;
  template <typename CRef, typename CppRef, typename Fn>
  static void ForEach(CRef& c, CppRef& cpp, Fn fn) {
    fn(c.optimizer, cpp.optimizer);
    fn(c.rounding, cpp.rounding);
    fn(c.seed, cpp.seed);
    fn(c.device, cpp.device);
    fn(c.submit_in_backward, cpp.submit_in_backward);
    fn(c.device_delta, cpp.device_delta);
    fn(c.delta_staging_elements, cpp.delta_staging_elements);
    fn(c.paced_copies, cpp.paced_copies);
    fn(c.pace_piece_elements, cpp.pace_piece_elements);
    fn(c.paced_hold_bytes, cpp.paced_hold_bytes);
    fn(c.stream_piece_elements, cpp.stream_piece_elements);
    fn(c.stream_slots, cpp.stream_slots);
    fn(c.device_update_stream, cpp.device_update_stream);
    fn(c.gated, cpp.gated);
  }
};

// The C struct zeroed, struct_size set, and every listed field from the C++ defaults.
template <typename C>
void InitFields(C* c) {
  const typename Fields<C>::Cpp defaults;
  std::memset(c, 0, sizeof(*c));
  c->struct_size = sizeof(C);
  Fields<C>::ForEach(*c, defaults, [](auto& to, const auto& from) {
    to = static_cast<std::remove_reference_t<decltype(to)>>(from);
  });
}

// Every listed field of *cpp from the caller's C struct; the others keep their values.
template <typename C>
void CopyFields(const C& c, typename Fields<C>::Cpp* cpp) {
  Fields<C>::ForEach(c, *cpp, [](const auto& from, auto& to) {
    to = static_cast<std::remove_reference_t<decltype(to)>>(from);
  });
}

}  // namespace emsa::capi

#endif  // EMSA_CAPI_CAPI_FIELDS_H_
