"""The CUDA engine's device-side machinery: the plan's buckets as tables of fused kernels, and
the scalars they read on the device (libemsa's DeviceScalars and DeviceUpdateTables,
emsa/cuda_update.h).

Buckets is the layout: every plan bucket in plan order, each on the device tier (an update
table of its own, the unit step_in_backward updates) or the host tier (a statistics-only table:
its gradients' sum of squares and non-finite count for gated steps), plus one table over every
device-tier bucket, which step() runs as one launch.

DeviceKernels owns the handles: one DeviceScalars (every param group's hyperparameters, one step
count per slot, the step header: gradient multiplier, found_inf, statistics) and the tables,
each recording its parameters' addresses. Everything is enqueued on the stream given; nothing
here waits for the GPU. Values sent are remembered, so a step enqueues only what changed (a
scheduler's lr, gradient addresses torch reallocated after zero_grad(set_to_none=True)).
"""

from __future__ import annotations

import ctypes

import torch

from .._distributed.groups import DeviceStats
from .._native import tuning
from .._native.library import EmsaError, check, lib
from .._native.planner import Plan
from .._native.structs import (DTYPE, OPTIMIZER, DeviceStepHeader, DeviceTableOptions,
                               Hyperparams, TensorUpdate)
from .params import DTYPE_NAMES, PlannedParams

__all__ = ["Buckets", "DeviceKernels", "ptr"]


def ptr(g: torch.Tensor | None) -> int | None:
    """A gradient's address for a table; None (NULL) for an absent one."""
    return None if g is None else g.data_ptr()


class Buckets:
    """The plan's buckets over the slots (see the module docstring)."""

    def __init__(self, planned: PlannedParams, plan: Plan, on_host: list[bool]):
        slot_of = {s.record_index: i for i, s in enumerate(planned.engine_slots)}
        self.device: list[list[int]] = []  # device-tier buckets' slots
        self.host: list[list[int]] = []  # host-tier buckets' slots
        self.host_on_gpu: list[bool] = []  # per host-tier bucket: the GPU updates it
        self.order: list[tuple[bool, int]] = []  # every bucket in plan order: (host?, index)
        for bucket in plan.json["buckets"]:
            members = [slot_of[r] for r in bucket["params"] if r in slot_of]
            if not members:
                continue
            host = bucket["tier"] == "L2"
            if any(on_host[i] != host for i in members):
                raise RuntimeError("emsa internal error: a plan bucket mixes tiers; please "
                                   "report it")
            into = self.host if host else self.device
            self.order.append((host, len(into)))
            into.append(members)
            if host:
                self.host_on_gpu.append(bool(bucket.get("device_update", False)))
        # Every bucket in plan order: the unit of step_bucket.
        self.all = [(self.host if host else self.device)[k] for host, k in self.order]
        covered = sorted(i for m in self.device + self.host for i in m)
        if covered != list(range(len(planned))):
            missing = sorted(set(range(len(planned))) - set(covered))
            names = [planned.names[i] for i in missing]
            raise RuntimeError("emsa internal error: the plan's buckets do not hold every "
                               f"parameter exactly once (missing: {names}); please report it")
        self.step_members = [i for m in self.device for i in m]  # step()'s one table
        # Each slot's host-tier tensor index (libemsa's order: host buckets flattened).
        self.host_order = [i for m in self.host for i in m]


class DeviceKernels:
    """The scalars and tables (see the module docstring). views[i]: slot i's state views (the
    tables record their addresses)."""

    def __init__(self, planned: PlannedParams, buckets: Buckets, views: list[dict], kind: str,
                 state_dtype: torch.dtype, group_count: int, device: torch.device,
                 norm_group=None):
        self.planned, self.buckets, self.device = planned, buckets, device
        self.scalars = ctypes.c_void_p()
        self.tables: list[ctypes.c_void_p] = []
        hypers = (Hyperparams * group_count)()
        for h in hypers:
            lib.emsa_hyperparams_init(ctypes.byref(h))
        # One step count per slot (torch counts per parameter): the tables read and advance
        # their tensors' own.
        check(lib.emsa_device_scalars_create_slots(hypers, group_count, len(planned),
                                                   ctypes.byref(self.scalars)))
        self.hyper = hypers  # each group's values as the device holds them
        self.sent = [self._key_of(h) for h in hypers]
        self.scratch = Hyperparams()
        lib.emsa_hyperparams_init(ctypes.byref(self.scratch))
        self._make_tables(views, kind, DTYPE[DTYPE_NAMES[state_dtype]])
        self.inputs: tuple[float, float] | None = None  # header inputs as sent; None: unknown
        # The verdict as a float32 on the device, for found_inf_out.
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.group_stats = None
        if norm_group is not None:  # the header's sums, all-reduced over the group
            header = ctypes.c_void_p()
            check(lib.emsa_device_scalars_header_address(self.scalars, ctypes.byref(header)))
            self.group_stats = DeviceStats(
                norm_group, header.value + DeviceStepHeader.sum_sq.offset,
                header.value + DeviceStepHeader.nonfinite_count.offset, device)

    @staticmethod
    def _key_of(h: Hyperparams) -> tuple:
        return (h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, bool(h.maximize))

    def _make_tables(self, views: list[dict], kind: str, state_code: int) -> None:
        """One table per plan bucket. Gradients may not exist yet: each tensor's gradient
        starts as its parameter's address (valid memory of the right size and dtype), and every
        step sets the real ones first."""
        b = self.buckets
        options = DeviceTableOptions()
        lib.emsa_device_table_options_init(ctypes.byref(options))
        options.optimizer = OPTIMIZER[kind]
        options.bulk_copy = int(tuning.cuda_bulk_copy())
        # The per-bucket tables serve step_in_backward, on the current stream between
        # backward's kernels, and the statistics summed per bucket there.
        for members in b.device:
            self.tables.append(self._make_table(members, views, options, state_code))
        # step() updates every device-tier bucket at once: one table over all of them, one
        # launch (and one gradient-pointer update) instead of one per bucket, which is faster.
        members_of = list(b.device)  # each table's slots
        if len(b.device) > 1:
            members_of.append(b.step_members)
            self.tables.append(self._make_table(b.step_members, views, options, state_code))
        self.step_table = len(self.tables) - 1  # index of the table step() runs (-1: none)
        self.step_array = (ctypes.c_void_p * 1)(
            self.tables[self.step_table].value if self.tables else None)
        # Host-tier buckets: statistics-only tables (their gradients' sums for gated steps).
        options.stats_only = 1
        self.stats_table: list[int] = []  # per host-tier bucket: its index in self.tables
        for members in b.host:
            self.stats_table.append(len(self.tables))
            members_of.append(members)
            self.tables.append(self._make_table(members, views, options, state_code,
                                                stats_only=True))
        self.grad_arrays = [(ctypes.c_void_p * len(m))() for m in members_of]
        self.sent_grads: list[list[int] | None] = [None] * len(self.tables)

    def _make_table(self, members: list[int], views: list[dict], options, state_code: int,
                    stats_only: bool = False) -> ctypes.c_void_p:
        """An update table over these slots, each tensor stepping its own slot's count; or,
        stats_only, one that only sums their gradients (host-tier buckets)."""
        planned = self.planned
        tensors = (TensorUpdate * len(members))()
        groups = (ctypes.c_int32 * len(members))()
        slots = (ctypes.c_int64 * len(members))(*members)
        for k, i in enumerate(members):
            t, p, v = tensors[k], planned.params[i], views[i]
            lib.emsa_tensor_update_init(ctypes.byref(t))
            t.param_dtype = t.grad_dtype = DTYPE[DTYPE_NAMES[p.dtype]]
            t.state_dtype = state_code
            t.grad = p.data_ptr()
            t.numel = p.numel()
            groups[k] = planned.groups[i]
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
                                                     len(planned), ctypes.byref(options),
                                                     ctypes.byref(table)))
        return table

    # ---- what a step sends --------------------------------------------------------------------
    def send_hyper(self, param_groups: list[dict], stream: int) -> None:
        """Each group's hyperparameters, where they changed since last sent."""
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

    def point(self, t: int, ptrs: list[int | None], stream: int) -> None:
        """Table t reads these gradient addresses from now on (None: the tensor is absent, not
        read or updated); nothing is enqueued if unchanged."""
        if ptrs == self.sent_grads[t]:
            return
        array = self.grad_arrays[t]
        array[:] = ptrs
        check(lib.emsa_device_table_set_grads(self.tables[t], array, len(ptrs), stream))
        self.sent_grads[t] = ptrs

    def point_step_table(self, grads: list[torch.Tensor | None], stream: int) -> None:
        """The gradients of step()'s table, when they moved since the last step."""
        if self.step_table >= 0:
            self.point(self.step_table, [ptr(grads[i]) for i in self.buckets.step_members],
                       stream)

    def set_inputs(self, max_norm: float, loss_scale: torch.Tensor | None,
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

    def write_found_inf(self, out: torch.Tensor | None, stream: torch.cuda.Stream) -> None:
        """out = max(out, found_inf): 1.0 if the step was skipped, else left as it was."""
        if out is None:
            return
        if out.dtype != torch.float32 or out.numel() != 1 or out.device != self.device:
            raise ValueError(f"emsa: found_inf_out must be one float32 on {self.device}, not "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        check(lib.emsa_device_scalars_write_found_inf(self.scalars, self.found_inf.data_ptr(),
                                                      stream.cuda_stream))
        torch.maximum(out, self.found_inf, out=out)  # on the current stream, which is `stream`

    # ---- what a step enqueues -----------------------------------------------------------------
    def stats_table_of(self, b: int) -> int:
        """The table that sums bucket b's gradients (its update table on the device tier)."""
        host, t = self.buckets.order[b]
        return self.stats_table[t] if host else t

    def accumulate(self, t: int, stream: int) -> None:
        """Table t's gradients' sum of squares and non-finite count, added to the header."""
        check(lib.emsa_device_table_accumulate_stats(self.tables[t], self.scalars, stream))

    def step(self, device: int, gated: int, stream: int) -> None:
        """Begin, (gated: the statistics over step()'s table, the finish,) and step()'s table
        updated when `device`: one call."""
        check(lib.emsa_device_step(self.scalars, self.step_array, device, gated, stream))

    def begin(self, stream: int) -> None:
        check(lib.emsa_device_begin_step(self.scalars, stream))

    def finish(self, device: int, stream: int) -> None:
        """The verdict from the accumulated statistics, then step()'s table when `device`."""
        check(lib.emsa_device_finish_step(self.scalars, self.step_array, device, stream))

    def update(self, t: int, stream: int) -> None:
        check(lib.emsa_device_table_update(self.tables[t], self.scalars, stream))

    def reduce_stats(self, nothing: bool = False) -> None:
        """With a norm group, between the step's last accumulate and its finish, on the current
        stream: the header's sums over the group's ranks. nothing: this rank has no gradient in
        a gated step (it still takes part; its header is untouched)."""
        if self.group_stats is None:
            return
        if nothing:
            self.group_stats.contribute_nothing()
        else:
            self.group_stats.all_reduce()

    def read_steps(self, stream: int) -> list[int]:
        n = len(self.planned)
        steps = (ctypes.c_int64 * n)()
        check(lib.emsa_device_scalars_read_slot_steps(self.scalars, steps, n, stream))
        return list(steps)

    def set_steps(self, values: list[int], stream: int) -> None:
        steps = (ctypes.c_int64 * len(values))(*values)
        check(lib.emsa_device_scalars_set_slot_steps(self.scalars, steps, len(values), stream))

    def close(self) -> None:
        for table in self.tables:
            lib.emsa_device_table_destroy(table)
        self.tables = []
        scalars, self.scalars = self.scalars, ctypes.c_void_p()
        if scalars:
            lib.emsa_device_scalars_destroy(scalars)
