"""The torch.optim.Optimizer that emsa.AdamW, emsa.Adam and emsa.Lion share (emsa.optimizers
holds the three classes and their documentation).

EmsaOptimizer keeps torch's API: param groups (so LR schedulers, per-group hyperparameters,
closures and zero_grad work unchanged), state, state_dict, GradScaler's hand-over. It holds,
as members: its options (EmsaOptions), its place in torch.distributed (DistributedSetup), what
planning made (Binding: the plan, the engine, the planned parameters), the in-backward passes
(Passes) and the set-up times. Planning runs once: at construction with probe= or
step_in_backward, else at the first step().
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch
from torch.optim import Optimizer

from ._distributed import groups as distributed
from ._distributed.ddp import DdpUpdates
from ._engine import options as checks
from ._engine import records
from ._engine import state_dict as state_io
from ._engine.binding import Binding, bind
from ._engine.engine import Gate
from ._engine.options import EmsaOptions
from ._engine.opt_state import OptimizerState
from ._engine.passes import Passes
from ._engine.setup_times import SetupTimes
from ._native.planner import Plan, require_library
from .probe_record import ProbeRecord

__all__ = ["EmsaOptimizer"]


class EmsaOptimizer(Optimizer):
    _kind = "adamw"

    # GradScaler.step(opt) hands emsa its scale and inf verdict (opt.grad_scale, opt.found_inf)
    # instead of unscaling the gradients itself: emsa unscales inside the update.
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults: dict[str, Any], options: EmsaOptions):
        require_library()
        self._options = options.resolve()
        self._max_grad_norm = options.max_grad_norm
        self._grad_scaler = options.grad_scaler
        self._accumulate = int(options.accumulate)
        self.skip_nonfinite = options.skip_nonfinite
        self._warned: set[str] = set()
        self._bound: Binding | None = None
        self._passes: Passes | None = None
        self._ddp_updates: DdpUpdates | None = None
        self._recorder: records.FirstBackwardRecorder | None = None
        self._setup = SetupTimes()
        self._last_skipped = False
        self._stats_rows: dict[int, dict] = {}  # step_stats() rows, merged across calls
        super().__init__(params, defaults)
        self._dist = distributed.configure(
            self._all_params(), options.process_group, options.ddp,
            in_backward=options.step_in_backward, accumulate=self._accumulate)
        if options.probe is not None:
            self._bind(options.probe)
        elif options.step_in_backward:
            self._bind(None)  # no step() will come to plan at: plan from the shapes now
        else:
            self._recorder = records.FirstBackwardRecorder(self._all_params())
        if self._dist.zero is not None and self._bound is None:
            self._bind(None)  # ZeRO may load state before the first step
        if self._dist.ddp_model is not None and self._passes is not None:
            self._ddp_updates = DdpUpdates(self._passes, self._dist.ddp_model)

    # ---- param groups ---------------------------------------------------------------------
    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_bound", None) is not None:
            raise ValueError("emsa planned this optimizer's state already; parameters added "
                             "now would not be optimized: build a new optimizer over the whole "
                             "parameter set (add groups before the first step)")
        super().add_param_group(param_group)
        try:
            self._check_group(len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()
            raise
        if getattr(self, "_recorder", None) is not None:
            self._recorder.remove()
            self._recorder = records.FirstBackwardRecorder(self._all_params())

    def _check_group(self, g: int) -> None:
        checks.check_group(self.param_groups[g], g, type(self).__name__, self._all_params())
        checks.check_fixed_keys(self.param_groups[g], g, self._kind, type(self).__name__)

    def _engine_groups(self, unfrozen: bool = False) -> list[dict]:
        """param_groups as the engine planned them, checked (PlannedParams.engine_groups), and
        the keys emsa fixed at construction unchanged."""
        for g, group in enumerate(self.param_groups):
            checks.check_fixed_keys(group, g, self._kind, type(self).__name__)
        return self._bound.planned.engine_groups(self.param_groups, unfrozen)

    # ---- planning -------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The plan (str() it for the table, .json for the data); None until planned: at
        construction with probe= or step_in_backward=True, else at the first step()."""
        return None if self._bound is None else self._bound.plan

    @property
    def probe_record(self) -> ProbeRecord | None:
        """The record the plan was made from (parameters this optimizer does not hold marked
        frozen); None until planned."""
        return None if self._bound is None else self._bound.record

    def _bind(self, record: ProbeRecord | None) -> None:
        with self._setup.planning(f"emsa.{type(self).__name__} set-up"):
            bound = bind(self.param_groups, kind=self._kind, options=self._options,
                         record=record, recorder=self._recorder, dist=self._dist,
                         setup=self._setup, gated_in_backward=self._gated_in_backward(),
                         releases_grads=self._releases_grads())
        self.state.attach(bound.engine, bound.planned, type(self).__name__)
        self._bound = bound
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None
        if self._options.step_in_backward:
            self._passes = Passes(self, bound, self._setup, self._dist, self._accumulate)

    def _gated_in_backward(self) -> bool:
        """Whether in-backward passes wait for every gradient (clipping, the non-finite check,
        a loss scale): then device-tier gradients are held until backward ends."""
        return self._options.step_in_backward and bool(
            self._max_grad_norm or self.skip_nonfinite or self._grad_scaler is not None)

    def _releases_grads(self) -> bool:
        """What the plan may assume: gradients freed during backward. A gated pass keeps the
        device tier's until backward ends (only the host tier's leave as their copies land), so
        such a plan counts every gradient held, unless all state is on the host."""
        return self._options.step_in_backward and (self._options.tier == "host"
                                                   or not self._gated_in_backward())

    def _warn_gated_after_plan(self) -> None:
        bound = self._bound
        if (bound is None or bound.engine.name != "cuda"  # the CPU engine plans no device memory
                or not bound.releases_grads or self._releases_grads()):
            return
        warnings.warn(
            "emsa: this optimizer planned its device memory assuming gradients are freed during "
            "backward; with clipping, the non-finite check or a loss scale an in-backward pass "
            "holds the device tier's gradients until backward ends, so the peak is higher than "
            "planned. Pass max_grad_norm= / grad_scaler= / skip_nonfinite= at construction to "
            "plan for it (or use tier='host').", RuntimeWarning, stacklevel=3)

    def _gate(self, loss_scale=None, found_inf_out=None, amp: bool = False) -> Gate:
        """What the coming step or pass waits for before any update."""
        return Gate(check_finite=bool(self.skip_nonfinite or amp),
                    max_norm=float(self._max_grad_norm or 0.0), loss_scale=loss_scale,
                    found_inf_out=found_inf_out)

    # ---- opt.state: torch's mapping over emsa's memory (OptimizerState) --------------------
    @property
    def state(self) -> OptimizerState:
        return self.__dict__["_state"]

    @state.setter
    def state(self, items) -> None:
        # torch.optim.Optimizer.__init__ assigns the first one; any later assignment starts
        # every parameter afresh and copies in what items hold, as torch would read them.
        held = self.__dict__.get("_state")
        if held is None:
            self.__dict__["_state"] = OptimizerState(items)
        elif items is not held:
            held.replace(items)

    # ---- options --------------------------------------------------------------------------
    @property
    def step_in_backward(self) -> bool:
        """Whether updates run in backward, from the gradient hooks (read-only)."""
        return self._options.step_in_backward

    @property
    def max_grad_norm(self) -> float | None:
        """Clip by the global L2 norm of every gradient this optimizer holds, as
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm), inside the update; None = off.
        Settable; takes effect from the next step (or in-backward pass)."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value) -> None:
        self._max_grad_norm = checks.check_max_norm(value)
        self._warn_gated_after_plan()

    @property
    def grad_scaler(self):
        """step_in_backward: the torch.amp.GradScaler whose scale emsa divides by in backward;
        settable before the first backward that uses it."""
        return self._grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler) -> None:
        if scaler is not None and not self._options.step_in_backward:
            raise ValueError("grad_scaler applies with step_in_backward=True; in step() mode "
                             "scaler.step(opt) hands its scale to emsa by itself")
        self._grad_scaler = scaler
        self._warn_gated_after_plan()

    def hand_over(self, *, by: str, accumulate: int | None = None,
                  accumulate_setting: str = "gradient accumulation", max_grad_norm=None,
                  clip_setting: str = "clipping", grad_scaler=None,
                  unscales_after_backward: bool = False) -> Callable[[], None]:
        """For trainer integrations (emsa.hf, emsa.lightning call it at train start): the
        trainer's gradient accumulation (its backwards per optimizer step: with
        step_in_backward emsa then updates in the last), its clipping threshold (kept as emsa's
        max_grad_norm unless the optimizer was given its own) and, in backward, its GradScaler.
        unscales_after_backward: the trainer calls scaler.unscale_(opt) after backward on its
        own (to log a norm), which emsa need not warn about since it clips itself. Returns the
        function that gives the accumulation back at train end. An optimizer built with another
        accumulate= is refused: the trainer zeroes the gradients after each optimizer step, so
        the two must agree."""
        previous = None
        if accumulate is not None and self.step_in_backward and self._accumulate != accumulate:
            if self._accumulate != 1:
                raise ValueError(
                    f"{by}: the emsa optimizer accumulates {self._accumulate} backward passes "
                    f"(accumulate=), the trainer's {accumulate_setting} is {accumulate}. The "
                    "trainer zeroes the gradients after each optimizer step, so they must agree: "
                    f"pass {accumulate_setting}=N to the trainer (the callback hands it to emsa) "
                    "and leave emsa's accumulate at 1")
            previous = self._accumulate
            self._set_accumulate(int(accumulate))
        if max_grad_norm:
            if self._max_grad_norm is None:
                self.max_grad_norm = max_grad_norm
            elif self._max_grad_norm != max_grad_norm:
                warnings.warn(
                    f"{by}: the emsa optimizer clips at max_grad_norm={self._max_grad_norm}, the "
                    f"trainer's {clip_setting} is {max_grad_norm}; emsa's threshold is kept and "
                    "the trainer's clipping is turned off", RuntimeWarning, stacklevel=3)
        if grad_scaler is not None and self.step_in_backward:
            if self._grad_scaler is None:
                self.grad_scaler = grad_scaler
            if unscales_after_backward:
                # emsa warns about an unscale_ after backward because clipping there would act
                # on nothing; here emsa clips, and the trainer only logs.
                self._warned.add("unscale")

        def give_back() -> None:
            if previous is not None:
                self._set_accumulate(previous)

        return give_back

    def _set_accumulate(self, n: int) -> None:
        self._accumulate = n
        if self._passes is not None:
            self._passes.accumulate = n

    # ---- measurements ---------------------------------------------------------------------
    @property
    def last_grad_norm(self) -> float | None:
        """The total gradient norm (before clipping, unscaled) of the last step that computed
        one (max_grad_norm set), else None. On CUDA reading it waits for that step."""
        return None if self._bound is None else self._bound.engine.last_grad_norm()

    @property
    def clip_count(self) -> int:
        """Steps so far where clipping fired (clip coefficient < 1). On CUDA it waits."""
        return 0 if self._bound is None else self._bound.engine.clip_count()

    def _warn_once(self, key: str, message: str, stacklevel: int = 3) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)

    def synchronize(self) -> None:
        """Waits until every update is applied and visible to the current stream, and makes
        the "step" counts in opt.state exact (on CUDA a skipped step is learned late). Needed
        only before reading host-tier parameters outside a module's forward (model.state_dict(),
        a functional use) or reading opt.state directly: a module's forward waits for its own
        parameters by itself."""
        if self._bound is None:
            return
        engine = self._bound.engine
        if engine.deferred:
            engine.sync_state()
            self._warn_skipped(engine.finished_skips(), stacklevel=3)
        else:
            engine.synchronize()

    def step_stats(self) -> list[dict]:
        """Measured per step. CUDA: time_s (GPU time from this step's start to the next's),
        d2h_s / cpu_s / h2d_s (host-tier busy times), wait_s (host time a forward waited for
        an upload not yet enqueued), peak_device_bytes (torch.cuda.max_memory_allocated at the
        step's start); waits for the GPU. CPU: time_s (wall clock from one step() to the next)
        and opt_s (step() itself). With clipping, grad_norm and clipped. The last step has no
        time_s until the next one starts."""
        rows = [] if self._bound is None else self._bound.engine.step_stats()
        merged = self._stats_rows
        for row in rows:
            merged.setdefault(row["step"], {}).update(row)
        return [merged[k] for k in sorted(merged)]

    def setup_stats(self) -> dict[str, Any]:
        """Where the set-up went: {"times": seconds per phase (profile, plan, arenas, bind,
        first_step, ...), "total", "profile": where the plan's profile came from, "probe": the
        probe record's own phases when emsa.probe() made it in this process, "host_memory":
        bytes page-locked and pageable in the host arenas}."""
        bound = self._bound
        out = self._setup.summary(None if bound is None else bound.record,
                                  self._options.profile_text is not None)
        out["host_memory"] = None if bound is None else bound.host_memory
        return out

    def report(self, run_dir: str | os.PathLike, losses: list[float] | None = None,
               peer_losses: list[float] | None = None, meta: dict | None = None) -> str:
        """Writes the plan, the probe record, the measured steps (with losses when given) and
        meta into run_dir, then the Markdown report and its plots (emsa.report); returns the
        report's path."""
        from .report import write_run

        if self._bound is None:
            raise ValueError("the optimizer has not planned yet: report after the first step")
        return write_run(run_dir, plan=self._bound.plan, record=self._bound.record,
                         steps=self.step_stats(), losses=losses, peer_losses=peer_losses,
                         meta=meta, setup=self._setup.summary(
                             self._bound.record, self._options.profile_text is not None))

    # ---- the step -------------------------------------------------------------------------
    # Under torch.compile the step is a graph break: Dynamo must never trace planning, the
    # arenas or the ctypes calls (traced, they are replayed with stale pointers and counts).
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter whose .grad is not None; returns closure()'s loss.
        With step_in_backward=True the updates were made during backward: this only calls
        the closure (if given) and returns its loss. Under torch.compile it runs eagerly, as
        one graph break."""
        passes = self._passes
        loss = None
        if closure is not None:
            if passes is not None:
                passes.refuse_clipping_after(closure)
            with torch.enable_grad():
                loss = closure()
        amp = "found_inf" in self.__dict__  # set by GradScaler.step, which then calls this
        if passes is not None:
            if not passes.trainer_checked:
                passes.refuse_trainer_settings(None)
            if amp:
                passes.amp_step(unscaled=self.__dict__.get("grad_scale", 0) is None)
            return loss
        if self._bound is None:
            self._bind(None)
        bound = self._bound
        engine = bound.engine
        # GradScaler: grad_scale is its scale (None if scaler.unscale_ already unscaled). Its
        # inf verdict is the one emsa's own check gives on the same gradients, so emsa checks
        # (fused with the norm) rather than reading found_inf on the host.
        scale = self.__dict__.get("grad_scale") if amp else None
        if scale is not None and not isinstance(scale, torch.Tensor):
            scale = torch.tensor(float(scale), dtype=torch.float32)
        gate = self._gate(loss_scale=scale, amp=amp)
        with self._setup.first_step():
            with bound.shards.step_groups(self._engine_groups()) as engine_groups:
                result = engine.step(engine_groups, gate)
        if self.state.hidden:  # parameters updated for the first time get their entries
            self.state.reveal(self.state.unshown_with_grads())
        if engine.deferred:
            self._warn_skipped(engine.finished_skips(), stacklevel=3)
        else:
            self._last_skipped = result.skipped
            if result.skipped and not amp:
                self._warn_skipped([result], stacklevel=3)
        return loss

    @property
    def last_step_skipped(self) -> bool:
        """True when the last step() changed nothing because a gradient held inf/nan
        (skip_nonfinite=True). On CUDA, reading it waits for that step to finish on the GPU:
        step() itself never waits, so read it only when you need the answer."""
        bound = self._bound
        if bound is None:
            return False
        engine = bound.engine
        if not engine.deferred:
            return self._passes.last_skipped if self._passes is not None else self._last_skipped
        skipped = engine.last_step_skipped()
        self._warn_skipped(engine.finished_skips(), stacklevel=3)
        return skipped

    def _warn_skipped(self, results, stacklevel: int) -> None:
        for r in results:
            where = f" (first in {r.first_nonfinite})" if r.first_nonfinite else ""
            late = (f" Found after the fact: it was step() call {r.call}; the GPU skips a step "
                    "without making step() wait." if r.call else "")
            warnings.warn(
                f"emsa: step skipped: {r.nonfinite_count} non-finite gradient elements{where}; "
                "parameters, state and step counts are unchanged. skip_nonfinite=False applies "
                "such steps as torch.optim does, except with max_grad_norm= (a non-finite norm "
                f"would make every parameter NaN).{late}", RuntimeWarning,
                stacklevel=stacklevel)

    def remove_hooks(self) -> None:
        """step_in_backward: removes the gradient hooks; later backwards update nothing."""
        if self._passes is not None:
            self._passes.remove_hooks()

    # ---- state_dict -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout; the state tensors are emsa's own (views into its arenas), as
        torch's are its live tensors. On CUDA this waits for the GPU (step counts are read
        back from it)."""
        if self._bound is not None:
            engine = self._bound.engine
            engine.sync_state()
            self._warn_skipped(engine.finished_skips(), stacklevel=3)
        sd = super().state_dict()
        # Plain dicts, as torch.optim's: torch.load(weights_only=True) reads no emsa class.
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accepts emsa's or torch.optim's state_dict (same layout) and copies it into emsa's
        state, converting dtypes as needed. Everything is checked before anything changes."""
        if self._bound is None:
            self._bind(None)
        bound = self._bound
        engine = bound.engine
        sources = state_io.check_state_dict(
            state_dict, self.param_groups, self.defaults, bound.planned, self._kind,
            type(self).__name__, lambda key, message: self._warn_once(key, message, 4))
        engine.check_loadable_steps(
            [float(sources.get(i, {}).get("step", 0)) for i in range(len(bound.planned))])
        engine.sync_state()
        self._warn_skipped(engine.finished_skips(), stacklevel=3)
        # torch's loader takes the param groups (hyperparameters, hooks); the state is copied
        # here straight from the source, without torch's per-tensor cast copies.
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self.__dict__.pop("state", None)  # torch's __setstate__ put its own beside emsa's
        state_io.copy_state(engine, bound.planned, sources)
        self.state.loaded(sources)

    def __getstate__(self):
        raise TypeError(f"emsa.{type(self).__name__} cannot be pickled or deep-copied (its state "
                        "lives in emsa's arenas); save and load opt.state_dict() instead")
