"""Plans, device profiles and byte sizes: thin wrappers over the C++ planner (emsa/plan.h).

Everything here calls libemsa; nothing is computed in Python.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any

import torch

from .library import EMSA_INFEASIBLE, EmsaError, check, lib, take_string
from .structs import DTYPE, OPTIMIZER, ModelOptions, PlanOptions

__all__ = ["Plan", "make_plan", "infeasible_message", "measure_profile", "parse_bytes",
           "InfeasibleBudgetError"]

STATE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def state_dtype_code(state_dtype) -> int:
    """libemsa's code for a state dtype; ValueError naming the ones emsa keeps state in."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype={state_dtype}; emsa keeps optimizer state in "
                         "torch.float32 or torch.bfloat16")
    return DTYPE[STATE_DTYPES[state_dtype]]


class InfeasibleBudgetError(EmsaError):
    """The budget cannot be met; .min_budget_bytes is the smallest budget that works."""

    def __init__(self, status: int, message: str, min_budget_bytes: int):
        super().__init__(status, message)
        self.min_budget_bytes = min_budget_bytes


def require_library() -> None:
    """Loads libemsa now (EmsaLibraryError if missing or mismatched), so that a missing library
    fails at construction rather than after a first forward and backward."""
    lib.emsa_abi_version()


def parse_bytes(value: int | str) -> int:
    """A byte count from an int or text such as "20GiB", "512 MiB", "1.5GiB" (C++ ParseBytes)."""
    if isinstance(value, bool):
        raise TypeError("a byte size is an int or a string such as '20GiB', not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size {value} is negative")
        return value
    if not isinstance(value, str):
        raise TypeError(f"a byte size is an int or a string such as '20GiB', not {type(value)}")
    out = ctypes.c_uint64()
    check(lib.emsa_parse_bytes(value.encode(), ctypes.byref(out)))
    return out.value


def measure_profile(measure_bandwidth: bool = True, gpu_device: int = 0, *, cache: bool = True,
                    refresh: bool = False) -> dict[str, Any]:
    """This machine's DeviceProfile (CPU; GPU when one is usable), as the C++ side writes it.

    With measure_bandwidth, the bandwidths come from the machine's profile cache (measured once
    per machine and kept for a week under $XDG_CACHE_HOME/emsa, else ~/.cache/emsa; the rest is
    read fresh): cache=False measures them without reading or writing it, refresh=True measures
    and rewrites it (as `emsa profile --refresh`)."""
    if measure_bandwidth and cache:
        from .profile_cache import cached_profile

        return cached_profile(gpu_device, refresh=refresh)["profile"]
    out = ctypes.c_void_p()
    check(lib.emsa_profile_measure(int(measure_bandwidth), int(gpu_device), ctypes.byref(out)))
    return json.loads(take_string(out))


_QUICK_PROFILE: str | None = None


def quick_profile_json() -> str:
    """An unmeasured profile of this machine (no timed parts), cached: enough to check records
    and to lay out CPU-resident state, where bandwidths decide nothing."""
    global _QUICK_PROFILE
    if _QUICK_PROFILE is None:
        _QUICK_PROFILE = json.dumps(measure_profile(measure_bandwidth=False))
    return _QUICK_PROFILE


def profile_json(profile: Any) -> str | None:
    """Profile text from a dict, JSON text, or a path to a JSON file; None stays None."""
    if profile is None:
        return None
    if isinstance(profile, dict):
        return json.dumps(profile)
    if isinstance(profile, os.PathLike) or (isinstance(profile, str)
                                            and not profile.lstrip().startswith("{")):
        return Path(profile).read_text(encoding="utf-8")
    if isinstance(profile, str):
        return profile
    raise TypeError(f"profile= takes a dict, JSON text or a path, not {type(profile).__name__}")


class Plan:
    """A plan made by the C++ planner. str(plan) is its table; .json is its JSON as a dict."""

    def __init__(self, handle: ctypes.c_void_p):
        self._handle = handle
        out = ctypes.c_void_p()
        check(lib.emsa_plan_to_json(handle, ctypes.byref(out)))
        self.text = take_string(out)
        self.json: dict[str, Any] = json.loads(self.text)
        dev, host = ctypes.c_uint64(), ctypes.c_uint64()
        check(lib.emsa_plan_arena_bytes(handle, ctypes.byref(dev), ctypes.byref(host)))
        self.device_arena_bytes = dev.value
        self.host_arena_bytes = host.value

    def table(self) -> str:
        out = ctypes.c_void_p()
        check(lib.emsa_plan_to_table(self._handle, ctypes.byref(out)))
        return take_string(out)

    def verdict(self, profile: Any = None, tokens_per_step: int = 0) -> str:
        """The lines `emsa plan` opens with: fits or not (against the card's and the host's
        memory in `profile`, a DeviceProfile as dict, JSON text or path; default: this machine,
        unmeasured), the predicted step time (and tokens/s when tokens_per_step is given), the
        host memory needed and the tier split."""
        text = profile_json(profile) if profile is not None else quick_profile_json()
        out = ctypes.c_void_p()
        check(lib.emsa_plan_verdict(self._handle, text.encode(), int(tokens_per_step),
                                    ctypes.byref(out)))
        return take_string(out)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        p = self.json["prediction"]
        return (f"<emsa.Plan {len(self.json['params'])} params, device state "
                f"{p['device_state_bytes']} B, host state {p['host_state_bytes']} B>")

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle and lib is not None and lib._dll is not None:
            lib.emsa_plan_destroy(handle)


def _create(probe_text: str, profile_text: str | None, options: PlanOptions) -> Plan:
    handle = ctypes.c_void_p()
    min_budget = ctypes.c_uint64()
    status = lib.emsa_plan_create(
        probe_text.encode(), profile_text.encode() if profile_text is not None else None,
        ctypes.byref(options), ctypes.byref(handle), ctypes.byref(min_budget))
    if status == EMSA_INFEASIBLE:
        raise InfeasibleBudgetError(status, lib.emsa_last_error().decode("utf-8", "replace"),
                                    min_budget.value)
    check(status)
    return Plan(handle)


def make_plan(record, profile: Any = None, *, optimizer: str = "adamw",
              state_dtype: torch.dtype = torch.float32, budget: int | str | None = None,
              allow_host_tier: bool = True, force_all_host: bool = False,
              release_grads: bool = False, device_update_share: float = -1.0,
              gated_steps: bool = False) -> Plan:
    """Plans a ProbeRecord (or its JSON text) against a profile (dict, JSON text, path; None:
    the record's embedded profile, else this machine measured). budget: bytes or "20GiB".
    device_update_share: of the host tier's fp32 parameters, the share the GPU updates with
    their moments streamed through it (-1: chosen by the planner, the shortest predicted step
    that does not stall; 0: the CPU updates all). gated_steps: every step's updates wait for
    all of its gradients (clipping, the non-finite check, a loss scale); with release_grads the
    prediction counts that wait (the share is chosen as for ungated steps)."""
    options = _plan_options(optimizer, state_dtype, budget, allow_host_tier, force_all_host,
                            release_grads, device_update_share, gated_steps)
    return _create(_record_text(record), profile_json(profile), options)


def infeasible_message(record, profile: Any = None, *, model: ModelOptions | None = None,
                       **plan_options) -> str:
    """Why make_plan(record, profile, **plan_options) cannot meet its budget, as the emsa
    command words it (C++ InfeasibleBudgetMessage): the smallest budget that works and, for a
    model known by its config (`model`: the ModelOptions its record was made with), what it
    needs with the host tier switched and what would shrink the need. "" when the budget can be
    met."""
    options = _plan_options(**plan_options)
    profile_text = profile_json(profile)
    out = ctypes.c_void_p()
    check(lib.emsa_plan_infeasible_message(
        _record_text(record).encode(), profile_text.encode() if profile_text is not None else None,
        ctypes.byref(options), ctypes.byref(model) if model is not None else None,
        ctypes.byref(out)))
    return take_string(out)


def _record_text(record) -> str:
    return record if isinstance(record, str) else record.to_json()


def _plan_options(optimizer: str = "adamw", state_dtype: torch.dtype = torch.float32,
                  budget: int | str | None = None, allow_host_tier: bool = True,
                  force_all_host: bool = False, release_grads: bool = False,
                  device_update_share: float = -1.0, gated_steps: bool = False) -> PlanOptions:
    if optimizer not in OPTIMIZER:
        raise ValueError(f"optimizer={optimizer!r}; use one of {sorted(OPTIMIZER)}")
    state_code = state_dtype_code(state_dtype)
    options = PlanOptions()
    lib.emsa_plan_options_init(ctypes.byref(options))
    options.optimizer = OPTIMIZER[optimizer]
    options.state_dtype = state_code
    options.allow_host_tier = int(allow_host_tier)
    options.force_all_host = int(force_all_host)
    options.release_grads = int(release_grads)
    options.device_update_share = float(device_update_share)
    options.gated_steps = int(gated_steps)
    if budget is not None:
        options.budget_bytes = parse_bytes(budget)
    return options


def check_probe_record(probe_text: str) -> None:
    """Runs the C++ parser and validator over a record; raises EmsaError naming the field."""
    options = PlanOptions()
    lib.emsa_plan_options_init(ctypes.byref(options))
    _create(probe_text, quick_profile_json(), options)
