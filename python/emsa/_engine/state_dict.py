"""An optimizer's state_dicts, emsa's or torch.optim's (the same layout), checked against the
planned parameters and copied into emsa's memory (opt.state itself: emsa._engine.opt_state).

load_state_dict checks everything first (check_state_dict) and only then changes anything
(copy_state): a state_dict that does not fit leaves the optimizer as it was.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .._distributed import dtensor
from . import options
from .params import PlannedParams, Slot

__all__ = ["state_keys", "check_state_dict", "check_entry", "copy_state", "write_slot"]

# A loaded step count must be a whole number the engines' int64 counters and torch's float
# "step" both hold exactly: at most the largest integer a float64 holds exactly.
_MAX_STEP = 2**53


def state_keys(kind: str) -> set[str]:
    """The state_dict keys of one parameter's state for the optimizer kind ("adamw", ...)."""
    return {"step", "exp_avg"} if kind == "lion" else {"step", "exp_avg", "exp_avg_sq"}


def check_state_dict(sd: dict[str, Any], param_groups: list[dict], defaults: dict[str, Any],
                     planned: PlannedParams, kind: str, cls: str,
                     warn_once: Callable[[str, str], None]) -> dict[int, dict[str, Any]]:
    """Checks a state_dict against an emsa.<cls> whose groups are param_groups and whose planned
    parameters are planned; returns the state by slot index."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("not an optimizer state_dict: expected 'state' and 'param_groups'")
    saved = sd["param_groups"]
    _check_groups(saved, param_groups, defaults)
    slots = planned.slots
    # Saved ids in order are this optimizer's parameters in order, frozen ones included.
    where = {(s.group, s.index): i for i, s in enumerate(slots)}
    flat = [where.get((g, j)) for g, group in enumerate(param_groups)
            for j in range(len(group["params"]))]
    ids = dict(zip((i for g in saved for i in g["params"]), flat))
    positions = dict(zip((i for g in saved for i in g["params"]),
                         ((g, j) for g, group in enumerate(param_groups)
                          for j in range(len(group["params"])))))
    keys = state_keys(kind)
    sources = {}
    for k, st in sd["state"].items():
        if k not in ids:
            continue
        if ids[k] is None:
            frozen = next(f.name for f in planned.frozen if (f.group, f.index) == positions[k])
            warn_once("frozen-state", (
                "emsa: the state_dict holds state for parameters that were frozen "
                "(requires_grad=False) when this optimizer planned (e.g. " + frozen + "); "
                "emsa keeps no state for them, so it is not loaded (torch.optim would keep "
                "it unused while they stay frozen)"))
            continue
        sources[ids[k]] = st
        if st:  # an empty entry ({}, as torch saves one after opt.state[p] = {}) is fresh
            check_entry(slots[ids[k]], st, keys, cls)
    return sources


def _check_groups(saved: list[dict[str, Any]], param_groups: list[dict],
                  defaults: dict[str, Any]) -> None:
    """The saved param groups: as many, as long, of the same kind and with valid
    hyperparameters."""
    if len(saved) != len(param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(saved, param_groups)):
        raise ValueError(
            "the state_dict's parameter groups hold "
            f"{[len(g['params']) for g in saved]} parameters, this optimizer's "
            f"{[len(g['params']) for g in param_groups]}; load a state_dict saved for "
            "the same parameter groups")
    for g, group in enumerate(saved):
        if group.get("amsgrad"):
            raise ValueError(f"the state_dict's param_groups[{g}] uses amsgrad, which emsa "
                             "does not support; keep using torch.optim for it")
        dwd = group.get("decoupled_weight_decay")
        mine = defaults.get("decoupled_weight_decay")
        if dwd is not None and mine is not None and bool(dwd) != bool(mine):
            raise ValueError(
                f"the state_dict's param_groups[{g}] has decoupled_weight_decay={dwd}: it "
                f"is {'an AdamW' if dwd else 'an Adam'} state; load it into "
                f"emsa.{'AdamW' if dwd else 'Adam'}")
        options.check_hyper({**defaults, **group}, f"state_dict param_groups[{g}]")


def check_entry(s: Slot, st: dict[str, Any], keys: set[str], cls: str) -> None:
    """One parameter's saved state st, for the slot s of an emsa.<cls> whose state has keys."""
    extra = set(st) - keys - {"master"}
    if "max_exp_avg_sq" in extra:
        raise ValueError(f"state for {s.name} holds max_exp_avg_sq: it was saved with "
                         "amsgrad=True, which emsa does not support")
    if extra or not keys - {"step"} <= set(st):
        raise ValueError(f"state for {s.name} has keys {sorted(st)}; emsa expects "
                         f"{sorted(keys)} (emsa.{cls}; {{}} starts it afresh): is it another "
                         "optimizer's?")
    for key in keys - {"step"} | ({"master"} & set(st)):
        t = st[key]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(s.param.shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"state for {s.name}: {key} is {got}, the parameter is "
                             f"{tuple(s.param.shape)}; the shapes must match: load a "
                             "state_dict saved for this model")
    step = float(st.get("step", 0))
    if not (math.isfinite(step) and 0 <= step <= _MAX_STEP and step == int(step)):
        raise ValueError(
            f"state for {s.name}: step {step!r} is not a count of steps (a whole "
            "number from 0 to 2**53); fix or drop that entry's 'step' (0 restarts the "
            "bias correction), or load a state_dict saved by training")


def copy_state(engine, planned: PlannedParams, sources: dict[int, dict[str, Any]]) -> None:
    """Copies the checked state (by slot index) into the engine's state views, straight from
    the source (no per-tensor cast copies); opt.state's entries are then
    OptimizerState.loaded's."""
    with torch.no_grad():
        for i, s in enumerate(planned.slots):
            write_slot(engine.state(i), sources.get(i, {}), s.param)
    engine.state_loaded()


def write_slot(views: dict[str, torch.Tensor], src: dict[str, Any], param: torch.Tensor) -> None:
    """One slot's state views from src (checked): what src lacks starts afresh, step 0, moments
    zero, a master from the parameter ({} resets the slot). The caller synchronizes the engine
    before and calls its state_loaded() after."""
    for key, view in views.items():
        if key == "step":
            view.fill_(float(src.get("step", 0)))
        elif key in src:
            view.copy_(dtensor.shard_like(src[key], param))
        elif key == "master":
            view.copy_(dtensor.local(param))
        else:
            view.zero_()
