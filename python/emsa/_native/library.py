"""The declared ctypes table for libemsa's C ABI (include/emsa/emsa.h, with its parts
emsa_device.h and emsa_host.h).

One built library serves any Python and any torch: nothing here links torch. The library is
found at first use: the one packaged with this module (`pip install .` puts it next to this file;
an editable install keeps it in site-packages), then the repository's build folder; the
EMSA_LIBRARY path (_tuning.library_path), when set, overrides both.
A missing library or an ABI mismatch raises EmsaLibraryError with what to do.
"""

from __future__ import annotations

import ctypes
from importlib import metadata
from pathlib import Path

from . import _tuning

__all__ = [
    "EmsaError",
    "EmsaLibraryError",
    "Hyperparams",
    "TensorUpdate",
    "StepOptions",
    "StepReport",
    "PlanOptions",
    "ModelOptions",
    "DeviceTableOptions",
    "DeviceStepReport",
    "DeviceStepHeader",
    "lib",
    "check",
    "take_string",
    "DTYPE",
    "OPTIMIZER",
    "SIMD",
    "ROUNDING",
]

ABI_VERSION = 1

DTYPE = {"float32": 0, "bfloat16": 1, "float16": 2}
OPTIMIZER = {"adamw": 0, "adam": 1, "lion": 2}
SIMD = {"scalar": 0, "avx2": 1, "avx512": 2}
ROUNDING = {"nearest": 0, "stochastic": 1}

STATUS_NAMES = {
    1: "invalid argument",
    2: "parse error",
    3: "unsupported",
    4: "infeasible",
    5: "out of memory",
    6: "CUDA error",
    7: "I/O error",
    8: "not found",
    9: "internal error",
}


class EmsaLibraryError(RuntimeError):
    """libemsa could not be found or does not match this package."""


class EmsaError(RuntimeError):
    """An emsa call failed; .status is the EMSA_* code, the message says what to do."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{message} [{STATUS_NAMES.get(status, status)}]")
        self.status = status


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


_P = ctypes.c_void_p
_S = ctypes.c_int32  # emsa_status
_TABLE = {
    # name: (restype, argtypes)
    "emsa_abi_version": (ctypes.c_uint32, []),
    "emsa_version": (ctypes.c_char_p, []),
    "emsa_last_error": (ctypes.c_char_p, []),
    "emsa_free": (None, [_P]),
    "emsa_parse_bytes": (_S, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64)]),
    "emsa_simd_level": (ctypes.c_int32, []),
    "emsa_profile_measure": (_S, [ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(_P)]),
    "emsa_profile_cached": (_S, [ctypes.c_int32, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int32,
                                 ctypes.POINTER(_P)]),
    "emsa_profile_measurement_count": (ctypes.c_int64, []),
    "emsa_host_load_start": (_S, [ctypes.c_int32, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                                  ctypes.c_uint64, ctypes.POINTER(_P)]),
    "emsa_host_load_stop": (_S, [_P, ctypes.POINTER(ctypes.c_int64),
                                 ctypes.POINTER(ctypes.c_int64)]),
    "emsa_plan_options_init": (None, [ctypes.POINTER(PlanOptions)]),
    "emsa_plan_create": (
        _S,
        [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(PlanOptions), ctypes.POINTER(_P),
         ctypes.POINTER(ctypes.c_uint64)],
    ),
    "emsa_plan_destroy": (None, [_P]),
    "emsa_plan_to_json": (_S, [_P, ctypes.POINTER(_P)]),
    "emsa_plan_to_table": (_S, [_P, ctypes.POINTER(_P)]),
    "emsa_plan_arena_bytes": (
        _S, [_P, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]),
    "emsa_plan_to_summary": (_S, [_P, ctypes.POINTER(_P)]),
    "emsa_plan_verdict": (_S, [_P, ctypes.c_char_p, ctypes.c_int64, ctypes.POINTER(_P)]),
    "emsa_cli_run": (
        _S, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int),
             ctypes.POINTER(_P), ctypes.POINTER(_P)]),
    "emsa_model_options_init": (None, [ctypes.POINTER(ModelOptions)]),
    "emsa_model_probe": (
        _S, [ctypes.c_char_p, ctypes.POINTER(ModelOptions), ctypes.POINTER(_P),
             ctypes.POINTER(_P)]),
    "emsa_plan_infeasible_message": (
        _S, [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(PlanOptions),
             ctypes.POINTER(ModelOptions), ctypes.POINTER(_P)]),
    "emsa_device_preset": (_S, [ctypes.c_char_p, ctypes.POINTER(_P)]),
    "emsa_host_arena_create": (_S, [ctypes.c_uint64, ctypes.c_int32, ctypes.POINTER(_P)]),
    "emsa_host_arena_destroy": (None, [_P]),
    "emsa_host_arena_options_init": (None, [ctypes.POINTER(HostArenaOptions)]),
    "emsa_host_arena_check": (_S, [ctypes.c_uint64, ctypes.POINTER(HostArenaOptions)]),
    "emsa_host_arena_create_with": (
        _S, [ctypes.c_uint64, ctypes.POINTER(HostArenaOptions), ctypes.POINTER(_P)]),
    "emsa_host_arena_facts_init": (None, [ctypes.POINTER(HostArenaFacts)]),
    "emsa_host_arena_describe": (
        _S, [_P, ctypes.POINTER(HostArenaFacts), ctypes.POINTER(_P)]),
    "emsa_host_arena_wait_populated": (_S, [_P, ctypes.c_uint64]),
    "emsa_host_arena_info": (
        _S, [_P, ctypes.POINTER(_P), ctypes.POINTER(ctypes.c_uint64),
             ctypes.POINTER(ctypes.c_int32)]),
    "emsa_hyperparams_init": (None, [ctypes.POINTER(Hyperparams)]),
    "emsa_tensor_update_init": (None, [ctypes.POINTER(TensorUpdate)]),
    "emsa_step_options_init": (None, [ctypes.POINTER(StepOptions)]),
    "emsa_step_report_init": (None, [ctypes.POINTER(StepReport)]),
    "emsa_cpu_updater_create": (_S, [ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(_P)]),
    "emsa_cpu_updater_destroy": (None, [_P]),
    "emsa_cpu_updater_info": (
        _S, [_P, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32)]),
    "emsa_cpu_step": (
        _S, [_P, ctypes.POINTER(TensorUpdate), ctypes.c_size_t, ctypes.POINTER(StepOptions),
             ctypes.POINTER(StepReport)]),
    "emsa_cpu_grad_stats": (
        _S, [_P, ctypes.POINTER(TensorUpdate), ctypes.c_size_t, ctypes.POINTER(ctypes.c_double),
             ctypes.POINTER(ctypes.c_int64)]),
    "emsa_device_table_options_init": (None, [ctypes.POINTER(DeviceTableOptions)]),
    "emsa_device_step_report_init": (None, [ctypes.POINTER(DeviceStepReport)]),
    "emsa_device_scalars_create": (
        _S, [ctypes.POINTER(Hyperparams), ctypes.c_size_t, ctypes.POINTER(_P)]),
    "emsa_device_scalars_destroy": (None, [_P]),
    "emsa_device_scalars_set_group": (
        _S, [_P, ctypes.c_size_t, ctypes.POINTER(Hyperparams), ctypes.c_int64, _P]),
    "emsa_device_scalars_set_inputs": (
        _S, [_P, ctypes.c_float, ctypes.c_float, ctypes.c_uint64, _P]),
    "emsa_device_step": (_S, [_P, ctypes.POINTER(_P), ctypes.c_size_t, ctypes.c_int32, _P]),
    "emsa_device_scalars_read": (_S, [_P, ctypes.POINTER(DeviceStepReport), _P]),
    "emsa_device_table_create": (
        _S, [ctypes.POINTER(TensorUpdate), ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
             ctypes.POINTER(DeviceTableOptions), ctypes.POINTER(_P)]),
    "emsa_device_table_destroy": (None, [_P]),
    "emsa_device_table_info": (
        _S, [_P, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32),
             ctypes.POINTER(ctypes.c_uint64)]),
    "emsa_device_scalars_set_hyper": (_S, [_P, ctypes.c_size_t, ctypes.POINTER(Hyperparams), _P]),
    "emsa_device_scalars_read_steps": (
        _S, [_P, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, _P]),
    "emsa_device_scalars_copy_header": (_S, [_P, _P, _P]),
    "emsa_device_scalars_header_address": (_S, [_P, ctypes.POINTER(_P)]),
    "emsa_device_table_set_grads": (_S, [_P, ctypes.POINTER(_P), ctypes.c_size_t, _P]),
    "emsa_device_table_update": (_S, [_P, _P, _P]),
    "emsa_device_scalars_create_slots": (
        _S, [ctypes.POINTER(Hyperparams), ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(_P)]),
    "emsa_device_table_create_slots": (
        _S, [ctypes.POINTER(TensorUpdate), ctypes.POINTER(ctypes.c_int32),
             ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.c_size_t,
             ctypes.POINTER(DeviceTableOptions), ctypes.POINTER(_P)]),
    "emsa_device_scalars_read_slot_steps": (
        _S, [_P, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, _P]),
    "emsa_device_scalars_set_slot_steps": (
        _S, [_P, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, _P]),
    "emsa_device_begin_step": (_S, [_P, _P]),
    "emsa_device_table_accumulate_stats": (_S, [_P, _P, _P]),
    "emsa_device_finish_stats": (_S, [_P, _P]),
    "emsa_device_finish_step": (_S, [_P, ctypes.POINTER(_P), ctypes.c_size_t, _P]),
    "emsa_device_scalars_set_unscale_from": (_S, [_P, _P, _P]),
    "emsa_device_scalars_write_found_inf": (_S, [_P, _P, _P]),
    "emsa_device_arena_create": (_S, [ctypes.c_uint64, ctypes.c_int32, ctypes.POINTER(_P)]),
    "emsa_device_arena_destroy": (None, [_P]),
    "emsa_device_arena_info": (
        _S, [_P, ctypes.POINTER(_P), ctypes.POINTER(ctypes.c_uint64),
             ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(_P)]),
    "emsa_device_arena_export": (
        _S, [_P, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int64), ctypes.c_int32, ctypes.c_int32,
             ctypes.POINTER(_P)]),
    "emsa_host_arena_export": (
        _S, [_P, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int64), ctypes.c_int32, ctypes.c_int32,
             ctypes.POINTER(_P)]),
    "emsa_dlpack_delete": (None, [_P]),
    "emsa_host_tier_threads": (ctypes.c_int32, [ctypes.c_int32]),
    "emsa_host_tier_tensor_init": (None, [ctypes.POINTER(HostTierTensor)]),
    "emsa_host_tier_options_init": (None, [ctypes.POINTER(HostTierOptions)]),
    "emsa_host_tier_step_stats_init": (None, [ctypes.POINTER(HostTierStepStats)]),
    "emsa_host_tier_create": (
        _S, [_P, ctypes.POINTER(HostTierTensor), ctypes.c_size_t, ctypes.c_size_t,
             ctypes.c_size_t, _P, _P, ctypes.POINTER(HostTierOptions), ctypes.POINTER(_P)]),
    "emsa_host_tier_destroy": (None, [_P]),
    "emsa_host_tier_begin_step": (
        _S, [_P, ctypes.POINTER(Hyperparams), ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t]),
    "emsa_host_tier_begin_step_gated": (
        _S, [_P, ctypes.POINTER(Hyperparams), ctypes.c_size_t, ctypes.c_int32]),
    "emsa_host_tier_release": (_S, [_P, _P, _P]),
    "emsa_host_tier_release_values": (_S, [_P, ctypes.c_float, ctypes.c_int32]),
    "emsa_host_tier_read_steps": (_S, [_P, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t]),
    "emsa_host_tier_set_steps": (_S, [_P, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t]),
    "emsa_host_tier_last_skipped": (ctypes.c_int32, [_P]),
    "emsa_host_tier_submit": (_S, [_P, ctypes.c_size_t, ctypes.POINTER(_P), ctypes.c_size_t, _P]),
    "emsa_host_tier_wait": (_S, [_P, ctypes.c_size_t, _P]),
    "emsa_host_tier_wait_grads_copied": (_S, [_P, _P]),
    "emsa_host_tier_synchronize": (_S, [_P]),
    "emsa_host_tier_copies_enqueued": (ctypes.c_int64, [_P]),
    "emsa_host_tier_update_stream": (ctypes.c_void_p, [_P]),
    "emsa_host_tier_stream_staging_bytes": (ctypes.c_int64, [_P, ctypes.c_int32, ctypes.c_int64]),
    "emsa_host_tier_bucket_copies_enqueued": (ctypes.c_int32, [_P, ctypes.c_size_t]),
    "emsa_host_tier_trace": (
        _S, [_P, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double),
             ctypes.POINTER(ctypes.c_double), ctypes.c_size_t]),
    "emsa_host_tier_stats": (
        _S, [_P, ctypes.c_int64, ctypes.POINTER(HostTierStepStats), ctypes.c_size_t,
             ctypes.POINTER(ctypes.c_size_t)]),
}


def _installed() -> list[Path]:
    """libemsa.so as the installed distribution lists it: an editable install keeps the built
    library in site-packages while this module stays in the source tree."""
    try:
        files = metadata.files("emsa") or []
    except metadata.PackageNotFoundError:
        return []
    return [Path(f.locate()) for f in files if f.name == "libemsa.so"]


def _candidates() -> list[Path]:
    env = _tuning.library_path()
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    repo = here.parent.parent
    return [here / "libemsa.so", *_installed(), repo / "build" / "libemsa.so",
            repo / "build-asan" / "libemsa.so"]


class _Lib:
    """Loads libemsa at first attribute access and declares every entry point."""

    def __init__(self):
        self._dll = None

    def _load(self):
        tried = []
        for path in _candidates():
            tried.append(str(path))
            if path.exists():
                try:
                    dll = ctypes.CDLL(str(path))
                except OSError as e:
                    raise EmsaLibraryError(f"libemsa at {path} failed to load: {e}") from e
                break
        else:
            raise EmsaLibraryError(
                "libemsa.so not found (tried " + ", ".join(tried) + "). Install the package "
                "with `pip install .` at the repository's root, or build the library with "
                "`cmake -S . -B build && cmake --build build`, or point EMSA_LIBRARY at it.")
        for name, (restype, argtypes) in _TABLE.items():
            try:
                fn = getattr(dll, name)
            except AttributeError as e:
                raise EmsaLibraryError(
                    f"libemsa at {path} lacks {name}: it is older than this Python package; "
                    "rebuild it") from e
            fn.restype = restype
            fn.argtypes = argtypes
        abi = dll.emsa_abi_version()
        if abi != ABI_VERSION:
            raise EmsaLibraryError(
                f"libemsa at {path} has ABI {abi}, this package needs {ABI_VERSION}; rebuild it")
        self._dll = dll

    def __getattr__(self, name):
        if self._dll is None:
            self._load()
        return getattr(self._dll, name)


lib = _Lib()


def check(status: int) -> None:
    """Raises EmsaError with the library's message when status is not EMSA_OK."""
    if status != 0:
        raise EmsaError(status, lib.emsa_last_error().decode("utf-8", "replace"))


def take_string(ptr: ctypes.c_void_p) -> str:
    """Copies a string returned by emsa and frees it. Bytes that are not UTF-8 (an input's own,
    quoted in a message) become U+FFFD rather than an exception."""
    try:
        return ctypes.string_at(ptr).decode("utf-8", errors="replace")
    finally:
        lib.emsa_free(ptr)
