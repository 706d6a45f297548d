"""The seam between the optimizer classes and the engines that run a step.

A Backend is made once per optimizer, at planning time, from the plan and the parameters. It
owns the state memory (arenas) and runs steps; the optimizer class owns torch's API (param
groups, state_dict, closures). Two exist: the CPU backend (host arenas, the SIMD worker pool)
and the CUDA backend (a device arena, fused kernels on torch's current stream; host-tier state in
a pinned arena, updated by the CPU while the GPU runs, through emsa._host_tier).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class StepResult:
    skipped: bool = False  # a non-finite gradient was found; nothing changed
    nonfinite_count: int = 0
    first_nonfinite: str = ""  # name of the first parameter with a non-finite gradient
    call: int = 0  # which step() call (1-based), for a result known only after later calls
    grad_norm: float | None = None  # total L2 norm before clipping (unscaled), when computed
    clipped: bool = False  # the clip coefficient was < 1


class Backend:
    """What every engine provides. `slots` (emsa._binding.Slot) fix the parameter order.

    Slots are the trainable parameters only (requires_grad=True when the optimizer planned):
    a backend never sees a frozen parameter. The param_groups given to step() and begin_pass()
    are the optimizer's groups as the backend planned them: each group's "params" lists its
    planned parameters, in slot order (the front end filters the frozen ones out and refuses a
    frozen one that got a gradient before calling the backend).

    The call sequence, from the front end (emsa.optimizers), is exactly:

    step() mode (step_in_backward=False): the gating attributes below are set before each
    step():
        step(param_groups) -> StepResult

    step_in_backward=True: per backward() call (a "pass"), for the updating passes only (every
    accumulate-th pass; the others only let .grad accumulate):
      the gating attributes below are set, then
      begin_pass(param_groups)       at the pass's first hook (hyperparameters read now)
      step_bucket(b) -> bool         for each bucket whose every member got its gradient in
                                     this pass; True: its gradients were consumed and the
                                     front end sets .grad = None for its members at once;
                                     False: the backend keeps them until end_pass
      end_pass()                     from the autograd engine callback queued at the pass's
                                     first hook (the end of that backward() call): finish
                                     the pass: update every slot whose .grad is not None now
                                     and that step_bucket did not consume (buckets with members
                                     that got no gradient in this pass, gradients accumulated
                                     over earlier passes, gated buckets), decide the verdict,
                                     release what waited. Then the front end sets .grad = None
                                     for every slot.
      A begin_pass after a pass that never reached end_pass (its backward raised) discards
      that pass: nothing of it was updated by a gated backend; an ungated one updated what
      step_bucket consumed.

    Gating attributes (set by the front end as said above; a pass or step with any of them on
    is "gated": no update before every gradient of it exists):
      check_finite: bool           skip the whole step if any gradient holds inf/nan
      max_norm: float              clip by the global L2 norm as clip_grad_norm_ (0.0 = off)
      loss_scale: Tensor | None    0-d float32 on the parameters' device: gradients are
                                   scaled by it (a GradScaler's scale): divide by it (norm
                                   and update use the unscaled gradients); a non-finite
                                   gradient then always skips the step
      found_inf_out: Tensor | None 0-d float32 on the device: write 1.0 into it if this step
                                   (or pass) was skipped, else leave it unchanged
      norm_group: ProcessGroup | None  ranks that each hold part of the parameters: the sum
                                   of squares and the non-finite count are all-reduced (SUM)
                                   over it before the verdict and the clip coefficient, on
                                   every rank (emsa._distributed); None: this rank's alone
    The non-finite verdict and the clip coefficient come from one statistics pass over the
    gradients, never from a second one.
    """

    name = "abstract"
    # Whether planning needs this machine's measured bandwidths (a device tier does; state that
    # all lives in host memory does not, and measuring would only cost time).
    wants_bandwidths = True
    # Whether the plan may put state in the pinned host arena (tier L2).
    host_tier = True
    # Whether step()'s result is known only later (a GPU skips a step without telling the host
    # at once): then step() returns StepResult() and finished_skips() reports skips as found.
    deferred = False
    # Gating attributes, set by the front end (see the class docstring).
    check_finite = True
    max_norm = 0.0
    loss_scale: torch.Tensor | None = None
    found_inf_out: torch.Tensor | None = None
    norm_group = None

    @staticmethod
    def planning_profile(device: torch.device, measure_bandwidth: bool = False) -> str:
        """The profile to plan with when neither the user nor the probe record gave one and
        wants_bandwidths is False: this machine, without the timed measurements."""
        from .plan import quick_profile_json

        return quick_profile_json()

    def gated(self) -> bool:
        """Whether the current step or pass needs its verdict before any update."""
        return bool(self.check_finite or self.max_norm > 0.0 or self.loss_scale is not None)

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
        ("step", "exp_avg", "exp_avg_sq"; "master" for low-precision parameters). "step" is
        slot i's own count (per parameter, as torch keeps it)."""
        raise NotImplementedError

    def step(self, param_groups: list[dict]) -> StepResult:
        """One optimizer step over every slot whose gradient is not None, reading each group's
        hyperparameters now (schedulers may have changed them) and the gating attributes.
        Slots whose .grad is None are skipped: no update, no state change, their step count
        stays. Checks first that the parameters are still the planned ones; raises before
        changing anything otherwise. A skipped step (non-finite gradient under check_finite or
        loss_scale) changes nothing and writes found_inf_out."""
        raise NotImplementedError

    # Whether begin_pass/step_bucket exist: updates made from gradient hooks during backward
    # (the optimizer's step_in_backward=True).
    steps_in_backward = False

    def begin_pass(self, param_groups: list[dict]) -> None:
        """Step in backward: called once per updating pass, before its first step_bucket; reads
        each group's hyperparameters and the gating attributes now."""
        raise NotImplementedError

    def bucket_slots(self) -> list[list[int]]:
        """The slots of each bucket: the unit step_bucket updates."""
        raise NotImplementedError

    def step_bucket(self, b: int) -> bool:
        """Step in backward: bucket b's gradients are all final in this pass. Returns True if
        they were consumed (updated from, or copied where the update will read them): the
        front end then sets their .grad to None; False: they must stay until end_pass (a gated
        pass on an engine that reads them at the end). On a device, ordered after the current
        stream's work."""
        raise NotImplementedError

    def end_pass(self) -> None:
        """Step in backward: the pass's backward ended (see the class docstring): update what
        waited, write found_inf_out if the pass was skipped; on a device, what the current
        stream does next (the next forward, zero_grad) waits for the updates."""

    def last_grad_norm(self) -> float | None:
        """The total gradient norm (before clipping, unscaled) of the last step or pass that
        computed one, else None; on a device this may wait for it."""
        return None

    def clip_count(self) -> int:
        """Steps and passes so far whose clip coefficient was < 1 (clipping fired); may wait
        like last_grad_norm. Deferred engines put "grad_norm" and "clipped" into their
        step_stats() rows; the front end adds them to the CPU engine's."""
        return 0

    def state_loaded(self) -> None:
        """After state was written from outside (load_state_dict): take step counts from it, and
        take loaded master weights as current for the parameters as they are now."""
        raise NotImplementedError

    def check_loadable_steps(self, steps: list[float]) -> None:
        """Before load_state_dict changes anything: raises ValueError if this engine cannot
        hold these per-slot step counts (they may differ within a group)."""

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


def clip_coefficient(sum_sq: float, inv_scale: float, max_norm: float) -> tuple[float, float]:
    """(total_norm, clip_coef) as torch.nn.utils.clip_grad_norm_(max_norm) computes them, from
    the sum of squares of the (loss-scaled) gradients: total_norm in float32 (unscaled by
    inv_scale), coef = clamp(max_norm / (total_norm + 1e-6), max=1) with torch's own float32
    ops. torch sums float32 per-tensor norms; emsa's sum of squares is float64, so the norms
    agree to float32 rounding (a relative 1e-7 or so), not always bitwise."""
    norm = torch.tensor(math.sqrt(sum_sq), dtype=torch.float32) * inv_scale
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return float(norm), float(coef)


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
