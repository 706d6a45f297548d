"""The CUDA engine: parameters on the GPU, updated in place by libemsa's fused multi-tensor
kernels on torch's current stream.

Bound once, before the first step, all synchronously (views and masters: emsa._cuda_bind):
  - one device arena sized by the plan; exp_avg, exp_avg_sq (and an fp32 master for bf16/fp16
    parameters, initialised from the parameter) are CUDA tensors aliasing it through DLPack, at
    the plan's offsets;
  - one DeviceScalars: every param group's hyperparameters, a step count per parameter (slot)
    and the step header (gradient multiplier, found_inf, gradient statistics), in device memory;
  - one DeviceUpdateTable per device-tier plan bucket (step_in_backward updates bucket by
    bucket, on the current stream as each bucket's gradients become final), one over every
    device-tier bucket (what step() runs: one launch), and one statistics-only table per
    host-tier bucket (its gradients' sum of squares and non-finite count), each recording each
    parameter's address.

A step enqueues on torch.cuda.current_stream() and never waits for the GPU: the hyperparameters
of groups whose values changed (a scheduler's lr), the gradient addresses if any changed (torch
allocates gradients anew after zero_grad(set_to_none=True)), and the update.

Absent gradients. A parameter whose .grad is None at step() (or that got no gradient in an
in-backward pass) is skipped as torch.optim skips it: its table entry gets a NULL gradient, so
it is not updated, its state is untouched and its own step count stays (the device keeps one
count per parameter). Frozen parameters never reach this engine (the front end plans only
trainable ones).

Gated steps. A step is gated when it needs a verdict that only every gradient of the step can
give: the non-finite check (skip_nonfinite), clipping by the global norm (max_norm) or a loss
scale to divide by (a GradScaler). Its updates then wait for the statistics (sum of squares and
non-finite count of every gradient) and the finish that turns them into found_inf, the norm and
the clip coefficient on the device; ungated steps run without statistics. The statistics come
in one pass:
  - step() mode: the statistics of every gradient are summed on the GPU at step() (one launch
    with the device tier's update when there is no host tier), then one launch updates every
    device-tier bucket. Summing them per bucket in backward instead was measured slower
    (docs/decisions.md).
  - step_in_backward: device-tier buckets add their sums as their gradients become final and
    keep their gradients (step_bucket returns False); host-tier buckets add theirs and are
    submitted at once (their copies down are enqueued whole). When backward ends (end_pass) the
    device finishes the statistics, updates every device-tier bucket in one launch and hands
    the host tier its verdict. The device-tier gradients are therefore held until backward ends
    in such a pass (freed once step_in_backward's end_pass has updated from them).
With a norm group (process_group=) the sums are all-reduced over its ranks on the same stream
before the finish (emsa._distributed), so every rank clips and skips alike.
A loss scale (a 0-d float32 on the device: GradScaler's scale) is read on the device, never on
the host; found_inf_out (a float32 on the device) is set to 1.0 when the step is skipped, else
left as it was.

Skipped steps and norms are learned late (emsa._cuda_stats.HeaderRing): the GPU skips a step
whose gradients hold inf/nan without telling the host at once. The warning for a skipped step is
therefore issued late, naming the step() call it was; last_step_skipped, last_grad_norm,
clip_count and state_dict() wait for the GPU. Until a skip is read, the "step" counts in
opt.state (float32 CPU scalars, as torch.optim keeps them) include it; state_dict() reads the
device's counts back (they are authoritative).

Parameters stay at the addresses they had when planned (the tables record them): copy new values
in (model.load_state_dict does); replacing the storage (p.data = ..., .to()) raises.

The host tier. State the plan puts on L2 (exp_avg, exp_avg_sq, an fp32 master, staging for the
gradient and, for bf16/fp16 parameters, for the rounded parameter) lives in one host arena, whose
prefix of everything a copy touches is pinned and whose rest (what only the CPU touches) is
pageable, populated in the background before a bucket's first update reads it; its buckets run on libemsa's HostTier (emsa._host_tier): gradients down on a D2H stream
when the bucket is submitted, the CPU update on a worker pool, parameters up on an H2D stream,
the next forward waiting per module. Buckets are submitted at step() (after backward, in
gradient-ready order) or, with step_in_backward=True, from the gradient hooks as each bucket
becomes ready, which hides the copies under backward and frees each gradient once its copy has
read it; ungated, the copies are then paced to the CPU's progress (HostTierOptions.paced_copies)
so the CPU reads gradients from its cache, holding at most _pacing_hold(plan) bytes of them. In a
gated step the tier's updates wait for its release, given after the device finished the
statistics. The "master" of an fp32 host-tier parameter is internal and not in the state: under
AdamW and Lion the update is applied on the device from a delta the CPU writes over the gradient
(HostTierOptions.device_delta; EMSA_HOST_DELTA=0 turns it off), and the host copy goes unused;
otherwise (Adam) the CPU updates it and it equals the parameter after each step. After step() a
parameter is current on the device once a module forward reading it has run, or after
synchronize().
"""

from __future__ import annotations

import ctypes
import json
import time
import warnings

import torch

from . import _capi, _tuning
from ._backend import DTYPE_NAMES, Backend, StepResult, kernel_grad
from ._binding import Slot
from ._capi import DeviceTableOptions, EmsaError, Hyperparams, TensorUpdate, check, lib
from ._arena import HostArena, check_fits, pinned_arena
from ._cuda_bind import Binding
from ._cuda_passes import InBackward, Pass, on, ptr
from ._cuda_stats import HeaderRing, StepClock, counted_mask
from ._device_arena import DeviceArena
from ._distributed import reduce_device_stats
from ._host_tier import HostTier
from .plan import Plan, measure_profile


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class CudaBackend(InBackward, Binding, Backend):
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
        self.setup_times: dict[str, float] = {}  # opt._setup_times' phases measured here
        self.host: HostTier | None = None
        self.step_times = StepClock()
        self.warned_unwaited = False
        try:
            with on(self.index):
                if plan.host_arena_bytes:  # a host too small fails before any allocation
                    check_fits(plan.host_arena_bytes, pinned=True)
                if plan.device_arena_bytes:
                    device_start = time.perf_counter()
                    self.arena = DeviceArena(plan.device_arena_bytes, self.index)
                    self.setup_times["device_arena"] = time.perf_counter() - device_start
                if plan.host_arena_bytes:  # locked: the prefix every copy touches
                    self.host_arena = pinned_arena(
                        plan.host_arena_bytes, self.setup_times,
                        locked_bytes=plan.json["prediction"]["host_locked_bytes"])
                state_code = _capi.DTYPE[DTYPE_NAMES[state_dtype]]
                bind_start = time.perf_counter()
                self._bind_state(slots, entries, state_dtype)  # emsa._cuda_bind
                self.versions = [p._version for p in self.params]
                tables_start = time.perf_counter()
                self._make_scalars(group_count)
                self._make_tables(slots, plan, state_code)
                self.setup_times["bind.tables"] = time.perf_counter() - tables_start
                self._make_host_tier(group_count, _pacing_hold(plan))
                self.setup_times["bind"] = time.perf_counter() - bind_start
                stream = torch.cuda.current_stream(self.device)
                check(lib.emsa_device_scalars_set_inputs(self.scalars, 1.0, 0.0, 0,
                                                         stream.cuda_stream))
                self.inputs: tuple[float, float] | None = (1.0, 0.0)  # as sent; None: unknown
                self.last_stream = stream  # the masters were copied on it
                self.headers = HeaderRing(self.steps)
                # The verdict as a float32 on the device, for found_inf_out.
                self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        except BaseException:
            self._release()
            raise
        self.calls = 0  # step() calls and in-backward passes that enqueued an update
        self.noop_last = False  # the last step() had no gradients at all
        self.pass_: Pass | None = None  # step in backward: the pass under way
        self.closed = False

    # ---- binding: views, masters and the host tier in emsa._cuda_bind ----------------------
    def _make_scalars(self, group_count: int) -> None:
        hypers = (Hyperparams * group_count)()
        for h in hypers:
            lib.emsa_hyperparams_init(ctypes.byref(h))
        # One step count per slot (torch counts per parameter): the tables read and advance
        # their tensors' own.
        check(lib.emsa_device_scalars_create_slots(hypers, group_count, len(self.params),
                                                   ctypes.byref(self.scalars)))
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
        # Every bucket in plan order: the unit of step_bucket.
        self.buckets = [(self.host_slots if host else self.table_slots)[k]
                        for host, k in self.order]
        covered = sorted(i for m in self.table_slots + self.host_slots for i in m)
        if covered != list(range(len(slots))):
            missing = sorted(set(range(len(slots))) - set(covered))
            names = [self.names[i] for i in missing]
            raise RuntimeError("emsa internal error: the plan's buckets do not hold every "
                               f"parameter exactly once (missing: {names}); please report it")
        # The per-bucket tables serve step_in_backward, on the current stream between
        # backward's kernels, and the statistics summed per bucket there.
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
        # Host-tier buckets: statistics-only tables (their gradients' sums for gated steps).
        options.stats_only = 1
        self.stats_table: list[int] = []  # per host-tier bucket: its index in self.tables
        for members in self.host_slots:
            self.stats_table.append(len(self.tables))
            members_of.append(members)
            self.tables.append(self._make_table(members, options, state_code, stats_only=True))
        self.grad_arrays = [(ctypes.c_void_p * len(m))() for m in members_of]
        self.sent_grads: list[list[int] | None] = [None] * len(self.tables)
        # Each slot's host-tier tensor index (libemsa's order: host_slots flattened).
        self.host_order = [i for m in self.host_slots for i in m]

    def _make_table(self, members: list[int], options, state_code: int,
                    stats_only: bool = False) -> ctypes.c_void_p:
        """An update table over these slots, each tensor stepping its own slot's count; or,
        stats_only, one that only sums their gradients (host-tier buckets)."""
        tensors = (TensorUpdate * len(members))()
        groups = (ctypes.c_int32 * len(members))()
        slots = (ctypes.c_int64 * len(members))(*members)
        for k, i in enumerate(members):
            t, p, v = tensors[k], self.params[i], self.views[i]
            lib.emsa_tensor_update_init(ctypes.byref(t))
            t.param_dtype = t.grad_dtype = _capi.DTYPE[DTYPE_NAMES[p.dtype]]
            t.state_dtype = state_code
            t.grad = p.data_ptr()
            t.numel = p.numel()
            groups[k] = self.groups[i]
            if stats_only:
                continue
            t.param = p.data_ptr()
            t.exp_avg = v["exp_avg"].data_ptr()
            t.exp_avg_sq = v["exp_avg_sq"].data_ptr() if "exp_avg_sq" in v else None
            t.master = v["master"].data_ptr() if "master" in v else None
        table = ctypes.c_void_p()
        if stats_only:
            check(lib.emsa_device_table_create(tensors, groups, len(members),
                                               ctypes.byref(options), ctypes.byref(table)))
        else:
            check(lib.emsa_device_table_create_slots(tensors, groups, slots, len(members),
                                                     len(self.params), ctypes.byref(options),
                                                     ctypes.byref(table)))
        return table

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
        """Each slot's gradient (as the kernels read it; None where .grad is None: skipped this
        step), or None when no parameter has a gradient; raises before anything is enqueued."""
        grads, present = [], 0
        for i, p in self._planned_params(param_groups, self._moved):
            g = p.grad
            if g is not None:
                g = kernel_grad(self.names[i], g, p, self.strides[i])
                present += 1
            grads.append(g)
        return grads if present else None

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

    def _send_grads(self, grads: list[torch.Tensor | None], stream: int) -> None:
        """The gradients of step()'s table, when they moved since the last step."""
        if self.step_table >= 0:
            self._point_table(self.step_table, [ptr(grads[i]) for i in self.step_members],
                              stream)

    def _point_table(self, t: int, ptrs: list[int | None], stream: int) -> None:
        """Table t reads these gradient addresses from now on (None: the tensor is absent, not
        read or updated); nothing is enqueued if unchanged."""
        if ptrs == self.sent_grads[t]:
            return
        array = self.grad_arrays[t]
        array[:] = ptrs
        check(lib.emsa_device_table_set_grads(self.tables[t], array, len(ptrs), stream))
        self.sent_grads[t] = ptrs

    def _set_inputs(self, max_norm: float, loss_scale: torch.Tensor | None,
                    stream: torch.cuda.Stream) -> None:
        """The step header's inputs: the clip threshold, and 1 / loss_scale read on the device
        (1 without one). Enqueues nothing when they are as last sent."""
        handle = stream.cuda_stream
        if self.inputs != (1.0, max_norm):
            check(lib.emsa_device_scalars_set_inputs(self.scalars, 1.0, max_norm, 0, handle))
            self.inputs = (1.0, max_norm)
        if loss_scale is not None:
            if loss_scale.numel() != 1 or not loss_scale.is_floating_point():
                raise ValueError("emsa: the loss scale must be one floating-point number, not "
                                 f"{loss_scale.dtype} {tuple(loss_scale.shape)}")
            if loss_scale.dtype != torch.float32 or loss_scale.device != self.device:
                # A GradScaler's is one float32 on the device already; others are copied once.
                loss_scale = loss_scale.to(self.device, torch.float32)
            loss_scale.record_stream(stream)  # read when the stream gets there
            check(lib.emsa_device_scalars_set_unscale_from(self.scalars, loss_scale.data_ptr(),
                                                           handle))
            self.inputs = None  # grad_unscale is the scale's now: the next pass sets it again

    def _write_found_inf(self, out: torch.Tensor | None, stream: torch.cuda.Stream) -> None:
        """out = max(out, found_inf): 1.0 if the step was skipped, else left as it was."""
        if out is None:
            return
        if out.dtype != torch.float32 or out.numel() != 1 or out.device != self.device:
            raise ValueError(f"emsa: found_inf_out must be one float32 on {self.device}, not "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        check(lib.emsa_device_scalars_write_found_inf(self.scalars, self.found_inf.data_ptr(),
                                                      stream.cuda_stream))
        torch.maximum(out, self.found_inf, out=out)  # on the current stream, which is `stream`

    def step(self, param_groups: list[dict]) -> StepResult:
        self._check_groups(param_groups)
        with on(self.index):
            self._poll(wait=False)
            grads = self._gradients(param_groups)
            if grads is None:
                self.noop_last = True
                reduce_device_stats(self, nothing=True)  # norm_group: the others wait for it
                return StepResult()
            stream = torch.cuda.current_stream(self.device)
            self._follow(stream)
            self.step_times.tick(stream)
            handle = stream.cuda_stream
            self._send_hyper(param_groups, handle)
            self._send_grads(grads, handle)
            gated = self.gated()
            if self.host is not None:
                self._claim_unwaited(stream)
                self.host.begin_step(self.hyper, gated)
            self._refresh_stale_masters(self.masters)
            device = int(any(grads[i] is not None for i in self.step_members))
            if gated:
                try:
                    self._gated_step(grads, device, stream)
                except BaseException:
                    if self.host is not None:  # nothing of this step may apply
                        self.host.discard()
                    raise
            else:
                self._set_inputs(0.0, None, stream)
                check(lib.emsa_device_step(self.scalars, self.step_array, device, 0, handle))
                self._submit_host(grads, stream)
                # The caller may write gradients in place next (zero_grad(set_to_none=False)).
                if self.host is not None:
                    self.host.wait_grads_copied(stream)
            present = [i for i, g in enumerate(grads) if g is not None]
            del grads  # freed in stream order: the caching allocator reuses them after use
            self.calls += 1
            self.noop_last = False
            self.last_stream = stream
            counted = counted_mask(present, len(self.params))
            self.steps.add_(1.0 if counted is None else counted)  # taken back if skipped
            if gated:
                self.headers.record(self.scalars, stream, self.calls, counted)
        return StepResult()

    def _submit_host(self, grads: list[torch.Tensor | None], stream) -> None:
        """In forward order: the copies land, and the CPU updates, first what the next forward
        needs first. A bucket with no gradient at all is not submitted."""
        if self.host is None:
            return
        for b in reversed(range(len(self.host_slots))):
            mine = [grads[i] for i in self.host_slots[b]]
            if any(g is not None for g in mine):
                self.host.submit(b, mine, stream)

    def _gated_step(self, grads, device: int, stream: torch.cuda.Stream) -> None:
        """step() of a gated step: the statistics, the finish, one launch over the device tier,
        the host tier's release."""
        handle = stream.cuda_stream
        self._set_inputs(float(self.max_norm or 0.0), self.loss_scale, stream)
        self._submit_host(grads, stream)  # the copies wait only for the gradients
        bucket_slots = self.buckets
        if self.host is None and self.norm_group is None:
            # begin, the statistics over the step table, finish, update: one call.
            check(lib.emsa_device_step(self.scalars, self.step_array, device, 1, handle))
        else:
            check(lib.emsa_device_begin_step(self.scalars, handle))
            if device:
                self._accumulate(self.step_table, handle)
            for b in [b for b, (host, _) in enumerate(self.order) if host]:
                members = bucket_slots[b]
                if all(grads[i] is None for i in members):
                    continue
                t = self._stats_table_of(b)
                self._point_table(t, [ptr(grads[i]) for i in members], handle)
                self._accumulate(t, handle)
            reduce_device_stats(self)  # norm_group: every rank's sums, before the finish
            check(lib.emsa_device_finish_step(self.scalars, self.step_array, device, handle))
        self._write_found_inf(self.found_inf_out, stream)
        if self.host is not None:
            self.host.release(self.scalars, stream)
            # The caller may write gradients in place next (zero_grad(set_to_none=False)).
            self.host.wait_grads_copied(stream)

    def _stats_table_of(self, b: int) -> int:
        """The table that sums bucket b's gradients (its update table on the device tier)."""
        host, t = self.order[b]
        return self.stats_table[t] if host else t

    def _accumulate(self, t: int, handle: int) -> None:
        check(lib.emsa_device_table_accumulate_stats(self.tables[t], self.scalars, handle))

    def _follow(self, stream: torch.cuda.Stream) -> None:
        """Orders `stream` after the last step's stream: both write the same state."""
        if stream.cuda_stream != self.last_stream.cuda_stream:
            stream.wait_stream(self.last_stream)

    # ---- what is learned late: skipped steps, norms ---------------------------------------
    def _poll(self, wait: bool, count_steps: bool = True) -> None:
        self.headers.poll(wait, count_steps)

    def finished_skips(self) -> list[StepResult]:
        return self.headers.finished_skips()

    def last_step_skipped(self) -> bool:
        if self.calls == 0 or self.noop_last:
            return False
        with on(self.index):
            self._poll(wait=True)
        return self.headers.last_skipped_call == self.calls

    def last_grad_norm(self) -> float | None:
        with on(self.index):
            self._poll(wait=True)
        return self.headers.last_norm

    def clip_count(self) -> int:
        with on(self.index):
            self._poll(wait=True)
        return self.headers.clips

    # ---- state_dict -----------------------------------------------------------------------
    def sync_state(self) -> None:
        """Reads each slot's step count (waits for the GPU and the host tier) into "step"."""
        if self.closed:
            return
        with on(self.index):
            self._poll(wait=True)
            self.synchronize()
            stream = torch.cuda.current_stream(self.device)
            self._follow(stream)
            steps = (ctypes.c_int64 * len(self.params))()
            check(lib.emsa_device_scalars_read_slot_steps(self.scalars, steps, len(self.params),
                                                          stream.cuda_stream))
            values = list(steps)
            if self.host is not None:  # the host tier counts its own tensors' steps
                for i, step in zip(self.host_order, self.host.read_steps()):
                    values[i] = step
        self.steps.copy_(torch.tensor(values, dtype=torch.float32))

    def state_loaded(self) -> None:
        """The optimizer wrote the views (steps included): the device's counts follow."""
        with on(self.index):
            self._poll(wait=True, count_steps=False)  # older skips: superseded by the load
            self.synchronize()
            for i in range(len(self.params)):  # an fp32 host master follows its parameter
                if "master" in self.hidden[i]:
                    self.refresh_master(i)
            stream = torch.cuda.current_stream(self.device)
            self._follow(stream)
            values = [int(v) for v in self.steps.tolist()]
            steps = (ctypes.c_int64 * len(values))(*values)
            check(lib.emsa_device_scalars_set_slot_steps(self.scalars, steps, len(values),
                                                         stream.cuda_stream))
            if self.host is not None:
                self.host.set_steps([values[i] for i in self.host_order])
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
        with on(self.index):
            if self.host is not None:
                self.host.synchronize()

    def step_stats(self) -> list[dict]:
        """Per step since the last call, measured: time_s (from this step's start to the
        next's, on the GPU; absent for the last step), d2h_s, cpu_s, h2d_s, wait_s (host-tier
        busy times), grad_wait_s and worker_s (the host tier's worker: blocked on gradients, and
        in all), stream_up_s (the GPU-updated buckets' moments up, summed), peak_device_bytes
        (torch.cuda.max_memory_allocated when the step started); for gated steps grad_norm
        (the total norm before clipping, unscaled) and clipped (the coefficient was < 1)."""
        self.synchronize()
        with on(self.index):
            self._poll(wait=True)
        norms = self.headers.take_norms()
        host = {s["step"]: s for s in self.host.stats()} if self.host is not None else {}
        out = []
        for n, (step, time_s, peak) in enumerate(self.step_times.read()):
            row = {"step": step, "peak_device_bytes": peak}
            if time_s is not None:
                row["time_s"] = time_s
            if step in norms:  # the clock ticks once per call, as calls counts
                row["grad_norm"], row["clipped"] = norms[step]
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

    # ---- buckets, and what step in backward shares with step() -----------------------------
    def bucket_slots(self) -> list[list[int]]:
        return self.buckets

    def _bucket_grads(self, members: list[int]) -> list[torch.Tensor | None]:
        """A bucket's gradients as the kernels read them (None: absent), after checking each
        parameter is where emsa planned it."""
        grads = []
        for i in members:
            p = self.params[i]
            if (p.data_ptr() != self.ptrs[i] or p.shape != self.shapes[i]
                    or p.stride() != self.strides[i]):
                self._moved(i, p)
            g = p.grad
            grads.append(None if g is None else kernel_grad(self.names[i], g, p,
                                                            self.strides[i]))
        return grads

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
