"""Clipping by hand after an in-backward pass: clip_grad_norm_ and clip_grad_value_ called on
gradients an emsa optimizer with step_in_backward=True has already updated from and released.

torch's functions skip parameters whose .grad is None, so such a call would silently clip
nothing. While an in-backward emsa optimizer exists, torch.nn.utils' (and torch.nn.utils.
clip_grad's) functions and Accelerate's Accelerator.clip_grad_norm_ first ask each live
in-backward optimizer whether the call names parameters its last pass consumed: emsa's own
threshold returns emsa's norm of that pass (warning once that the call is redundant);
max_norm=inf returns emsa's norm, or nan with a warning when emsa did not clip; anything else is
refused with what to do. Calls naming no such parameter run the original function unchanged.
The rules in full: docs/internals.md.
"""

from __future__ import annotations

import functools
import math
import sys
import weakref

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

__all__ = ["watch", "install"]

_watching: "weakref.WeakSet" = weakref.WeakSet()  # live in-backward passes (emsa._engine.passes)
_NAMESPACES = (torch.nn.utils, torch.nn.utils.clip_grad)


def watch(passes) -> None:
    """Puts an in-backward optimizer's passes under the guard (installed on first use)."""
    install()
    _watching.add(passes)


def _consumed_by(passes, params: list) -> list:
    """The parameters among `params` whose gradients the last pass updated from and released
    (identity, not id(): a freed parameter's id may be reused)."""
    if not passes.consumed:
        return []
    owned = {id(s.param): s.param for s in passes.binding.planned.slots}
    return [p for p in params if owned.get(id(p)) is p and p.grad is None]


def _as_list(parameters) -> list:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)  # a generator is read once: torch's function gets the list


def _answer(params: list, max_norm, norm_type, error_if_nonfinite: bool = False):
    """emsa's norm for a norm-clipping call on gradients a pass consumed (or a refusal), or
    None when the call names none of them. A Hugging Face Trainer making the call without
    emsa.hf.EmsaTrainerCallback is refused as its optimizer.step() would be; max_norm=inf (the
    norm only, as Trainer asks for it to log) returns emsa's norm, or nan with a warning when
    emsa computes none (no max_grad_norm)."""
    for passes in list(_watching):
        consumed = _consumed_by(passes, params)
        opt = passes.opt()
        if not consumed or opt is None:
            continue
        if not passes.trainer_checked:
            passes.refuse_trainer_settings(sys._getframe(2))
        if math.isinf(float(max_norm)) and float(max_norm) > 0:
            return _norm_only(opt, consumed)
        return _emsa_norm(opt, consumed, float(max_norm), float(norm_type),
                          error_if_nonfinite)
    return None


def _norm_only(opt, consumed: list) -> torch.Tensor:
    norm = opt.last_grad_norm if opt.max_grad_norm is not None else None
    if norm is None:
        opt._warn_once("hand_norm", (
            f"emsa: a gradient norm asked for after an in-backward pass of "
            f"emsa.{type(opt).__name__}(step_in_backward=True) (clip_grad_norm_ with "
            "max_norm=inf) finds no gradients: emsa updated from them during backward and "
            "released them, and computes their norm only when it clips (max_grad_norm=). The "
            "call returns nan"), stacklevel=4)
        norm = math.nan
    return _as_tensor(norm, consumed)


def _as_tensor(norm: float, consumed: list) -> torch.Tensor:
    """A norm as torch's clip_grad_norm_ returns it: 0-d float32 on the parameters' device."""
    return torch.tensor(norm, dtype=torch.float32, device=consumed[0].device)


def _norm_call(original):
    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                        foreach=None):
        params = _as_list(parameters)
        answer = _answer(params, max_norm, norm_type, error_if_nonfinite)
        if answer is not None:
            return answer
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)

    clip_grad_norm_._emsa_original = original
    return clip_grad_norm_


def _accelerate_call(original):
    @functools.wraps(original)
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        params = _as_list(parameters)
        answer = _answer(params, max_norm, norm_type)
        if answer is not None:
            return answer
        return original(self, params, max_norm, norm_type)

    clip_grad_norm_._emsa_original = original
    return clip_grad_norm_


def _value_call(original):
    @functools.wraps(original)
    def clip_grad_value_(parameters, clip_value, foreach=None):
        params = _as_list(parameters)
        for passes in list(_watching):
            opt = passes.opt()
            if opt is not None and _consumed_by(passes, params):
                raise RuntimeError(
                    f"torch.nn.utils.clip_grad_value_ after an in-backward pass of "
                    f"emsa.{type(opt).__name__}(step_in_backward=True): emsa updated from these "
                    "gradients during backward and released them, so the call would clip "
                    "nothing. emsa clips by the global norm only (max_grad_norm=); clipping "
                    "each element needs step_in_backward=False")
        return original(params, clip_value, foreach)

    clip_grad_value_._emsa_original = original
    return clip_grad_value_


def _emsa_norm(opt, consumed: list, max_norm: float, norm_type: float,
               error_if_nonfinite: bool) -> torch.Tensor:
    name = f"emsa.{type(opt).__name__}(step_in_backward=True)"
    ours = opt.max_grad_norm
    if ours is None or ours != max_norm or norm_type != 2.0:
        clips = (f"clips at max_grad_norm={ours}" if ours is not None else "does not clip")
        raise RuntimeError(
            f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) after "
            f"an in-backward pass of {name}: emsa updated from these gradients during backward "
            f"and released them, so the call would clip nothing (and return 0), and emsa "
            f"{clips}. Pass max_grad_norm={max_norm} to emsa (it clips by the global L2 norm "
            "inside backward, exactly as this call would have) and remove the call, or use "
            "step_in_backward=False")
    norm = opt.last_grad_norm
    if norm is None:
        norm = math.nan
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order 2.0 for gradients from `parameters` is non-finite "
            f"({norm}), as {name} found it in backward; its update is already made")
    opt._warn_once("hand_clipping", (
        f"emsa: clip_grad_norm_(max_norm={max_norm}) after an in-backward pass finds no "
        f"gradients: {name} clipped them at the same max_grad_norm inside backward. The call "
        "returns emsa's norm of that pass (reading it waits for the GPU); remove it and read "
        "opt.last_grad_norm when you log"), stacklevel=4)
    return _as_tensor(norm, consumed)


_installed = {"torch": False, "accelerate": False}


def install() -> None:
    """Wraps the clipping functions not wrapped yet: torch's on first use, Accelerate's once it
    is imported. Cheap when both are done (each pass's end calls it)."""
    targets = []
    if not _installed["torch"]:
        _installed["torch"] = True
        targets += [(space, name, wrap) for space in _NAMESPACES
                    for name, wrap in (("clip_grad_norm_", _norm_call),
                                       ("clip_grad_value_", _value_call))]
    if not _installed["accelerate"]:
        accelerator = getattr(sys.modules.get("accelerate"), "Accelerator", None)
        if isinstance(accelerator, type):
            _installed["accelerate"] = True
            targets.append((accelerator, "clip_grad_norm_", _accelerate_call))
    for space, name, wrap in targets:
        current = getattr(space, name, None)
        if current is None or hasattr(current, "_emsa_original"):
            continue
        setattr(space, name, wrap(current))
