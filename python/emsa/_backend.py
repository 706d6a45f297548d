"""The seam between the optimizer classes and the engines that run a step.

A Backend is made once per optimizer, at planning time, from the plan and the parameters. It
owns the state memory (arenas) and runs steps; the optimizer class owns torch's API (param
groups, state_dict, closures). Two exist: the CPU backend (host arenas, the SIMD worker pool)
and the CUDA backend (a device arena, fused kernels on torch's current stream; host-tier state in
a pinned arena, updated by the CPU while the GPU runs, through emsa._host_tier).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepResult:
    skipped: bool = False  # a non-finite gradient was found; nothing changed
    nonfinite_count: int = 0
    first_nonfinite: str = ""  # name of the first parameter with a non-finite gradient
    call: int = 0  # which step() call (1-based), for a result known only after later calls


class Backend:
    """What every engine provides. `slots` (emsa._binding.Slot) fix the parameter order."""

    name = "abstract"
    # Whether planning needs this machine's measured bandwidths (a device tier does; state that
    # all lives in host memory does not, and measuring would only cost time).
    wants_bandwidths = True
    # Whether the plan may put state in the pinned host arena (tier L2).
    host_tier = True
    # Whether step()'s result is known only later (a GPU skips a step without telling the host
    # at once): then step() returns StepResult() and finished_skips() reports skips as found.
    deferred = False
    # Set by the optimizer before each step: scan gradients first, skip the step on inf/nan.
    check_finite = True

    @staticmethod
    def planning_profile(device: torch.device, measure_bandwidth: bool = False) -> str:
        """The profile to plan with when neither the user nor the probe record gave one and
        wants_bandwidths is False: this machine, without the timed measurements."""
        from .plan import quick_profile_json

        return quick_profile_json()

    # Shared by both backends, which hold: counts (planned parameters per group), params,
    # views (slot i's state tensors), versions (each parameter's _version when its master was
    # last written).
    def _check_groups(self, param_groups: list[dict]) -> None:
        if len(param_groups) != len(self.counts) or any(
                len(g["params"]) != c for g, c in zip(param_groups, self.counts)):
            got = [len(g["params"]) for g in param_groups]
            raise ValueError(
                f"the optimizer's parameter groups hold {got} parameters but emsa planned "
                f"{self.counts}: parameters added or removed after planning are not "
                "optimized; build a new optimizer over the new parameter set")

    # Also held by both: names, ptrs, shapes, strides (each slot's parameter as planned).
    def _planned_params(self, param_groups: list[dict], moved):
        """Each parameter of param_groups with its slot, in slot order, as (i, p), checked
        first: another tensor than the planned one raises; one whose storage, shape or strides
        changed since planning goes to moved(i, p), which raises or takes the new storage."""
        expected, ptrs, shapes, names = self.params, self.ptrs, self.shapes, self.names
        strides = self.strides
        i = 0
        for group in param_groups:
            for p in group["params"]:
                if p is not expected[i]:
                    raise ValueError(
                        f"{names[i]} was replaced by another tensor after emsa planned it; "
                        "build a new optimizer over the new parameter set")
                if p.data_ptr() != ptrs[i] or p.shape != shapes[i] or p.stride() != strides[i]:
                    moved(i, p)
                yield i, p
                i += 1

    def _check_layout(self, i: int, p: torch.Tensor) -> None:
        """Raises if p's memory layout is not the planned one: the state tensors keep the
        planned strides and are updated elementwise beside the parameter's memory, so a
        permuted parameter would meet its moments in another order. Strides of size-1
        dimensions do not matter and are taken."""
        old = self.strides[i]
        if not all(a == b for a, b, n in zip(old, p.stride(), p.shape) if n > 1):
            raise ValueError(
                f"parameter {self.names[i]} changed memory layout after emsa planned it "
                f"(strides {tuple(old)} -> {tuple(p.stride())} for shape {tuple(p.shape)}, e.g. "
                "model.to(memory_format=...) or a transposed .data); emsa keeps the optimizer "
                "state in the planned layout: restore the parameter's layout, or build a new "
                "optimizer after the change and load this one's state_dict into it")
        self.strides[i] = p.stride()

    def refresh_master(self, i: int) -> None:
        """Someone else wrote the parameter (emsa's raw writes leave _version alone): the
        master follows the parameter, rather than overwriting that write at the next update."""
        p = self.params[i]
        with torch.no_grad():
            self.views[i]["master"].copy_(p)
        self.versions[i] = p._version

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """Slot i's state as torch tensors aliasing the engine's memory, in torch.optim's keys
        ("step", "exp_avg", "exp_avg_sq"; "master" for low-precision parameters)."""
        raise NotImplementedError

    def step(self, param_groups: list[dict]) -> StepResult:
        """One optimizer step over every slot whose gradient is not None, reading each group's
        hyperparameters now (schedulers may have changed them). Checks first that the
        parameters are still the planned ones; raises before changing anything otherwise."""
        raise NotImplementedError

    # Whether begin_pass/step_slot exist: updates made from gradient hooks during backward
    # (the optimizer's step_in_backward=True).
    steps_in_backward = False

    def begin_pass(self, param_groups: list[dict]) -> None:
        """Step in backward: called once per updating pass, before its first step_slot; reads
        each group's hyperparameters now (a scheduler may have changed them)."""
        raise NotImplementedError

    def bucket_slots(self) -> list[list[int]]:
        """Step in backward: the slots of each bucket, the unit step_bucket updates."""
        raise NotImplementedError

    def step_bucket(self, b: int) -> None:
        """Step in backward: updates bucket b's slots from their gradients (which must be
        final); on a device, ordered after the current stream's work. No non-finite check (the
        optimizer refuses skip_nonfinite in this mode)."""
        raise NotImplementedError

    def end_pass(self) -> None:
        """Step in backward: every bucket of the pass was given to step_bucket; on a device,
        what the current stream does next (the next forward, zero_grad) waits for the
        updates."""

    def state_loaded(self) -> None:
        """After state was written from outside (load_state_dict): take step counts from it, and
        take loaded master weights as current for the parameters as they are now."""
        raise NotImplementedError

    def check_loadable_steps(self, steps: list[float]) -> None:
        """Before load_state_dict changes anything: raises ValueError if this engine cannot
        hold these per-slot step counts."""

    def sync_state(self) -> None:
        """Makes state() exact (step counts included) before state_dict() or a load."""

    def finished_skips(self) -> list[StepResult]:
        """Skipped steps found since the last call (deferred engines); each is reported once."""
        return []

    def last_step_skipped(self) -> bool:
        """Whether the last step() was skipped (deferred engines; may wait for the device)."""
        raise NotImplementedError


def select(device: torch.device) -> type[Backend]:
    if device.type == "cpu":
        from ._cpu_backend import CpuBackend

        return CpuBackend
    if device.type == "cuda":
        from ._cuda_backend import CudaBackend

        return CudaBackend
    raise NotImplementedError(f"emsa: parameters on {device} are not supported; emsa runs on "
                              "the CPU and on CUDA devices")


DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its numel elements fill one span of memory (contiguous,
    channels_last, any permutation), so an elementwise update may treat it as flat. A tensor
    with no elements is dense (there is nothing to lay out)."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def state_view(arena, offset: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """arena.view(offset, like, dtype); a parameter with no elements has no planned bytes (the
    plan may have no arena at all), so its state is an empty tensor of its shape."""
    if like.numel() == 0:
        return torch.empty_strided(like.shape, like.stride(), dtype=dtype, device=like.device)
    return arena.view(offset, like, dtype)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Elementwise-compatible memory layout: equal strides wherever the size is > 1."""
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def kernel_grad(name: str, g: torch.Tensor, p: torch.Tensor, stride) -> torch.Tensor:
    """g as the kernels read it, element i beside p's element i. Sparse gradients are refused;
    g itself is returned when its layout is p's (the usual case), else a copy in p's layout,
    which the caller keeps alive until the update that reads it has run."""
    if g.layout is not torch.strided:
        raise ValueError(f"{name} has a sparse gradient ({g.layout}); emsa updates dense "
                         "gradients only: use torch.optim.SparseAdam for sparse embeddings, or "
                         "make the embedding dense (sparse=False)")
    if g.stride() != stride and not same_layout(g, p):
        return torch.empty_like(p).copy_(g)
    return g


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
