"""emsa.AdamW, emsa.Adam, emsa.Lion: torch.optim.Optimizer subclasses run by libemsa.

They take torch's constructor arguments and keep torch's param groups (so LR schedulers, param
groups with their own hyperparameters, closures and zero_grad work unchanged), plus keyword-only
options of emsa's own:

  probe=           a ProbeRecord (emsa.probe(model, batch)) or a path to one. Given, the optimizer
                   plans and lays out its state at construction, so a budget that cannot be met
                   fails before training. Not given, it plans at the first step() from the
                   parameters' shapes and the gradient-ready order hooks saw during the first
                   backward (installed at construction, removed at planning); forward timings
                   are then unknown, so hotness is ranked by order only.
  budget=          device memory for the whole training process, bytes or "20GiB"; default: free
                   device memory minus a margin (no GPU: unlimited).
  state_dtype=     torch.float32 (default; matches torch.optim) or torch.bfloat16.
  skip_nonfinite=  True (default in step() mode; False with step_in_backward): a step whose
                   gradients hold inf/nan changes nothing (no parameter, state or step count),
                   warns, and sets opt.last_step_skipped. Accepted in every mode and tier.
                   torch.optim applies such a step and the weights become NaN for good, a
                   loss that no speed-up repays. The verdict comes from the same pass over the
                   gradients as the clipping norm (one fused pass at step()).
                   On CUDA the GPU decides and step() does not wait for it: the warning comes
                   at a later step() (or when last_step_skipped or state_dict() is read, which
                   wait for the GPU). With step_in_backward the check makes every update of a
                   pass wait for the end of backward (the verdict needs every gradient), which
                   is what that mode exists to avoid: hence off by default there.
  max_grad_norm=   None (default): no clipping. A number > 0: clip by the global L2 norm of
                   every gradient the optimizer holds, exactly as
                   torch.nn.utils.clip_grad_norm_(params, max_grad_norm) before torch's step
                   (coef = min(1, max_grad_norm / (norm + 1e-6))), applied inside the update: no
                   separate clipping pass, and exact in every mode (in backward the updates of
                   a pass wait for its norm). opt.max_grad_norm is settable (None or 0: off)
                   and read at each step / pass. opt.last_grad_norm is the last step's norm
                   before clipping (unscaled), opt.clip_count the steps where clipping fired;
                   step_stats() rows gain "grad_norm" and "clipped". The norm is the float64
                   sum of squares' root rounded to float32; torch's (float32 per-tensor norms)
                   agrees to float32 rounding.
  profile=         a DeviceProfile (dict, JSON text or path) to plan against instead of this
                   machine's; for planning ahead and for tests.
  step_in_backward= False (default). True: each parameter is updated from a gradient hook
                   (register_post_accumulate_grad_hook) as soon as its gradient is final in
                   backward, and its .grad is then set to None, so gradient memory is released
                   during backward instead of held until step(). opt.step() then updates
                   nothing (it only calls the closure, if given, and returns its loss) and
                   zero_grad() is harmless. The unit of update is a bucket: one parameter on
                   the CPU; on CUDA one of the plan's buckets (one fused launch on the current
                   stream once all its gradients are final). A pass is one backward() call: it
                   begins at its first gradient (when lr and the other hyperparameters are
                   read) and ends when that backward returns (autograd's end-of-backward
                   callback; a reentrant backward inside it, as checkpoint(use_reentrant=True)
                   runs, belongs to the outer one). Parameters that got no gradient in a pass
                   are not updated and keep their step count (per parameter, as torch). Without
                   probe= the optimizer plans at construction, from the parameters' shapes.
                   - gradient accumulation: accumulate=N updates every Nth backward (and then
                     releases the gradients); the others leave .grad to accumulate as usual;
                   - "gated" passes, that need every gradient before any update (max_grad_norm,
                     skip_nonfinite=True, grad_scaler=): the updates wait for the end of
                     backward (on the CPU the whole step runs then; on CUDA the statistics are
                     summed per bucket as its gradients become final, and host-tier copies
                     still overlap backward).
                     Clipping by hand after backward cannot work (the gradients are gone):
                     use max_grad_norm=. torch.nn.utils.clip_grad_norm_ / clip_grad_value_
                     called on gradients a pass consumed are refused, unless the call asks
                     for emsa's own max_grad_norm (it then returns emsa's norm and warns
                     once) or only the norm (max_norm=inf: emsa's, or nan with a warning
                     when emsa does not clip; emsa._hand_clipping); emsa warns at
                     scaler.unscale_(opt), and refuses the step of a Hugging Face or
                     Lightning Trainer that would clip, or accumulate batches emsa does not,
                     without emsa.hf.EmsaTrainerCallback / emsa.lightning.EmsaLightningCallback
                     (they hand both settings to emsa);
                   - DDP: pass ddp=ddp_model (below); under torch.distributed with world
                     size > 1 and neither ddp= given, emsa refuses (updates before the
                     all-reduce would be each rank's own);
                   - opt.remove_hooks() ends the mode's updates.
  grad_scaler=     with step_in_backward: the torch.amp.GradScaler that scales the loss. emsa
                   divides the gradients by its current scale in backward (read as its scale
                   tensor, no host sync), skips a pass with inf/nan (nothing changes), and when
                   scaler.step(opt) runs, hands the scaler that verdict so that scaler.update()
                   backs off as after a skipped torch step. A GradScaler stepping an in-backward
                   optimizer not given grad_scaler= raises (its updates in backward used scaled
                   gradients). In step() mode no keyword is needed: emsa sets
                   _step_supports_amp_scaling, so scaler.step(opt) hands emsa its scale
                   (opt.grad_scale) and emsa unscales inside the update, skipping the steps
                   the scaler found inf in (the scaler's own inf check still runs: that pass is
                   torch's); scaler.unscale_(opt) before step() also works.
  accumulate=      with step_in_backward: update every Nth backward (default 1).
  process_group=   torch.distributed group whose ranks each hold part of the parameters
                   (ZeRO-1, FSDP2): the norm and non-finite count are summed over it, so
                   max_grad_norm clips by the global norm and every rank skips together.
                   None (default): this rank's alone (DDP), or ZeroRedundancyOptimizer's group
                   when it builds emsa, or the DTensor mesh's group. See emsa._distributed.
  ddp=             the DistributedDataParallel model: with step_in_backward, emsa updates
                   each bucket from DDP's communication hook once its all-reduce (average)
                   is done, still in backward (emsa._ddp); replicas' plans are compared.
                   False: this rank's gradients are its own (no reduction, no comparison).
  tier=            None (default): the planner decides what state leaves the device, coldest
                   first, as much as budget= requires. "device": all state on the device (a
                   budget too small fails with the smallest that works). "host": all state
                   (and an fp32 master of every parameter) in pinned host memory, updated by
                   the CPU while the GPU runs, parameters copied back per bucket.
                   step_in_backward=True is what hides the host tier's copies under backward
                   and frees each gradient once copied: use it with tier="host" when nothing
                   between backward and step() needs the gradients.

Frozen parameters: those with requires_grad=False when the optimizer plans (at construction
with probe= or step_in_backward, else at the first step()) get no state, no arena bytes and no
state_dict entry, as torch.optim keeps none for them. One that later gets a gradient (or, in
backward, requires one) is refused before anything changes: build a new optimizer after
unfreezing and load this one's state_dict into it. Parameters whose .grad is None at a step are
skipped with their own step count.

state_dict() has torch.optim's layout ("step" float32 scalar, "exp_avg", "exp_avg_sq"), so a
checkpoint moves between emsa.AdamW and torch.optim.AdamW in both directions (frozen
parameters keep their index, with no state, as in torch's). The state tensors are views into
emsa's arenas, as torch's are its live tensors.

DTensor parameters (FSDP2's fully_shard): each rank plans and updates its local shards, under its
own budget=, in step() mode and with step_in_backward (FSDP2 runs the hooks after its
reduce-scatter); their state tensors are DTensors, so torch.distributed.checkpoint reshards
them between world sizes and into torch.optim (emsa._dtensor).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch
from torch.optim import Optimizer

from . import _binding, _distributed, _dtensor, _progress, _setup, _state_io, _tuning, _validate
from ._arena import host_memory
from ._backend import Backend, select
from ._in_backward import InBackwardPasses
from .plan import Plan, make_plan, parse_bytes, profile_json, require_library
from .probe_record import ProbeRecord

__all__ = ["AdamW", "Adam", "Lion"]


class _EmsaOptimizer(InBackwardPasses, Optimizer):
    _kind = "adamw"

    # GradScaler.step(opt) hands emsa its scale and inf verdict (opt.grad_scale, opt.found_inf)
    # instead of unscaling the gradients itself: emsa unscales inside the update.
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults: dict[str, Any], *, probe, budget, state_dtype,
                 skip_nonfinite, profile, step_in_backward=False, accumulate=1, tier=None,
                 max_grad_norm=None, grad_scaler=None, process_group=None, ddp=None):
        require_library()
        _validate.check_tier(tier)
        self._tier = tier
        self._skip_explicit = skip_nonfinite
        self._stats: dict[int, dict] = {}
        self._wall: list[tuple[float, float]] = []  # (start, end) of each step() (CPU engine)
        skip_nonfinite = _validate.in_backward_options(step_in_backward, accumulate,
                                                       skip_nonfinite)
        self._in_backward = bool(step_in_backward)
        self._accumulate = int(accumulate)
        self._hooks: list = []
        _validate.check_state_dtype(state_dtype)
        self._budget = parse_bytes(budget) if budget is not None else None
        self._state_dtype = state_dtype
        self._profile = profile_json(profile)
        self.skip_nonfinite = bool(skip_nonfinite)
        self._last_skipped = False
        self._max_grad_norm = _validate.check_max_norm(max_grad_norm)
        _validate.check_grad_scaler(grad_scaler, step_in_backward)
        self._grad_scaler = grad_scaler
        self._found_inf: torch.Tensor | None = None  # in-backward skips, for the GradScaler
        self._warned: set[str] = set()
        self._norms: list[tuple[float | None, bool]] = []  # (grad_norm, clipped) per step()
        self._frozen: list[_binding.Slot] = []
        self._slots: list[_binding.Slot] = []
        self._picks: list[list[int] | None] = []  # planned positions of each group
        self._sizes: list[int] = []  # each group's length when planned
        self._pass_open = False
        self._pass_token = 0
        self._backend: Backend | None = None
        self._plan: Plan | None = None
        self._record: ProbeRecord | None = None
        self._recorder = None
        self._setup_times: dict[str, float] = {}  # seconds per set-up phase (emsa._setup)
        super().__init__(params, defaults)
        _distributed.configure(self, process_group, ddp)  # norm group, replicas, refusals
        if probe is not None:
            if isinstance(probe, (str, os.PathLike)):
                probe = ProbeRecord.load(probe)
            if not isinstance(probe, ProbeRecord):
                raise TypeError("probe= takes an emsa.ProbeRecord (from emsa.probe) or a path "
                                f"to one, not {type(probe).__name__}")
            self._bind(probe)
        elif self._in_backward:
            self._bind(None)  # no step() will come to plan at: plan from the shapes now
        else:
            self._recorder = _binding.FirstBackwardRecorder(self._all_params())
        _distributed.attach(self)  # ddp=: the communication hook; ZeRO: its state writes

    # ---- param groups ---------------------------------------------------------------------
    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_backend", None) is not None:
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
            self._recorder = _binding.FirstBackwardRecorder(self._all_params())

    def _check_group(self, g: int) -> None:
        _validate.check_group(self.param_groups[g], g, type(self).__name__, self._all_params())

    # ---- planning -------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The plan (str() it for the table, .json for the data); None until planned: at
        construction with probe=, else at the first step()."""
        return self._plan

    @property
    def probe_record(self) -> ProbeRecord | None:
        """The record the plan was made from (parameters this optimizer does not hold marked
        frozen); None until planned."""
        return self._record

    def _bind(self, record: ProbeRecord | None) -> None:
        with _setup.planning(self):
            self._plan_and_bind(record)

    def _plan_and_bind(self, record: ProbeRecord | None) -> None:
        slots = _binding.slots_of(self.param_groups)
        if not slots:
            raise ValueError("the optimizer holds no parameters that require a gradient"
                             if self._all_params() else "the optimizer holds no parameters")
        frozen = _binding.frozen_of(self.param_groups)
        backend_cls = select(slots[0].param.device)
        if record is None:
            planned = _binding.unprobed_record(slots, self._recorder, frozen)
            for i, s in enumerate(slots):
                s.record_index = i
        else:
            planned = _binding.match(slots, record)
        profile = self._profile
        if profile is None and planned.profile is None and not backend_cls.wants_bandwidths:
            # Bandwidths decide what leaves the device and predict the step: measured when the
            # plan may use the host tier for a reason (a budget, or tier="host").
            may_offload = self._tier == "host" or (self._tier is None
                                                   and self._budget is not None)
            with _setup.profile_phase(self):
                profile = backend_cls.planning_profile(slots[0].param.device, may_offload)
        with _progress.timed("plan", self._setup_times):
            plan = make_plan(planned, profile, optimizer=self._kind,
                             state_dtype=self._state_dtype, budget=self._budget,
                             allow_host_tier=backend_cls.host_tier and self._tier != "device",
                             force_all_host=self._tier == "host",
                             release_grads=self._releases_grads(),
                             device_update_share=_tuning.host_device_share(),
                             gated_steps=self._gated_in_backward())
        plan = _distributed.agreed_plan(self, plan)  # replicas compare layouts: one collective
        shards = _dtensor.Shards(slots)  # DTensor parameters: the engine binds local shards
        backend = backend_cls(shards.engine_slots, plan, self._kind, self._state_dtype,
                              len(self.param_groups), in_backward=self._in_backward)
        for i, s in enumerate(slots):
            self.state[s.param] = _state_io.StateEntries(
                _dtensor.wrap_state(backend.state(i), s.param))
        self._shards = shards
        _dtensor.forward_waits(backend, shards)
        self.__dict__.setdefault("_setup_times", {}).update(getattr(backend, "setup_times", {}))
        backend.setup_times = self._setup_times  # what it measures later (the first step's waits)
        self._host_memory = host_memory(backend)
        self._plan, self._backend, self._record = plan, backend, planned
        self._planned_release = self._releases_grads()
        self._frozen, self._slots = frozen, slots
        self._sizes = [len(g["params"]) for g in self.param_groups]
        held = [[] for _ in self.param_groups]
        for s in slots:
            held[s.group].append(s.index)
        self._picks = [None if len(h) == n else h for h, n in zip(held, self._sizes)]
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None
        if self._in_backward:
            self._install_hooks(slots, backend_cls)

    def _engine_groups(self, unfrozen: bool = False) -> list[dict]:
        """param_groups as the engine planned them (frozen parameters left out), after checking
        that no parameter was added or removed and that no frozen one has a gradient (or,
        with unfrozen=True, requires one: at a pass's first hook, before anything of the pass
        is updated); raises before anything changes."""
        groups = self.param_groups
        if [len(g["params"]) for g in groups] != self._sizes:
            raise ValueError(
                f"the optimizer's parameter groups hold {[len(g['params']) for g in groups]} "
                f"parameters but emsa planned {self._sizes}: parameters added or removed after "
                "planning are not optimized; build a new optimizer over the new parameter set")
        for f in self._frozen:
            p = groups[f.group]["params"][f.index]
            if p is not f.param:
                raise ValueError(f"{f.name} was replaced by another tensor after emsa planned "
                                 "it; build a new optimizer over the new parameter set")
            if p.grad is not None or (unfrozen and p.requires_grad):
                now = "has a gradient" if p.grad is not None else "requires a gradient now"
                raise RuntimeError(
                    f"{f.name} {now}, but it did not require one (requires_grad=False) "
                    "when emsa planned this optimizer, so emsa keeps no state for it and cannot "
                    "update it; nothing was changed. To train it, build a new optimizer after "
                    "unfreezing (load this one's state_dict into it to keep the others' state); "
                    "to keep it frozen, set its .grad to None (or its requires_grad=False "
                    "before backward)")
        return [g if picks is None else {**g, "params": [g["params"][j] for j in picks]}
                for g, picks in zip(groups, self._picks)]

    # ---- options ----------------------------------------------------------------------------
    @property
    def max_grad_norm(self) -> float | None:
        """Clip by the global L2 norm of every gradient this optimizer holds, as
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm), inside the update; None = off.
        Settable; takes effect from the next step (or in-backward pass)."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value) -> None:
        self._max_grad_norm = _validate.check_max_norm(value)
        self._warn_gated_after_plan()

    def _gated_in_backward(self) -> bool:
        """Whether in-backward passes wait for every gradient (clipping, the non-finite check,
        a loss scale): then device-tier gradients are held until backward ends."""
        return self._in_backward and bool(self._max_grad_norm or self.skip_nonfinite
                                          or self._grad_scaler is not None)

    def _releases_grads(self) -> bool:
        """What the plan may assume: gradients freed during backward. A gated pass keeps the
        device tier's until backward ends (only the host tier's leave as their copies land), so
        such a plan counts every gradient held, unless all state is on the host."""
        return self._in_backward and (self._tier == "host" or not self._gated_in_backward())

    def _warn_gated_after_plan(self) -> None:
        backend = getattr(self, "_backend", None)
        if (backend is None or backend.name != "cuda"  # the CPU engine plans no device memory
                or not getattr(self, "_planned_release", False) or self._releases_grads()):
            return
        warnings.warn(
            "emsa: this optimizer planned its device memory assuming gradients are freed during "
            "backward; with clipping, the non-finite check or a loss scale an in-backward pass "
            "holds the device tier's gradients until backward ends, so the peak is higher than "
            "planned. Pass max_grad_norm= / grad_scaler= / skip_nonfinite= at construction to "
            "plan for it (or use tier='host').", RuntimeWarning, stacklevel=3)

    @property
    def grad_scaler(self):
        """step_in_backward: the torch.amp.GradScaler whose scale emsa divides by in backward
        (see the module docstring); settable before the first backward that uses it."""
        return self._grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler) -> None:
        if scaler is not None and not self._in_backward:
            raise ValueError("grad_scaler applies with step_in_backward=True; in step() mode "
                             "scaler.step(opt) hands its scale to emsa by itself")
        self._grad_scaler = scaler
        self._warn_gated_after_plan()

    @property
    def last_grad_norm(self) -> float | None:
        """The total gradient norm (before clipping, unscaled) of the last step that computed
        one (max_grad_norm set), else None. On CUDA reading it waits for that step."""
        return None if self._backend is None else self._backend.last_grad_norm()

    @property
    def clip_count(self) -> int:
        """Steps so far where clipping fired (clip coefficient < 1). On CUDA it waits."""
        return 0 if self._backend is None else self._backend.clip_count()

    def _warn_once(self, key: str, message: str, stacklevel: int = 3) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)

    def _configure(self, backend: Backend, *, loss_scale=None, found_inf_out=None,
                   amp: bool = False) -> None:
        """The gating attributes of the coming step or pass (Backend's docstring)."""
        backend.check_finite = bool(self.skip_nonfinite or amp)
        backend.max_norm = float(self._max_grad_norm or 0.0)
        backend.loss_scale = loss_scale
        backend.found_inf_out = found_inf_out
        backend.norm_group = self._norm_group  # the norm and verdict over these ranks' gradients

    # ---- measurements ---------------------------------------------------------------------
    def synchronize(self) -> None:
        """Waits until every update is applied and visible to the current stream, and makes
        the "step" counts in opt.state exact (on CUDA a skipped step is learned late). Needed
        only before reading host-tier parameters outside a module's forward (model.state_dict(),
        a functional use) or reading opt.state directly: a module's forward waits for its own
        parameters by itself."""
        backend = self._backend
        if backend is not None and backend.deferred:
            backend.sync_state()
            self._warn_skipped(backend.finished_skips(), stacklevel=3)
        elif backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()

    def step_stats(self) -> list[dict]:
        """Measured per step. CUDA: time_s (GPU time from this step's start to the next's),
        d2h_s / cpu_s / h2d_s (host-tier busy times), wait_s (host time a forward waited for
        an upload not yet enqueued), peak_device_bytes (torch.cuda.max_memory_allocated at the
        step's start); waits for the GPU. CPU: time_s (wall clock from one step() to the next)
        and opt_s (step() itself). The last step has no time_s until the next one starts."""
        if self._backend is not None and hasattr(self._backend, "step_stats"):
            for row in self._backend.step_stats():
                self._stats.setdefault(row["step"], {}).update(row)
        for k, (start, end) in enumerate(self._wall):  # the CPU engine: wall clock
            row = self._stats.setdefault(k + 1, {"step": k + 1})
            row["opt_s"] = end - start
            norm, clipped = self._norms[k] if k < len(self._norms) else (None, False)
            if norm is not None:
                row["grad_norm"], row["clipped"] = norm, clipped
            if k + 1 < len(self._wall):
                row["time_s"] = self._wall[k + 1][0] - start
        return [self._stats[k] for k in sorted(self._stats)]

    def report(self, run_dir: str | os.PathLike, losses: list[float] | None = None,
               peer_losses: list[float] | None = None, meta: dict | None = None) -> str:
        """Writes the plan, the probe record, the measured steps (with losses when given) and
        meta into run_dir, then the Markdown report and its plots (emsa.report); returns the
        report's path."""
        from .report import write_run

        if self._plan is None:
            raise ValueError("the optimizer has not planned yet: report after the first step")
        return write_run(run_dir, plan=self._plan, record=self._record,
                         steps=self.step_stats(), losses=losses, peer_losses=peer_losses,
                         meta=meta, setup=_setup.summary(self))

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
        loss = None
        if closure is not None:
            if self._in_backward:
                self._refuse_clipping_after(closure)
            with torch.enable_grad():
                loss = closure()
        amp = "found_inf" in self.__dict__  # set by GradScaler.step, which then calls this
        if self._in_backward:
            if not self.__dict__.get("_trainer_checked"):
                self._refuse_trainer_settings()
            if amp:
                self._amp_step()
            return loss
        if self._backend is None:
            self._bind(None)
        backend = self._backend
        groups = self._engine_groups()
        # GradScaler: grad_scale is its scale (None if scaler.unscale_ already unscaled). Its
        # inf verdict is the one emsa's own check gives on the same gradients, so emsa checks
        # (fused with the norm) rather than reading found_inf on the host.
        scale = self.__dict__.get("grad_scale") if amp else None
        if scale is not None and not isinstance(scale, torch.Tensor):
            scale = torch.tensor(float(scale), dtype=torch.float32)
        self._configure(backend, loss_scale=scale, amp=amp)
        start = time.perf_counter()
        with self._shards.step_groups(groups) as engine_groups:
            result = backend.step(engine_groups)
        self._setup_times.setdefault("first_step", time.perf_counter() - start)
        if not hasattr(backend, "step_stats"):
            self._wall.append((start, time.perf_counter()))
            self._norms.append((result.grad_norm, result.clipped))
        if backend.deferred:
            self._warn_skipped(backend.finished_skips(), stacklevel=3)
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
        backend = self._backend
        if backend is None or not backend.deferred:
            return self._last_skipped
        skipped = backend.last_step_skipped()
        self._warn_skipped(backend.finished_skips(), stacklevel=3)
        return skipped

    def _warn_skipped(self, results, stacklevel: int) -> None:
        for r in results:
            where = f" (first in {r.first_nonfinite})" if r.first_nonfinite else ""
            late = (f" Found after the fact: it was step() call {r.call}; the GPU skips a step "
                    "without making step() wait." if r.call else "")
            warnings.warn(
                f"emsa: step skipped: {r.nonfinite_count} non-finite gradient elements{where}; "
                "parameters, state and step counts are unchanged. skip_nonfinite=False applies "
                f"such steps as torch.optim does.{late}", RuntimeWarning, stacklevel=stacklevel)

    # ---- state_dict -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout; the state tensors are emsa's own (views into its arenas), as
        torch's are its live tensors. On CUDA this waits for the GPU (step counts are read
        back from it)."""
        backend = self._backend
        if backend is not None:
            backend.sync_state()
            self._warn_skipped(backend.finished_skips(), stacklevel=3)
        sd = super().state_dict()
        # Plain dicts, as torch.optim's: torch.load(weights_only=True) reads no emsa class.
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accepts emsa's or torch.optim's state_dict (same layout) and copies it into emsa's
        state, converting dtypes as needed. Everything is checked before anything changes."""
        if self._backend is None:
            self._bind(None)
        slots = self._slots  # as planned: requires_grad may have changed since
        sources = _state_io.check_state_dict(self, state_dict, slots)
        self._backend.check_loadable_steps(
            [float(sources.get(i, {}).get("step", 0)) for i in range(len(slots))])
        self._backend.sync_state()
        self._warn_skipped(self._backend.finished_skips(), stacklevel=3)
        # torch's loader takes the param groups (hyperparameters, hooks); the state is copied
        # here straight from the source, without torch's per-tensor cast copies.
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        _state_io.copy_state(self, slots, sources)

    def __getstate__(self):
        raise TypeError(f"emsa.{type(self).__name__} cannot be pickled or deep-copied (its state "
                        "lives in emsa's arenas); save and load opt.state_dict() instead")


class AdamW(_EmsaOptimizer):
    """AdamW with decoupled weight decay, as torch.optim.AdamW (see the module docstring)."""

    _kind = "adamw"

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None, probe=None,
                 budget: int | str | None = None, state_dtype: torch.dtype = torch.float32,
                 skip_nonfinite: bool | None = None, profile=None,
                 step_in_backward: bool = False, accumulate: int = 1, tier: str | None = None,
                 max_grad_norm: float | None = None, grad_scaler=None, process_group=None,
                 ddp=None):
        _validate.refuse_amsgrad(amsgrad, "AdamW")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize,
                        **_validate.impl_defaults(foreach, capturable, differentiable, fused),
                        decoupled_weight_decay=True)
        super().__init__(params, defaults, probe=probe, budget=budget, state_dtype=state_dtype,
                         skip_nonfinite=skip_nonfinite, profile=profile,
                         step_in_backward=step_in_backward, accumulate=accumulate, tier=tier,
                         max_grad_norm=max_grad_norm, grad_scaler=grad_scaler,
                         process_group=process_group, ddp=ddp)


class Adam(_EmsaOptimizer):
    """Adam with L2 weight decay (added to the gradient), as torch.optim.Adam;
    decoupled_weight_decay=True makes it AdamW, as in torch."""

    _kind = "adam"

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 decoupled_weight_decay: bool = False, probe=None,
                 budget: int | str | None = None, state_dtype: torch.dtype = torch.float32,
                 skip_nonfinite: bool | None = None, profile=None,
                 step_in_backward: bool = False, accumulate: int = 1, tier: str | None = None,
                 max_grad_norm: float | None = None, grad_scaler=None, process_group=None,
                 ddp=None):
        _validate.refuse_amsgrad(amsgrad, "Adam")
        self._kind = "adamw" if decoupled_weight_decay else "adam"
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize,
                        **_validate.impl_defaults(foreach, capturable, differentiable, fused),
                        decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(params, defaults, probe=probe, budget=budget, state_dtype=state_dtype,
                         skip_nonfinite=skip_nonfinite, profile=profile,
                         step_in_backward=step_in_backward, accumulate=accumulate, tier=tier,
                         max_grad_norm=max_grad_norm, grad_scaler=grad_scaler,
                         process_group=process_group, ddp=ddp)

    def _check_group(self, g: int) -> None:
        super()._check_group(g)
        if bool(self.param_groups[g]["decoupled_weight_decay"]) != (self._kind == "adamw"):
            raise ValueError("decoupled_weight_decay must be the same in every param group; "
                             "build one optimizer per kind of weight decay")


class Lion(_EmsaOptimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"):
    c = lerp(m, g, 1-beta1); p *= 1 - lr*wd; p -= lr*sign(c); m = lerp(m, g, 1-beta2).
    State: "step" and "exp_avg" (the momentum m). Use a learning rate 3-10x smaller than
    AdamW's, and a weight decay 3-10x larger."""

    _kind = "lion"

    def __init__(self, params, lr: float | torch.Tensor = 1e-4, betas=(0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, probe=None,
                 budget: int | str | None = None, state_dtype: torch.dtype = torch.float32,
                 skip_nonfinite: bool | None = None, profile=None,
                 step_in_backward: bool = False, accumulate: int = 1, tier: str | None = None,
                 max_grad_norm: float | None = None, grad_scaler=None, process_group=None,
                 ddp=None):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, probe=probe, budget=budget, state_dtype=state_dtype,
                         skip_nonfinite=skip_nonfinite, profile=profile,
                         step_in_backward=step_in_backward, accumulate=accumulate, tier=tier,
                         max_grad_norm=max_grad_norm, grad_scaler=grad_scaler,
                         process_group=process_group, ddp=ddp)
