"""The seam between the optimizer classes and the engines that run a step.

An Engine is made once per optimizer, at planning time (emsa._engine.binding), from the plan
and the planned parameters. It owns the state memory (arenas) and runs steps; the optimizer
class owns torch's API (param groups, state_dict, closures). Two exist: the CPU engine (host
arenas, the SIMD worker pool; emsa._engine.cpu) and the CUDA engine (a device arena, fused
kernels on torch's current stream, host-tier state in a pinned arena updated by the CPU while
the GPU runs; emsa._engine.cuda).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Engine", "Gate", "StepResult"]


@dataclass
class StepResult:
    skipped: bool = False  # a non-finite gradient was found; nothing changed
    nonfinite_count: int = 0
    first_nonfinite: str = ""  # name of the first parameter with a non-finite gradient
    call: int = 0  # which step() call (1-based), for a result known only after later calls
    grad_norm: float | None = None  # total L2 norm before clipping (unscaled), when computed
    clipped: bool = False  # the clip coefficient was < 1


@dataclass
class Gate:
    """What a step or pass needs before any update: a step with any of these on is "gated"
    (no update before every gradient of it exists; the verdict and the clip coefficient come
    from one statistics pass over the gradients, never from a second one)."""

    check_finite: bool = False  # skip the whole step if any gradient holds inf/nan
    max_norm: float = 0.0  # clip by the global L2 norm as clip_grad_norm_ (0.0 = off)
    # 0-d float32 on the parameters' device (a GradScaler's scale): the gradients are scaled by
    # it, the norm and the update use them divided by it; a non-finite gradient then skips.
    loss_scale: torch.Tensor | None = None
    # 0-d float32 on the device: set to 1.0 if this step (or pass) was skipped, else unchanged.
    found_inf_out: torch.Tensor | None = None

    @property
    def gated(self) -> bool:
        return bool(self.check_finite or self.max_norm > 0.0 or self.loss_scale is not None)


class Engine:
    """What every engine provides. Its slots (emsa._engine.params.PlannedParams) fix the
    parameter order: trainable parameters only (requires_grad=True when the optimizer planned),
    never a frozen one. The param_groups given to step() and begin_pass() are the optimizer's
    groups as planned (PlannedParams.engine_groups): each group's "params" lists its planned
    parameters, in slot order.

    step() mode (step_in_backward=False):
        step(param_groups, gate) -> StepResult

    step_in_backward=True, per backward() call (a "pass"), for the updating passes only (every
    accumulate-th pass; the others only let .grad accumulate):
      begin_pass(param_groups, gate)  at the pass's first hook (hyperparameters read now)
      step_bucket(b) -> bool          for each bucket whose every member got its gradient in
                                      this pass; True: its gradients were consumed and the
                                      caller sets .grad = None for its members at once;
                                      False: the engine keeps them until end_pass
      end_pass()                      at the end of that backward() call: update every slot
                                      whose .grad is not None now and that step_bucket did not
                                      consume (buckets with members that got no gradient in
                                      this pass, gradients accumulated over earlier passes,
                                      gated buckets), decide the verdict, release what waited.
                                      Then the caller sets .grad = None for every slot.
      A begin_pass after a pass that never reached end_pass (its backward raised) discards
      that pass: nothing of it was updated by a gated engine; an ungated one updated what
      step_bucket consumed.

    The norm group (process_group=, emsa._distributed.groups) is fixed at construction: the sum of
    squares and the non-finite count are all-reduced over it before the verdict.
    """

    name = "abstract"
    # Whether step()'s result is known only later (a GPU skips a step without telling the host
    # at once): then step() returns StepResult() and finished_skips() reports skips as found.
    deferred = False

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """Slot i's state as torch tensors aliasing the engine's memory, in torch.optim's keys
        ("step", "exp_avg", "exp_avg_sq"; "master" for low-precision parameters). "step" is
        slot i's own count (per parameter, as torch keeps it)."""
        raise NotImplementedError

    def host_arenas(self) -> list:
        """The host arenas holding this engine's state (for the report's host memory)."""
        return []

    def step(self, param_groups: list[dict], gate: Gate) -> StepResult:
        """One optimizer step over every slot whose gradient is not None, reading each group's
        hyperparameters now (schedulers may have changed them). Slots whose .grad is None are
        skipped: no update, no state change, their step count stays. Checks first that the
        parameters are still the planned ones; raises before changing anything otherwise. A
        skipped step (a non-finite gradient in a gated step) changes nothing and writes
        gate.found_inf_out."""
        raise NotImplementedError

    def begin_pass(self, param_groups: list[dict], gate: Gate) -> None:
        raise NotImplementedError

    def bucket_slots(self) -> list[list[int]]:
        """The slots of each bucket: the unit step_bucket updates."""
        raise NotImplementedError

    def step_bucket(self, b: int) -> bool:
        raise NotImplementedError

    def end_pass(self) -> None:
        raise NotImplementedError

    def last_grad_norm(self) -> float | None:
        """The total gradient norm (before clipping, unscaled) of the last step or pass that
        computed one, else None; on a device this may wait for it."""
        return None

    def clip_count(self) -> int:
        """Steps and passes so far whose clip coefficient was < 1 (clipping fired)."""
        return 0

    def step_stats(self) -> list[dict]:
        """Measured per step (see the optimizer's step_stats)."""
        return []

    def state_loaded(self) -> None:
        """After state was written from outside (load_state_dict): take step counts from it, and
        take loaded master weights as current for the parameters as they are now."""
        raise NotImplementedError

    def check_loadable_steps(self, steps: list[float]) -> None:
        """Before load_state_dict changes anything: raises ValueError if this engine cannot
        hold these per-slot step counts."""

    def sync_state(self) -> None:
        """Makes state() exact (step counts included) before state_dict() or a load."""

    def synchronize(self) -> None:
        """Every update applied and visible to the current stream."""

    def finished_skips(self) -> list[StepResult]:
        """Skipped steps found since the last call (deferred engines); each is reported once."""
        return []

    def last_step_skipped(self) -> bool:
        """Whether the last step() was skipped (deferred engines; may wait for the device)."""
        raise NotImplementedError

    def close(self) -> None:
        """Lets go of the engine's handles; views already handed out keep their memory."""
