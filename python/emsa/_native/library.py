"""The declared ctypes table for libemsa's C ABI (include/emsa/emsa.h, with its parts
emsa_device.h and emsa_host.h): every entry point with its argument and result types.

One built library serves any Python and any torch: nothing here links torch. The library is
found at first use: the one packaged with the package (`pip install .` puts it next to
emsa/__init__.py; an editable install keeps it in site-packages), then the repository's build
folder; EMSA_LIBRARY (tuning.library_path), when set, overrides both. A missing library or an
ABI mismatch raises EmsaLibraryError with what to do.
"""

from __future__ import annotations

import ctypes
from importlib import metadata
from pathlib import Path

from . import tuning
from .structs import (DeviceStepReport, DeviceTableOptions, HostArenaFacts, HostArenaOptions,
                      HostTierOptions, HostTierStepStats, HostTierTensor, Hyperparams,
                      ModelOptions, PlanOptions, StepGate, StepOptions, StepReport, StepVerdict,
                      TensorUpdate)

__all__ = ["EmsaError", "EmsaLibraryError", "lib", "check", "take_string"]

ABI_VERSION = 1

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
EMSA_INFEASIBLE = 4


class EmsaLibraryError(RuntimeError):
    """libemsa could not be found or does not match this package."""


class EmsaError(RuntimeError):
    """An emsa call failed; .status is the EMSA_* code, the message says what to do."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{message} [{STATUS_NAMES.get(status, status)}]")
        self.status = status


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
    "emsa_step_gate_init": (None, [ctypes.POINTER(StepGate)]),
    "emsa_step_verdict_init": (None, [ctypes.POINTER(StepVerdict)]),
    "emsa_cpu_step_gated": (
        _S, [_P, ctypes.POINTER(TensorUpdate), ctypes.c_size_t, ctypes.POINTER(StepOptions),
             ctypes.POINTER(StepGate), ctypes.POINTER(StepVerdict)]),
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
    env = tuning.library_path()
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent.parent  # the emsa package
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
