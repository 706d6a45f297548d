"""The seam between the optimizer classes and the engines that run a step.

A Backend is made once per optimizer, at planning time, from the plan and the parameters. It
owns the state memory (arenas) and runs steps; the optimizer class owns torch's API (param
groups, state_dict, closures). The CPU backend runs today; a CUDA backend (device arena, fused
kernels on a side stream, host tier on the CPU pool) slots in by implementing the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepResult:
    skipped: bool = False  # a non-finite gradient was found; nothing changed
    nonfinite_count: int = 0
    first_nonfinite: str = ""  # name of the first parameter with a non-finite gradient


class Backend:
    """What every engine provides. `slots` (emsa._binding.Slot) fix the parameter order."""

    name = "abstract"
    # Whether planning needs this machine's measured bandwidths (a device tier does; state that
    # all lives in host memory does not, and measuring would only cost time).
    wants_bandwidths = True
    # Set by the optimizer before each step: scan gradients first, skip the step on inf/nan.
    check_finite = True

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """Slot i's state as torch tensors aliasing the engine's memory, in torch.optim's keys
        ("step", "exp_avg", "exp_avg_sq"; "master" for low-precision parameters)."""
        raise NotImplementedError

    def step(self, param_groups: list[dict]) -> StepResult:
        """One optimizer step over every slot whose gradient is not None, reading each group's
        hyperparameters now (schedulers may have changed them). Checks first that the
        parameters are still the planned ones; raises before changing anything otherwise."""
        raise NotImplementedError

    def state_loaded(self) -> None:
        """After state was written from outside (load_state_dict): take step counts from it, and
        take loaded master weights as current for the parameters as they are now."""
        raise NotImplementedError


def select(device: torch.device) -> type[Backend]:
    if device.type == "cpu":
        from ._cpu_backend import CpuBackend

        return CpuBackend
    if device.type == "cuda":
        raise NotImplementedError(
            "emsa: the CUDA device tier is not built yet; parameters on the GPU cannot be "
            "optimized by this version. Use torch.optim.AdamW(fused=True) for now, or keep the "
            "parameters on the CPU")
    raise NotImplementedError(f"emsa: parameters on {device} are not supported; emsa runs on "
                              "the CPU (and CUDA, when its device tier is built)")


DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its numel elements fill one span of memory (contiguous,
    channels_last, any permutation), so an elementwise update may treat it as flat."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Elementwise-compatible memory layout: equal strides wherever the size is > 1."""
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def check_param(name: str, p: torch.Tensor) -> None:
    """What any emsa engine can update in place; raises ValueError saying what to do."""
    if p.dtype not in DTYPE_NAMES:
        if p.is_complex():
            advice = ("optimize torch.view_as_real(...) of it, or use torch.optim for complex "
                      "parameters")
        elif p.is_floating_point():
            advice = "cast the model (model.float()), or use torch.optim for it"
        else:
            advice = "integer tensors are not trainable parameters; remove it from the optimizer"
        raise ValueError(f"parameter {name} is {p.dtype}; emsa updates float32, bfloat16 and "
                         f"float16 parameters: {advice}")
    if p.layout is not torch.strided:
        raise ValueError(f"parameter {name} has layout {p.layout}; emsa updates dense "
                         "(strided) parameters only: use torch.optim for it")
    if not dense(p):
        raise ValueError(f"parameter {name} is not dense in memory (strides {p.stride()} for "
                         f"shape {tuple(p.shape)}); emsa updates parameters in place through "
                         "raw pointers: make it contiguous before building the optimizer")
