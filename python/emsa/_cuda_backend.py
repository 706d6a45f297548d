"""The CUDA engine: parameters on the GPU, updated in place by libemsa's fused multi-tensor
kernels on torch's current stream.

Bound once, before the first step, all synchronously:
  - one device arena sized by the plan; exp_avg, exp_avg_sq (and an fp32 master for bf16/fp16
    parameters, initialised from the parameter) are CUDA tensors aliasing it through DLPack, at
    the plan's offsets;
  - one DeviceScalars: every param group's hyperparameters and step count, in device memory;
  - one DeviceUpdateTable per plan bucket (step_in_backward updates bucket by bucket, on the
    current stream as each bucket's gradients become final), and one over every device-tier
    bucket, recording each parameter's address.

A step enqueues on torch.cuda.current_stream() and never waits for the GPU: the hyperparameters
of groups whose values changed (a scheduler's lr), the gradient addresses if any changed (torch
allocates gradients anew after zero_grad(set_to_none=True)), and one emsa_device_step over the
table of all device-tier buckets (non-finite check when skip_nonfinite, step counts, updates):
one launch, not one per bucket.

Skipped steps. With skip_nonfinite the GPU decides: a step whose gradients hold inf/nan writes
nothing and does not advance the device's step counts, and the host is not told at once. After
each checked step a copy of the step header is enqueued into a pinned ring (_RING slots) with an
event; the host reads it once the event has completed: at a later step() when the GPU is done by
then (an event query, no waiting), or when asked: opt.last_step_skipped and state_dict() wait.
The warning for a skipped step is therefore issued late, naming the step() call it was. Until a
skip is read, the "step" counts in opt.state (float32 CPU scalars, as torch.optim keeps them)
include it; state_dict() reads the device's counts back (they are authoritative).

What this engine requires, each checked with an error that says what to do:
  - Every parameter has a gradient at each step, or none has (then step() does nothing, as
    torch does). A table updates every tensor it holds, weight decay and step count included, so
    a parameter without a gradient cannot sit out one step: freeze such parameters
    (requires_grad=False) before building the optimizer, or use torch.optim.
  - Hence every parameter of a param group has the group's step count (DeviceScalars keeps one
    per group): load_state_dict refuses a state whose steps differ within a group.
  - Parameters stay at the addresses they had when planned (the tables record them): copy new
    values in (model.load_state_dict does); replacing the storage (p.data = ..., .to()) raises.

The host tier. State the plan puts on L2 (exp_avg, exp_avg_sq, an fp32 master, staging for the
gradient and, for bf16/fp16 parameters, for the rounded parameter) lives in one pinned host
arena; its buckets run on libemsa's HostTier (emsa._host_tier): gradients down on a D2H stream
when the bucket is submitted, the CPU update on a worker pool, parameters up on an H2D stream,
the next forward waiting per module. Buckets are submitted at step() (after backward, in
gradient-ready order) or, with step_in_backward=True, from the gradient hooks as each bucket
becomes ready, which hides the copies under backward and frees each gradient once its copy has
read it; the copies are then paced to the CPU's progress (HostTierOptions.paced_copies) so the
CPU reads gradients from its cache, holding at most _pacing_hold(plan) bytes of them. A host-tier step cannot be skipped on a non-finite gradient (the decision would need
every gradient before the first bucket's update): the optimizer turns skip_nonfinite off for
such plans (GradScaler still skips, before step() is called), and refuses an explicit True.
The "master" of an fp32 host-tier parameter is internal and not in the state: under AdamW and
Lion the update is applied on the device from a delta the CPU writes over the gradient
(HostTierOptions.device_delta; EMSA_HOST_DELTA=0 turns it off), and the host copy goes unused;
otherwise (Adam) the CPU updates it and it equals the parameter after each step. After step() a
parameter is current on the device once a module forward reading it has run, or after
synchronize().
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import warnings

import torch

from . import _capi, _tuning
from ._backend import DTYPE_NAMES, Backend, StepResult, kernel_grad, state_view
from ._binding import Slot
from ._capi import (DeviceStepHeader, DeviceTableOptions, EmsaError, HostTierTensor, Hyperparams,
                    TensorUpdate, check, lib)
from ._arena import HostArena
from ._device_arena import DeviceArena
from ._host_tier import HostTier
from .plan import Plan, measure_profile

_RING = 8  # checked steps whose headers may be in flight before step() waits for the oldest
_HEADER = ctypes.sizeof(DeviceStepHeader)
_FOUND_INF = DeviceStepHeader.found_inf.offset // 4  # as an int32 index
_NONFINITE = DeviceStepHeader.nonfinite_count.offset // 8  # as an int64 index


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _on(index: int):
    """torch's and libemsa's current device set to `index` (emsa checks it on every call)."""
    if torch.cuda.current_device() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(index)


class CudaBackend(Backend):
    name = "cuda"
    wants_bandwidths = False
    host_tier = True
    deferred = True

    @staticmethod
    def planning_profile(device: torch.device, measure_bandwidth: bool = False) -> str:
        # Measured now, not cached: the default budget is the device's free memory. Bandwidths
        # (about a second) only when the plan may use the host tier: they decide what leaves
        # the device and predict the step.
        return json.dumps(measure_profile(measure_bandwidth=measure_bandwidth,
                                          gpu_device=_index(device)))

    def __init__(self, slots: list[Slot], plan: Plan, optimizer: str,
                 state_dtype: torch.dtype, group_count: int, in_backward: bool = False):
        self.closed = True  # until everything below exists
        self.in_backward = in_backward  # buckets come from the gradient hooks
        self.slots = slots
        self.params = [s.param for s in slots]
        self.names = [s.name for s in slots]
        self.groups = [s.group for s in slots]
        self.counts = [0] * group_count
        for s in slots:
            self.counts[s.group] += 1
        self.shapes = [s.param.shape for s in slots]
        self.strides = [s.param.stride() for s in slots]
        self.ptrs = [s.param.data_ptr() for s in slots]
        self.kind = optimizer
        self.index = _index(slots[0].param.device)
        self.device = torch.device("cuda", self.index)
        entries = [plan.json["params"][s.record_index] for s in slots]
        self.on_host = [pp["tier"] == "L2" for pp in entries]
        # Step counts as torch keeps them (float32 CPU scalars), one storage for all: "step" in
        # state is a 0-d view of it.
        self.steps = torch.zeros(len(slots), dtype=torch.float32)
        self.tables: list[ctypes.c_void_p] = []
        self.scalars = ctypes.c_void_p()
        self.arena: DeviceArena | None = None
        self.host_arena: HostArena | None = None
        self.host: HostTier | None = None
        self.step_times = _StepClock()
        self.warned_unwaited = False
        try:
            with _on(self.index):
                if plan.device_arena_bytes:
                    self.arena = DeviceArena(plan.device_arena_bytes, self.index)
                if plan.host_arena_bytes:
                    self.host_arena = HostArena(plan.host_arena_bytes, pinned=True)
                    if not self.host_arena.pinned:
                        raise RuntimeError(
                            "emsa could not pin the host arena, and "
                            "the host tier copies only from pinned memory; free host memory, "
                            "or raise the budget so less state goes to the host")
                state_code = _capi.DTYPE[DTYPE_NAMES[state_dtype]]
                self.hidden: list[dict] = [{} for _ in slots]  # host-tier staging and masters
                self.views = [self._bind_views(i, s, pp, state_dtype)
                              for i, (s, pp) in enumerate(zip(slots, entries))]
                self.masters = [i for i in range(len(slots)) if self._master(i) is not None]
                self.versions = [p._version for p in self.params]
                self._make_scalars(group_count)
                self._make_tables(slots, plan, state_code)
                self._make_host_tier(slots, plan, entries, state_code, group_count)
                stream = torch.cuda.current_stream(self.device)
                check(lib.emsa_device_scalars_set_inputs(self.scalars, 1.0, 0.0, 0,
                                                         stream.cuda_stream))
                self.last_stream = stream  # the masters were copied on it
                self.ring = torch.zeros((_RING, _HEADER), dtype=torch.uint8, pin_memory=True)
                self.ring_events = [torch.cuda.Event() for _ in range(_RING)]
        except BaseException:
            self._release()
            raise
        self.ring_found = self.ring.view(torch.int32)[:, _FOUND_INF]
        self.ring_nonfinite = self.ring.view(torch.int64)[:, _NONFINITE]
        self.pending: collections.deque[tuple[int, int]] = collections.deque()  # (slot, call)
        self.recorded = 0  # step headers copied so far; the ring slot is recorded % _RING
        self.group_steps = [0] * group_count
        self.calls = 0  # step() calls that enqueued an update
        self.noop_last = False  # the last step() had no gradients at all
        self.last_skipped_call = 0
        self.skips: list[StepResult] = []
        self.closed = False

    # ---- binding ------------------------------------------------------------------------
    def _bind_views(self, i: int, s: Slot, pp: dict, state_dtype) -> dict:
        p = s.param
        arena = self.host_arena if self.on_host[i] else self.arena
        views = {"step": self.steps[i],  # torch.optim's key order: step first
                 "exp_avg": state_view(arena, pp["exp_avg_offset"], p, state_dtype)}
        if self.kind != "lion":
            views["exp_avg_sq"] = state_view(arena, pp["exp_avg_sq_offset"], p, state_dtype)
        if p.dtype != torch.float32 or self.on_host[i]:
            master = state_view(arena, pp["master_offset"], p, torch.float32)
            with torch.no_grad():
                master.copy_(p)
            if p.dtype != torch.float32:
                views["master"] = master
            else:
                self.hidden[i]["master"] = master
        if self.on_host[i]:
            self.hidden[i]["grad"] = state_view(arena, pp["grad_offset"], p, p.dtype)
            if p.dtype != torch.float32:
                self.hidden[i]["param_out"] = state_view(arena, pp["param_out_offset"], p, p.dtype)
        return views

    def _master(self, i: int) -> torch.Tensor | None:
        return self.views[i].get("master", self.hidden[i].get("master"))

    def refresh_master(self, i: int) -> None:
        p = self.params[i]
        with torch.no_grad():
            self._master(i).copy_(p)  # to pinned host memory: synchronous
        self.versions[i] = p._version

    def _make_scalars(self, group_count: int) -> None:
        hypers = (Hyperparams * group_count)()
        for h in hypers:
            lib.emsa_hyperparams_init(ctypes.byref(h))
        check(lib.emsa_device_scalars_create(hypers, group_count, ctypes.byref(self.scalars)))
        self.hyper = hypers  # each group's values as the device holds them
        self.sent = [self._key_of(h) for h in hypers]
        self.scratch = Hyperparams()
        lib.emsa_hyperparams_init(ctypes.byref(self.scratch))

    @staticmethod
    def _key_of(h: Hyperparams) -> tuple:
        return (h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, bool(h.maximize))

    def _make_tables(self, slots, plan: Plan, state_code: int) -> None:
        """One table per plan bucket. Gradients may not exist yet: each tensor's gradient
        starts as its parameter's address (valid memory of the right size and dtype), and every
        step sets the real ones first."""
        slot_of = {s.record_index: i for i, s in enumerate(slots)}
        options = DeviceTableOptions()
        lib.emsa_device_table_options_init(ctypes.byref(options))
        options.optimizer = _capi.OPTIMIZER[self.kind]
        options.bulk_copy = int(_tuning.cuda_bulk_copy())
        self.table_slots: list[list[int]] = []  # device-tier buckets
        self.host_slots: list[list[int]] = []  # host-tier buckets
        self.host_on_gpu: list[bool] = []  # per host-tier bucket: the GPU updates it
        self.order: list[tuple[bool, int]] = []  # every bucket in plan order: (host?, index)
        for bucket in plan.json["buckets"]:
            members = [slot_of[r] for r in bucket["params"] if r in slot_of]
            if not members:
                continue
            host = bucket["tier"] == "L2"
            if any(self.on_host[i] != host for i in members):
                raise RuntimeError("emsa internal error: a plan bucket mixes tiers; please "
                                   "report it")
            into = self.host_slots if host else self.table_slots
            self.order.append((host, len(into)))
            into.append(members)
            if host:
                self.host_on_gpu.append(bool(bucket.get("device_update", False)))
        covered = sorted(i for m in self.table_slots + self.host_slots for i in m)
        if covered != list(range(len(slots))):
            missing = sorted(set(range(len(slots))) - set(covered))
            names = [self.names[i] for i in missing]
            raise RuntimeError("emsa internal error: the plan's buckets do not hold every "
                               f"parameter exactly once (missing: {names}); please report it")
        # The per-bucket tables serve step_in_backward, on the current stream between
        # backward's kernels.
        for members in self.table_slots:
            self.tables.append(self._make_table(members, options, state_code))
        # step() updates every device-tier bucket at once: one table over all of them, one
        # launch (and one gradient-pointer update) instead of one per bucket, which is faster.
        self.step_members = [i for m in self.table_slots for i in m]
        members_of = list(self.table_slots)  # each table's slots
        if len(self.table_slots) > 1:
            members_of.append(self.step_members)
            self.tables.append(self._make_table(self.step_members, options, state_code))
        self.step_table = len(self.tables) - 1  # index of the table step() runs (-1: none)
        self.step_array = (ctypes.c_void_p * 1)(
            self.tables[self.step_table].value if self.tables else None)
        self.grad_arrays = [(ctypes.c_void_p * len(m))() for m in members_of]
        self.sent_grads: list[list[int] | None] = [None] * len(self.tables)

    def _make_table(self, members: list[int], options, state_code: int) -> ctypes.c_void_p:
        tensors = (TensorUpdate * len(members))()
        groups = (ctypes.c_int32 * len(members))()
        for k, i in enumerate(members):
            t, p, v = tensors[k], self.params[i], self.views[i]
            lib.emsa_tensor_update_init(ctypes.byref(t))
            t.param_dtype = t.grad_dtype = _capi.DTYPE[DTYPE_NAMES[p.dtype]]
            t.state_dtype = state_code
            t.param = t.grad = p.data_ptr()
            t.exp_avg = v["exp_avg"].data_ptr()
            t.exp_avg_sq = v["exp_avg_sq"].data_ptr() if "exp_avg_sq" in v else None
            t.master = v["master"].data_ptr() if "master" in v else None
            t.numel = p.numel()
            groups[k] = self.groups[i]
        table = ctypes.c_void_p()
        check(lib.emsa_device_table_create(tensors, groups, len(members),
                                           ctypes.byref(options), ctypes.byref(table)))
        return table

    def _make_host_tier(self, slots, plan: Plan, entries, state_code: int,
                        group_count: int) -> None:
        if not self.host_slots:
            return
        tensors, params = [], []
        for b, members in enumerate(self.host_slots):
            for i in members:
                p, v, h = self.params[i], self.views[i], self.hidden[i]
                t = HostTierTensor()
                lib.emsa_host_tier_tensor_init(ctypes.byref(t))
                u = t.update
                u.param_dtype = u.grad_dtype = _capi.DTYPE[DTYPE_NAMES[p.dtype]]
                u.state_dtype = state_code
                if p.dtype == torch.float32:  # the master is the parameter the CPU updates
                    u.param = h["master"].data_ptr()
                else:
                    u.param = h["param_out"].data_ptr()
                    u.master = v["master"].data_ptr()
                u.grad = h["grad"].data_ptr()
                u.exp_avg = v["exp_avg"].data_ptr()
                u.exp_avg_sq = v["exp_avg_sq"].data_ptr() if "exp_avg_sq" in v else None
                u.numel = p.numel()
                t.group = self.groups[i]
                t.bucket = b
                t.device_param = p.data_ptr()
                t.device_update = int(self.host_on_gpu[b])
                tensors.append(t)
                params.append(p)
        self.host = HostTier(tensors, self.host_slots, group_count, self.kind, self.device,
                             params, in_backward=self.in_backward,
                             hold_bytes=_pacing_hold(plan))

    def state(self, i: int) -> dict[str, torch.Tensor]:
        return self.views[i]

    # ---- the step -------------------------------------------------------------------------
    def _moved(self, i: int, p: torch.Tensor) -> None:
        name = self.names[i]
        if p.shape != self.shapes[i]:
            raise ValueError(
                f"parameter {name} changed from {tuple(self.shapes[i])} to {tuple(p.shape)} "
                "after emsa planned it; emsa lays optimizer state out once: build a new "
                "optimizer over the changed model")
        self._check_layout(i, p)
        if p.data_ptr() == self.ptrs[i]:
            return  # only strides of size-1 dimensions changed: nothing to re-lay
        raise ValueError(
            f"parameter {name} no longer lives where emsa planned it (its storage was replaced: "
            "p.data = ..., or the model moved); emsa's CUDA tables record parameter addresses: "
            "copy new values into the parameter instead (model.load_state_dict copies), or "
            "build a new optimizer after replacing it")

    def _gradients(self, param_groups: list[dict]):
        """Each slot's gradient (as the kernels read it), or None when no parameter has a
        gradient; raises before anything is enqueued."""
        expected = self.params
        grads, missing = [], []
        for i, p in self._planned_params(param_groups, self._moved):
            g = p.grad
            if g is None:
                missing.append(i)
            else:
                g = kernel_grad(self.names[i], g, p, self.strides[i])
            grads.append(g)
        if missing:
            if len(missing) == len(expected):
                return None
            have = next(j for j in range(len(expected)) if j not in set(missing))
            raise ValueError(
                f"{self.names[missing[0]]} has no gradient (.grad is None) but "
                f"{self.names[have]} has one; emsa's CUDA path updates every parameter each "
                f"step ({len(missing)} of {len(expected)} have none now), so it cannot skip "
                "some as torch does: give the optimizer only parameters that get gradients "
                "(e.g. [p for p in model.parameters() if p.requires_grad], after freezing the "
                "others), or use torch.optim")
        return grads

    def _send_hyper(self, param_groups: list[dict], stream: int) -> None:
        for g, group in enumerate(param_groups):
            beta1, beta2 = group["betas"]
            key = (float(group["lr"]), float(beta1), float(beta2),
                   float(group.get("eps", self.sent[g][3])), float(group["weight_decay"]),
                   bool(group["maximize"]))
            if key == self.sent[g]:
                continue
            h = self.scratch
            h.lr, h.beta1, h.beta2, h.eps, h.weight_decay = key[:5]
            h.maximize = int(key[5])
            try:
                check(lib.emsa_device_scalars_set_hyper(self.scalars, g, ctypes.byref(h), stream))
            except EmsaError as e:
                raise ValueError(f"param_groups[{g}]: {e}") from None
            ctypes.memmove(ctypes.byref(self.hyper[g]), ctypes.byref(h), ctypes.sizeof(h))
            self.sent[g] = key

    def _send_grads(self, grads: list[torch.Tensor], stream: int) -> None:
        """The gradients of step()'s table, when they moved since the last step."""
        if self.step_table >= 0:
            self._point_table(self.step_table, [grads[i].data_ptr() for i in self.step_members],
                              stream)

    def _point_table(self, t: int, ptrs: list[int], stream: int) -> None:
        """Table t reads these gradient addresses from now on (nothing enqueued if unchanged)."""
        if ptrs == self.sent_grads[t]:
            return
        array = self.grad_arrays[t]
        array[:] = ptrs
        check(lib.emsa_device_table_set_grads(self.tables[t], array, len(ptrs), stream))
        self.sent_grads[t] = ptrs

    def step(self, param_groups: list[dict]) -> StepResult:
        self._check_groups(param_groups)
        with _on(self.index):
            self._poll(wait=False)
            grads = self._gradients(param_groups)
            if grads is None:
                self.noop_last = True
                return StepResult()
            if self.host is not None and self.check_finite:
                raise RuntimeError("emsa internal error: a non-finite check was asked of a "
                                   "plan with host-tier state; please report it")
            stream = torch.cuda.current_stream(self.device)
            self._follow(stream)
            self.step_times.tick(stream)
            handle = stream.cuda_stream
            self._send_hyper(param_groups, handle)
            self._send_grads(grads, handle)
            if self.host is not None:
                self._claim_unwaited(stream)
                self.host.begin_step(self.hyper, [s + 1 for s in self.group_steps])
            self._refresh_stale_masters(self.masters)
            check(lib.emsa_device_step(self.scalars, self.step_array, int(self.step_table >= 0),
                                       int(self.check_finite), handle))
            if self.host is not None:
                # In forward order: the copies land, and the CPU updates, first what the
                # next forward needs first.
                for b in reversed(range(len(self.host_slots))):
                    self.host.submit(b, [grads[i] for i in self.host_slots[b]], stream)
                # The caller may write gradients in place next (zero_grad(set_to_none=False)).
                self.host.wait_grads_copied(stream)
            del grads  # freed in stream order: the caching allocator reuses them after use
            self.calls += 1
            self.noop_last = False
            self.last_stream = stream
            self.steps.add_(1.0)  # corrected when the step turns out skipped
            self.group_steps = [s + 1 for s in self.group_steps]
            if self.check_finite:
                self._record(stream)
        return StepResult()

    def _follow(self, stream: torch.cuda.Stream) -> None:
        """Orders `stream` after the last step's stream: both write the same state."""
        if stream.cuda_stream != self.last_stream.cuda_stream:
            stream.wait_stream(self.last_stream)

    # ---- skipped steps, learned late ------------------------------------------------------
    def _record(self, stream: torch.cuda.Stream) -> None:
        while len(self.pending) >= _RING:
            self._read_oldest(wait=True)
        slot = self.recorded % _RING  # consecutive records take consecutive slots: FIFO holds
        self.recorded += 1
        dst = self.ring.data_ptr() + slot * _HEADER
        check(lib.emsa_device_scalars_copy_header(self.scalars, dst, stream.cuda_stream))
        self.ring_events[slot].record(stream)
        self.pending.append((slot, self.calls))

    def _read_oldest(self, wait: bool, count_steps: bool = True) -> bool:
        slot, call = self.pending[0]
        event = self.ring_events[slot]
        if not wait and not event.query():
            return False
        event.synchronize()
        self.pending.popleft()
        if int(self.ring_found[slot]) != 0:
            self.skips.append(StepResult(True, int(self.ring_nonfinite[slot]), "", call))
            self.last_skipped_call = call
            if count_steps:  # the host counted it when it was enqueued
                self.steps.sub_(1.0)
                self.group_steps = [s - 1 for s in self.group_steps]
        return True

    def _poll(self, wait: bool, count_steps: bool = True) -> None:
        while self.pending and self._read_oldest(wait, count_steps):
            pass

    def finished_skips(self) -> list[StepResult]:
        found, self.skips = self.skips, []
        return found

    def last_step_skipped(self) -> bool:
        if self.calls == 0 or self.noop_last:
            return False
        with _on(self.index):
            self._poll(wait=True)
        return self.last_skipped_call == self.calls

    # ---- state_dict -----------------------------------------------------------------------
    def sync_state(self) -> None:
        """Reads the device's step counts (waits for the GPU) into the "step" scalars."""
        if self.closed:
            return
        with _on(self.index):
            self._poll(wait=True)
            self.synchronize()
            stream = torch.cuda.current_stream(self.device)
            self._follow(stream)
            steps = (ctypes.c_int64 * len(self.group_steps))()
            check(lib.emsa_device_scalars_read_steps(self.scalars, steps, len(self.group_steps),
                                                     stream.cuda_stream))
        self.group_steps = list(steps)
        self.steps.copy_(torch.tensor([float(self.group_steps[g]) for g in self.groups],
                                      dtype=torch.float32))

    def check_loadable_steps(self, steps: list[float]) -> None:
        first: dict[int, int] = {}
        for i, step in enumerate(steps):
            g = self.groups[i]
            j = first.setdefault(g, i)
            if step != steps[j]:
                raise ValueError(
                    f"the state_dict has step {steps[j]:g} for {self.names[j]} but {step:g} for "
                    f"{self.names[i]}, both in param_groups[{g}]; emsa's CUDA path keeps one step "
                    "count per param group (every parameter steps together), so it cannot load "
                    "different counts within a group. A torch.optim state where some parameters "
                    "missed steps (no gradient) can be continued with torch.optim")

    def state_loaded(self) -> None:
        """The optimizer wrote the views (steps included): the device's counts follow."""
        with _on(self.index):
            self._poll(wait=True, count_steps=False)  # older skips: superseded by the load
            self.synchronize()
            for i in range(len(self.params)):  # an fp32 host master follows its parameter
                if "master" in self.hidden[i]:
                    self.refresh_master(i)
            stream = torch.cuda.current_stream(self.device)
            self._follow(stream)
            values = self.steps.tolist()
            for g in range(len(self.group_steps)):
                members = [i for i, grp in enumerate(self.groups) if grp == g]
                if not members:
                    continue
                step = int(values[members[0]])
                check(lib.emsa_device_scalars_set_group(self.scalars, g,
                                                        ctypes.byref(self.hyper[g]), step,
                                                        stream.cuda_stream))
                self.group_steps[g] = step
            self.last_stream = stream
        self.versions = [p._version for p in self.params]

    # ---- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:  # nothing enqueued may still use the tables when they are freed
            if self.host is not None:
                self.host.synchronize()
            self.last_stream.synchronize()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
            pass
        self._release()

    def synchronize(self) -> None:
        """Every host-tier update done and its parameters on the device, seen by the current
        stream (for reads outside a module's forward: model.state_dict(), functional use)."""
        with _on(self.index):
            if self.host is not None:
                self.host.synchronize()

    def step_stats(self) -> list[dict]:
        """Per step since the last call, measured: time_s (from this step's start to the
        next's, on the GPU; absent for the last step), d2h_s, cpu_s, h2d_s, wait_s (host-tier
        busy times), grad_wait_s and worker_s (the host tier's worker: blocked on gradients, and
        in all), stream_up_s (the GPU-updated buckets' moments up, summed), peak_device_bytes
        (torch.cuda.max_memory_allocated when the step started)."""
        self.synchronize()
        host = {s["step"]: s for s in self.host.stats()} if self.host is not None else {}
        out = []
        for n, (step, time_s, peak) in enumerate(self.step_times.read()):
            row = {"step": step, "peak_device_bytes": peak}
            if time_s is not None:
                row["time_s"] = time_s
            h = host.get(step)
            if h is not None:
                row.update({k: h[k] for k in ("d2h_s", "cpu_s", "h2d_s", "wait_s",
                                              "grad_wait_s", "worker_s", "stream_up_s")})
            out.append(row)
        return out

    def _release(self) -> None:
        if self.host is not None:
            self.host.close()
            self.host = None
        for table in self.tables:
            lib.emsa_device_table_destroy(table)
        self.tables = []
        scalars, self.scalars = self.scalars, ctypes.c_void_p()
        if scalars:
            lib.emsa_device_scalars_destroy(scalars)
        if self.arena is not None:
            self.arena.close()  # the state views keep the memory while torch holds them

    def __del__(self):
        if not getattr(self, "closed", True) and lib is not None:
            self.close()

    # ---- step in backward: one table per call, when its gradients are all final ----------
    # The step is begun and the group step counts advanced once per pass (emsa_device_step
    # over no tables); each table is then updated alone (emsa_device_table_update), so the
    # counts advance once per pass, not once per bucket.
    steps_in_backward = True

    def bucket_slots(self) -> list[list[int]]:
        frozen = [self.names[i] for i, p in enumerate(self.params) if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"{frozen[0]} does not require a gradient; emsa's CUDA tables update every "
                "parameter they hold, so with step_in_backward=True give the optimizer only "
                "trainable parameters ([p for p in model.parameters() if p.requires_grad])")
        return [(self.host_slots if host else self.table_slots)[k] for host, k in self.order]

    def begin_pass(self, param_groups: list[dict]) -> None:
        self._check_groups(param_groups)
        with _on(self.index):
            stream = torch.cuda.current_stream(self.device)
            self._follow(stream)
            handle = stream.cuda_stream
            self.step_times.tick(stream)
            self._send_hyper(param_groups, handle)
            if self.host is not None:
                self._claim_unwaited(stream)
                self.host.begin_step(self.hyper, [s + 1 for s in self.group_steps])
            check(lib.emsa_device_step(self.scalars, self.step_array, 0, 0, handle))
            self.calls += 1
            self.noop_last = False
            self.last_stream = stream
            self.steps.add_(1.0)
            self.group_steps = [s + 1 for s in self.group_steps]

    def step_bucket(self, b: int) -> None:
        host, t = self.order[b]
        if host:
            self._step_host_bucket(t)
            return
        members = self.table_slots[t]
        grads = self._bucket_grads(members)
        with _on(self.index):
            stream = torch.cuda.current_stream(self.device)
            self._follow(stream)
            handle = stream.cuda_stream
            self._point_table(t, [g.data_ptr() for g in grads], handle)
            self._refresh_stale_masters(members)
            check(lib.emsa_device_table_update(self.tables[t], self.scalars, handle))
            self.last_stream = stream
        del grads  # copies made for the kernels are freed in stream order, after the update

    def _bucket_grads(self, members: list[int]) -> list[torch.Tensor]:
        """Step in backward: the bucket's gradients as the kernels read them (all final: the
        hooks fired), after checking each parameter is where emsa planned it."""
        grads = []
        for i in members:
            p = self.params[i]
            if (p.data_ptr() != self.ptrs[i] or p.shape != self.shapes[i]
                    or p.stride() != self.strides[i]):
                self._moved(i, p)
            if p.grad is None:
                raise RuntimeError(f"emsa internal error: {self.names[i]} has no gradient in "
                                   "its hook; please report it")
            grads.append(kernel_grad(self.names[i], p.grad, p, self.strides[i]))
        return grads

    def _refresh_stale_masters(self, slots) -> None:
        """Masters of parameters someone else wrote since (emsa's own writes leave _version)."""
        for j in slots:
            if self.params[j]._version != self.versions[j] and self._master(j) is not None:
                self.refresh_master(j)

    def _claim_unwaited(self, stream: torch.cuda.Stream) -> None:
        """Before a new step: every upload of the last one should have been waited for by a
        module forward reading it. One that was not means its parameters were read outside
        their own module's forward (a functional use, compiled code that skips module hooks),
        possibly before the update landed: warn once, then wait, so nothing later races."""
        missed = sorted(self.host.pending)
        if not missed:
            return
        if not self.warned_unwaited:
            self.warned_unwaited = True
            names = [self.names[i] for b in missed for i in self.host_slots[b]]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4
                                            else "")
            warnings.warn(
                f"emsa: the host-tier parameters {shown} were updated at the last step but no "
                "module forward waited for them before this one: they are read outside their "
                "own module's forward (a functional use, or code that skips module hooks), "
                "and such a read may have seen the values from before the update. Call "
                "opt.synchronize() before reading them there. emsa waits for them now.",
                RuntimeWarning, stacklevel=4)
        self.host.wait_all(stream)

    def _step_host_bucket(self, t: int) -> None:
        members = self.host_slots[t]
        grads = self._bucket_grads(members)
        self._refresh_stale_masters(members)  # the tier is idle: begin_step waited for it
        with _on(self.index):
            stream = torch.cuda.current_stream(self.device)
            self._follow(stream)
            self.host.submit(t, grads, stream)
            self.last_stream = stream


def _pacing_hold(plan: Plan) -> int:
    """How many bytes of gradients paced copies may keep waiting on the device: the plan counts
    about two buckets in flight; with no budget named, also what the device has beyond the plan's
    predicted peak. A named budget gets nothing beyond the plan's own count."""
    options = plan.json["options"]
    in_flight = 2 * int(options["bucket_bytes"])
    if options["budget_bytes"]:
        return in_flight
    peak = int(plan.json["prediction"]["peak_device_bytes"])
    return max(0, int(plan.json["budget_bytes"]) - peak) + in_flight


class _StepClock:
    """GPU time from each step's start to the next's: an event per step, read once complete.
    Events come from a small pool and are reused, so steps allocate none once it is warm."""

    def __init__(self):
        self.free: list[torch.cuda.Event] = []
        self.pending: collections.deque = collections.deque()  # (step, event, peak bytes)
        self.done: list[tuple[int, float | None, int]] = []
        self.count = 0

    def tick(self, stream: torch.cuda.Stream) -> None:
        event = self.free.pop() if self.free else torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self.count += 1
        self.pending.append((self.count, event, torch.cuda.max_memory_allocated(stream.device)))
        self._collect(wait=False)

    def _collect(self, wait: bool) -> None:
        # A step's time is known once the next step's start event has completed.
        while len(self.pending) >= 2:
            (step, start, peak), (_, end, _) = self.pending[0], self.pending[1]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self.done.append((step, start.elapsed_time(end) * 1e-3, peak))
            self.pending.popleft()
            self.free.append(start)

    def read(self) -> list[tuple[int, float | None, int]]:
        self._collect(wait=True)
        out, self.done = self.done, []
        if self.pending:
            step, _, peak = self.pending[-1]
            out.append((step, None, peak))
        return out
