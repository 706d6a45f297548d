"""The environment variables emsa reads, all of them, here and nowhere else.

Each is an override for benchmarks and A/B runs or a path; none is needed for normal use.
CONTRIBUTING.md's table "Environment variables" lists the same names, defaults and meanings:
change both together. Values are checked: a malformed one raises ValueError naming the variable
and what it accepts, rather than being ignored.
"""

from __future__ import annotations

import os

__all__ = ["KNOBS", "library_path", "host_threads", "host_device_share", "host_pace",
           "host_delta", "host_stream_slots", "host_stream_piece", "cuda_bulk_copy", "commit"]

# name -> (default as documented, meaning)
KNOBS = {
    "EMSA_LIBRARY": ("unset", "path of libemsa.so to load instead of the packaged or built one"),
    "EMSA_HOST_THREADS": ("unset", "CPU update threads of the host tier (unset: one fewer than "
                                   "the cores this process may use)"),
    "EMSA_HOST_DEVICE_SHARE": ("-1", "share of the host tier's fp32 parameters the GPU updates "
                                     "(moments streamed); -1: the planner chooses, 0: the CPU "
                                     "updates all"),
    "EMSA_HOST_PACE": ("unset", "host tier, updates in backward: gradient pieces copied ahead "
                                "of the CPU (unset: HostTierOptions' default; 0: not paced)"),
    "EMSA_HOST_DELTA": ("unset", "host tier, fp32 parameters: 1 the CPU writes the update's "
                                 "change and the GPU applies it, 0 the CPU writes the parameter "
                                 "(unset: HostTierOptions' default)"),
    "EMSA_HOST_STREAM_SLOTS": ("unset", "device staging slots of the GPU-updated host-tier "
                                        "path (unset: HostTierOptions' default)"),
    "EMSA_HOST_STREAM_PIECE": ("unset", "elements per staging slot and moment of that path "
                                        "(unset: HostTierOptions' default)"),
    "EMSA_CUDA_BULK_COPY": ("1", "1: fp32 device updates move tiles by bulk copies on sm_90+; "
                                 "0: per-thread loads"),
    "EMSA_MAX_SIMD": ("unset", "caps the CPU kernels' instruction set: scalar, avx2 or avx512 "
                               "(read by libemsa's C++ tuning module)"),
    "EMSA_COMMIT": ("unset", "commit recorded in reports and benchmark JSON where the tree has "
                             "no .git"),
}


def _raw(name: str) -> str | None:
    assert name in KNOBS, name
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _int(name: str, low: int, meaning: str) -> int | None:
    text = _raw(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise ValueError(f"{name}={text!r}: use an integer >= {low} ({meaning})")
    return value


def library_path() -> str | None:
    return _raw("EMSA_LIBRARY")


def host_threads() -> int | None:
    return _int("EMSA_HOST_THREADS", 1, "CPU update threads")


def host_device_share() -> float:
    text = _raw("EMSA_HOST_DEVICE_SHARE")
    if text is None:
        return -1.0
    try:
        share = float(text)
    except ValueError:
        share = float("nan")
    if not (share == -1.0 or 0.0 <= share <= 1.0):
        raise ValueError(f"EMSA_HOST_DEVICE_SHARE={text!r}: use -1 (the planner chooses), or a "
                         "share from 0 (the CPU updates every host-tier parameter) to 1")
    return share


def host_pace() -> int | None:
    return _int("EMSA_HOST_PACE", 0, "gradient pieces copied ahead; 0 turns pacing off")


def host_delta() -> bool | None:
    text = _raw("EMSA_HOST_DELTA")
    if text is None:
        return None
    if text not in ("0", "1"):
        raise ValueError(f"EMSA_HOST_DELTA={text!r}: use 1 (the GPU applies the CPU's change) "
                         "or 0 (the CPU writes the parameter)")
    return text == "1"


def host_stream_slots() -> int | None:
    return _int("EMSA_HOST_STREAM_SLOTS", 1, "device staging slots")


def host_stream_piece() -> int | None:
    return _int("EMSA_HOST_STREAM_PIECE", 64, "elements per slot and moment")


def cuda_bulk_copy() -> bool:
    text = _raw("EMSA_CUDA_BULK_COPY") or "1"
    if text not in ("0", "1"):
        raise ValueError(f"EMSA_CUDA_BULK_COPY={text!r}: use 1 (bulk copies on sm_90+) or 0 "
                         "(per-thread loads)")
    return text == "1"


def commit() -> str | None:
    return _raw("EMSA_COMMIT")
