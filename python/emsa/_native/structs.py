"""The ctypes mirrors of libemsa's C ABI structs and enum codes (include/emsa/emsa.h,
emsa_device.h, emsa_host.h), field for field. Each struct opens with struct_size, which the
library's *_init function sets: fields are only ever added at the end.
"""

from __future__ import annotations

import ctypes

DTYPE = {"float32": 0, "bfloat16": 1, "float16": 2}
OPTIMIZER = {"adamw": 0, "adam": 1, "lion": 2}
SIMD = {"scalar": 0, "avx2": 1, "avx512": 2}
ROUNDING = {"nearest": 0, "stochastic": 1}


class Hyperparams(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("lr", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("maximize", ctypes.c_int32),
    ]


class TensorUpdate(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("param_dtype", ctypes.c_int32),
        ("grad_dtype", ctypes.c_int32),
        ("state_dtype", ctypes.c_int32),
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("master", ctypes.c_void_p),
        ("numel", ctypes.c_int64),
        ("step", ctypes.c_int64),
        ("hyper", ctypes.POINTER(Hyperparams)),
    ]


class StepOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("optimizer", ctypes.c_int32),
        ("grad_multiplier", ctypes.c_float),
        ("check_finite", ctypes.c_int32),
        ("rounding", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
    ]


class StepReport(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("skipped", ctypes.c_int32),
        ("nonfinite_count", ctypes.c_int64),
        ("first_nonfinite_tensor", ctypes.c_int64),
    ]


class DeviceTableOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("optimizer", ctypes.c_int32),
        ("rounding", ctypes.c_int32),
        ("bulk_copy", ctypes.c_int32),
        ("stats_only", ctypes.c_int32),
    ]


class DeviceStepReport(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("found_inf", ctypes.c_int32),
        ("grad_multiplier", ctypes.c_float),
        ("clip_coef", ctypes.c_float),
        ("sum_sq", ctypes.c_double),
        ("grad_norm", ctypes.c_double),
        ("nonfinite_count", ctypes.c_int64),
    ]


class DeviceStepHeader(ctypes.Structure):
    """emsa_device_step_header: the device's per-step header, byte for byte."""

    _fields_ = [
        ("grad_multiplier", ctypes.c_float),
        ("found_inf", ctypes.c_int32),
        ("grad_unscale", ctypes.c_float),
        ("max_norm", ctypes.c_float),
        ("seed", ctypes.c_uint64),
        ("sum_sq", ctypes.c_double),
        ("nonfinite_count", ctypes.c_int64),
        ("grad_norm", ctypes.c_double),
        ("clip_coef", ctypes.c_float),
        ("reserved", ctypes.c_int32),
    ]


assert ctypes.sizeof(DeviceStepHeader) == 56, "emsa_device_step_header is 56 bytes"


class HostTierTensor(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("update", TensorUpdate),
        ("group", ctypes.c_int32),
        ("bucket", ctypes.c_int64),
        ("device_param", ctypes.c_void_p),
        ("device_update", ctypes.c_int32),
    ]


class HostTierOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("optimizer", ctypes.c_int32),
        ("rounding", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
        ("device", ctypes.c_int32),
        ("submit_in_backward", ctypes.c_int32),
        ("device_delta", ctypes.c_int32),
        ("delta_staging_elements", ctypes.c_int64),
        ("paced_copies", ctypes.c_int32),
        ("pace_piece_elements", ctypes.c_int64),
        ("paced_hold_bytes", ctypes.c_int64),
        ("stream_piece_elements", ctypes.c_int64),
        ("stream_slots", ctypes.c_int32),
        ("device_update_stream", ctypes.c_void_p),
        ("gated", ctypes.c_int32),
    ]


class HostTierStepStats(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("step", ctypes.c_int64),
        ("d2h_s", ctypes.c_double),
        ("cpu_s", ctypes.c_double),
        ("h2d_s", ctypes.c_double),
        ("wait_s", ctypes.c_double),
        ("buckets", ctypes.c_int64),
        ("complete", ctypes.c_int32),
        ("grad_wait_s", ctypes.c_double),
        ("worker_s", ctypes.c_double),
        ("device_buckets", ctypes.c_int64),
        ("stream_up_s", ctypes.c_double),
        ("gated", ctypes.c_int32),
        ("skipped", ctypes.c_int32),
    ]


class PlanOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("optimizer", ctypes.c_int32),
        ("state_dtype", ctypes.c_int32),
        ("allow_host_tier", ctypes.c_int32),
        ("force_all_host", ctypes.c_int32),
        ("budget_bytes", ctypes.c_uint64),
        ("safety_margin_bytes", ctypes.c_uint64),
        ("bucket_bytes", ctypes.c_uint64),
        ("release_grads", ctypes.c_int32),
        ("device_update_share", ctypes.c_double),
        ("gated_steps", ctypes.c_int32),
    ]


class ModelOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("activation_checkpointing", ctypes.c_int32),
        ("batch", ctypes.c_int64),
        ("seq_len", ctypes.c_int64),
        ("param_dtype", ctypes.c_int32),
        ("matmul_flops", ctypes.c_double),
        ("eager_attention", ctypes.c_int32),
    ]


class HostArenaOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("want_pinned", ctypes.c_int32),
        ("fill_threads", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("available_bytes", ctypes.c_uint64),
        ("locked_bytes", ctypes.c_uint64),
        ("populate_in_background", ctypes.c_int32),
        ("reserved2", ctypes.c_int32),
    ]


class HostArenaFacts(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("pin", ctypes.c_int32),
        ("huge_pages", ctypes.c_int32),
        ("fill_threads", ctypes.c_int32),
        ("locked_bytes", ctypes.c_uint64),
        ("pageable_bytes", ctypes.c_uint64),
        ("locked_limit_bytes", ctypes.c_uint64),
        ("fill_seconds", ctypes.c_double),
        ("pin_seconds", ctypes.c_double),
        ("populate_seconds", ctypes.c_double),
        ("populate_in_background", ctypes.c_int32),
        ("populated", ctypes.c_int32),
    ]


class StepGate(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("max_norm", ctypes.c_float),
        ("loss_scale", ctypes.c_float),
        ("stats_given", ctypes.c_int32),
        ("sum_sq", ctypes.c_double),
        ("nonfinite_count", ctypes.c_int64),
    ]


class StepVerdict(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("skipped", ctypes.c_int32),
        ("nonfinite_count", ctypes.c_int64),
        ("first_nonfinite_tensor", ctypes.c_int64),
        ("sum_sq", ctypes.c_double),
        ("grad_norm", ctypes.c_double),
        ("clip_coef", ctypes.c_float),
        ("grad_multiplier", ctypes.c_float),
    ]
