"""The optimizers' arguments: emsa's own keyword options (EmsaOptions, defined once for the
three classes), and the checks of hyperparameters, param groups and torch.optim's options that
pick among torch's implementations.

One definition of each rule, shared by the constructor, add_param_group and load_state_dict.
Each check raises before anything changes, with a message that says what to do instead.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .._native.planner import parse_bytes, profile_json, state_dtype_code
from .params import check_param

__all__ = ["EmsaOptions", "check_hyper", "check_group", "check_fixed_keys", "check_max_norm",
           "impl_defaults", "refuse_amsgrad"]


@dataclass
class EmsaOptions:
    """emsa's keyword options, as every class takes them (docs: emsa.optimizers' Args)."""

    probe: Any = None
    budget: int | str | None = None
    state_dtype: torch.dtype = torch.float32
    skip_nonfinite: bool | None = None
    max_grad_norm: float | None = None
    profile: Any = None
    step_in_backward: bool = False
    accumulate: int = 1
    tier: str | None = None
    grad_scaler: Any = None
    process_group: Any = None
    ddp: Any = None
    # Resolved by resolve(): the budget in bytes, the profile as JSON text.
    budget_bytes: int | None = field(default=None, init=False, repr=False)
    profile_text: str | None = field(default=None, init=False, repr=False)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]

    @classmethod
    def given(cls, owner: str, options: dict[str, Any]) -> "EmsaOptions":
        """The options an emsa.<owner>(...) call was given; TypeError for an unknown one, as
        Python's own for an unexpected keyword."""
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument "
                            f"{unknown[0]!r}; emsa's own options are " + ", ".join(cls.names()))
        return cls(**options)

    def resolve(self) -> "EmsaOptions":
        """Checks every option, fills in the mode's defaults; raises before anything exists."""
        if self.tier not in (None, "device", "host"):
            raise ValueError(f"tier={self.tier!r}; use None (the planner decides under "
                             "budget=), 'device' or 'host'")
        state_dtype_code(self.state_dtype)
        accumulate = self.accumulate
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate={accumulate!r}; it is the number of backward passes "
                             "per update, an int >= 1")
        if not self.step_in_backward:
            if accumulate != 1:
                raise ValueError(f"accumulate={accumulate} applies only with "
                                 "step_in_backward=True; otherwise accumulate by calling step() "
                                 "every N backwards")
            if self.grad_scaler is not None:
                raise ValueError("grad_scaler= applies with step_in_backward=True; in step() "
                                 "mode scaler.step(opt) hands its scale to emsa by itself: drop "
                                 "it")
        # The non-finite check is on by default in step() mode. In backward it makes every
        # update of a pass wait for the end of backward (the verdict needs every gradient),
        # which is what that mode exists to avoid: off by default there.
        if self.skip_nonfinite is None:
            self.skip_nonfinite = not self.step_in_backward
        self.skip_nonfinite = bool(self.skip_nonfinite)
        self.step_in_backward = bool(self.step_in_backward)
        self.max_grad_norm = check_max_norm(self.max_grad_norm)
        self.budget_bytes = parse_bytes(self.budget) if self.budget is not None else None
        self.profile_text = profile_json(self.profile)
        if self.probe is not None:
            from ..probe_record import ProbeRecord

            if isinstance(self.probe, (str, os.PathLike)):
                self.probe = ProbeRecord.load(self.probe)
            if not isinstance(self.probe, ProbeRecord):
                raise TypeError("probe= takes an emsa.ProbeRecord (from emsa.probe) or a path "
                                f"to one, not {type(self.probe).__name__}")
        return self


# torch.optim's foreach= and fused= pick among torch's own implementations; emsa has one, fused
# and multi-tensor, which either value names (scripts pass them to torch's AdamW by habit), so
# both are accepted and change nothing; True for both is refused as torch refuses it. The
# options below change what the update is, and are accepted only at torch's default.
TORCH_IMPL_OPTIONS = {
    "capturable": (False, "is for CUDA graph capture, which emsa does not support yet: use "
                          "torch.optim with capturable=True"),
    "differentiable": (False, "makes the update differentiable; emsa's update is not: use "
                              "torch.optim with differentiable=True"),
}


def check_max_norm(value) -> float | None:
    """max_grad_norm as given: None or 0 turn clipping off; else a finite number > 0."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise ValueError(f"max_grad_norm={value!r}; it is the clipping threshold of the global "
                         "L2 gradient norm, a finite number > 0 (None or 0: no clipping)")
    return float(value) if value > 0 else None


def impl_defaults(foreach, capturable, differentiable, fused) -> dict[str, Any]:
    return {"foreach": foreach, "capturable": capturable, "differentiable": differentiable,
            "fused": fused}


def refuse_amsgrad(amsgrad: bool, cls: str) -> None:
    if amsgrad:
        raise ValueError(f"amsgrad=True is not supported by emsa.{cls}; use "
                         f"torch.optim.{cls}(amsgrad=True) for it")


def check_hyper(group: dict[str, Any], where: str) -> None:
    """lr, eps, betas and weight_decay of one param group (or a state_dict's), as torch.optim
    checks them; emsa also needs eps > 0."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}: Tensor lr must be 1-element")
    if not 0.0 <= float(lr):
        raise ValueError(f"Invalid learning rate: {lr} ({where})")
    if "eps" in group and not 0.0 < float(group["eps"]):
        raise ValueError(f"Invalid epsilon value: {group['eps']} ({where}); emsa needs "
                         "eps > 0 (it divides by sqrt(exp_avg_sq) + eps)")
    for k, beta in enumerate(group["betas"]):
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {k}: {beta} ({where})")
    if not 0.0 <= float(group["weight_decay"]):
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']} ({where})")


def check_fixed_keys(group: dict[str, Any], g: int, kind: str, cls: str) -> None:
    """Group keys torch reads at every step that emsa fixes for the whole optimizer when it is
    built: checked at construction, add_param_group and every step (a dict lookup per group),
    so a change mid-run is refused before anything changes, never ignored."""
    if kind == "lion":
        return
    if group.get("amsgrad"):
        raise ValueError(f"param_groups[{g}] sets amsgrad=True, which emsa does not "
                         f"support; use torch.optim.{cls}(amsgrad=True)")
    dwd = group.get("decoupled_weight_decay")
    if dwd is not None and bool(dwd) != (kind == "adamw"):
        now, other = ("AdamW", "Adam") if kind == "adamw" else ("Adam", "AdamW")
        raise ValueError(
            f"param_groups[{g}] has decoupled_weight_decay={dwd}, but this emsa.{cls} "
            f"updates as {now} (decoupled_weight_decay={kind == 'adamw'}) in every group: "
            "emsa fixes the kind of weight decay for the whole optimizer when it is built. "
            f"Build an emsa.{other} and load this optimizer's state_dict into it (or one "
            "optimizer per kind of weight decay)")


def check_group(group: dict[str, Any], g: int, cls: str,
                all_params: list[torch.Tensor]) -> None:
    """param_groups[g] of an emsa.<cls> whose groups hold all_params: its hyperparameters and
    options, each parameter, no parameter listed twice, one device with an engine."""
    check_hyper(group, f"param_groups[{g}]")
    for key, (default, why) in TORCH_IMPL_OPTIONS.items():
        if key in group and group[key] != default and group[key] is not False:
            raise ValueError(f"{key}={group[key]!r} {why}")
    for key in ("foreach", "fused"):
        if group.get(key) not in (None, True, False):
            raise ValueError(f"param_groups[{g}] sets {key}={group[key]!r}; it is None, True or "
                             "False (emsa's step is fused and multi-tensor whichever it is)")
    if group.get("foreach") and group.get("fused"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    names = group.get("param_names")
    first: dict[int, int] = {}
    for j, p in enumerate(group["params"]):
        name = names[j] if names else f"param_groups[{g}].params[{j}]"
        check_param(name, p)
        k = first.setdefault(id(p), j)
        if k != j:
            # torch.optim warns that this "will cause an error" and updates the tensor
            # once per listing; emsa holds one state per parameter, so it refuses now.
            times = sum(q is p for q in group["params"])
            raise ValueError(
                f"{name} is the same tensor as param_groups[{g}].params[{k}]: it appears "
                f"{times} times in param_groups[{g}]; list each parameter once (for tied "
                "weights, pass the shared tensor once, e.g. model.parameters() does)")
    devices = {p.device for p in all_params}
    if len(devices) > 1:
        raise ValueError(
            "the optimizer's parameters are on several devices ("
            + ", ".join(sorted(str(d) for d in devices)) + "); emsa plans one device per "
            "optimizer: build one optimizer per device")
    for d in devices:
        if d.type not in ("cpu", "cuda"):
            raise NotImplementedError(f"emsa: parameters on {d} are not supported; emsa runs "
                                      "on the CPU and on CUDA devices")
