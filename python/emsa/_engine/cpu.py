"""The CPU engine: parameters in host memory, updated in place by libemsa's SIMD worker pool.

Everything a step needs is built once here: the state views in host arenas laid out by the plan,
one emsa_tensor_update per parameter in a ctypes array, one emsa_hyperparams per param group.
A step then only writes gradient pointers, element counts and step numbers into that array
(through an int64 memoryview over it: plain stores, no Python objects per field) and makes one
library call: emsa_cpu_step, or for a gated step emsa_cpu_step_gated, which scans the gradients,
decides (skip, norm, clip coefficient: the rule the CUDA engine applies too) and updates. A
parameter whose .grad is None gets numel 0 for that step: it is skipped, as torch skips it, and
its step count stays.

bf16/fp16 parameters keep an fp32 master copy in the arena. emsa writes parameters through raw
pointers, which leaves torch's version counter alone; so a changed counter means someone else
wrote the parameter (model.load_state_dict, an EMA swap, ...), and the master is refreshed from
it before the update instead of overwriting their write.

With step_in_backward each parameter is its own bucket, updated from its hook; a gated pass
(clipping, the non-finite check, a loss scale) keeps every gradient until the end of backward
and then runs one whole step: the CPU has no copies to overlap.
"""

from __future__ import annotations

import ctypes
import time

import torch

from .._distributed.groups import HostStats
from .._native.host_arena import HostArena, check_fits
from .._native.library import check, lib
from .._native.planner import Plan
from .._native.structs import (DTYPE, OPTIMIZER, SIMD, Hyperparams, StepGate, StepOptions,
                               StepReport, StepVerdict, TensorUpdate)
from .engine import Engine, Gate, StepResult
from .step_counts import StepCounts
from .params import DTYPE_NAMES, PlannedParams, check_param, kernel_grad, state_view

__all__ = ["CpuEngine"]

_W = ctypes.sizeof(TensorUpdate) // 8
assert ctypes.sizeof(TensorUpdate) % 8 == 0, "TensorUpdate must be a whole number of int64s"
_PARAM = TensorUpdate.param.offset // 8
_GRAD = TensorUpdate.grad.offset // 8
_NUMEL = TensorUpdate.numel.offset // 8
_STEP = TensorUpdate.step.offset // 8


class CpuEngine(Engine):
    name = "cpu"

    def __init__(self, planned: PlannedParams, plan: Plan, optimizer: str,
                 state_dtype: torch.dtype, group_count: int, *, in_backward: bool = False,
                 norm_group=None, setup_times: dict[str, float] | None = None):
        self.planned = planned
        self.kind = optimizer
        # norm_group: every rank's part of the gradients, summed before the verdict.
        self.group_stats = HostStats(norm_group) if norm_group is not None else None
        n = len(planned)
        self.committed = [0] * n  # step counts of updates applied

        # The bytes the plan's modules use in each tier, not the device arena's rounding to
        # the GPU's mapping granularity: on the CPU both tiers are plain host memory.
        used = {}
        for m in plan.json.get("modules", []):
            used[m["tier"]] = max(used.get(m["tier"], 0), m["offset"] + m["bytes"])
        sizes = {tier: min(planned_bytes, used.get(tier, planned_bytes)) for tier, planned_bytes
                 in (("L1", plan.device_arena_bytes), ("L2", plan.host_arena_bytes))
                 if planned_bytes}
        if sizes:  # both tiers are host memory: a host too small fails before either exists
            check_fits(sum(sizes.values()), pinned=False)
        start = time.perf_counter()
        self.arenas = {tier: HostArena(nbytes, pinned=False) for tier, nbytes in sizes.items()}
        self.setup_times = {} if setup_times is None else setup_times
        self.setup_times["host_arena"] = time.perf_counter() - start

        self.hyper = (Hyperparams * max(group_count, 1))()
        for h in self.hyper:
            lib.emsa_hyperparams_init(ctypes.byref(h))
        self.raw = (ctypes.c_int64 * max(n * _W, 1))()
        self.table = (TensorUpdate * max(n, 1)).from_buffer(self.raw)
        self.mv = memoryview(self.raw).cast("B").cast("q")
        # Step counts as torch keeps them (float32 scalars), one storage for all: "step" in
        # state is a 0-d view of it, bumped by one add_ per step.
        self.counts = StepCounts(n)
        self.steps = self.counts.tensor
        self._has_raw = (ctypes.c_float * max(n, 1))()
        self.has_grad = torch.frombuffer(self._has_raw, dtype=torch.float32)[:n]
        self._has = memoryview(self._has_raw).cast("B").cast("f")
        state_code = DTYPE[DTYPE_NAMES[state_dtype]]
        self.views = [self._bind(i, s, plan.json["params"][s.record_index], state_dtype,
                                 state_code) for i, s in enumerate(planned.engine_slots)]
        self.masters = [i for i, v in enumerate(self.views) if "master" in v]
        self.versions = [p._version for p in planned.params]

        self.options = StepOptions()
        lib.emsa_step_options_init(ctypes.byref(self.options))
        self.options.optimizer = OPTIMIZER[optimizer]
        self.report = StepReport()
        self.gate = StepGate()
        lib.emsa_step_gate_init(ctypes.byref(self.gate))
        self.verdict = StepVerdict()
        self.sums = (ctypes.c_double(), ctypes.c_int64())  # norm group: this rank's statistics
        self.last_norm: float | None = None  # the last computed one
        self.clips = 0
        self.wall: list[tuple[float, float]] = []  # (start, end) of each step()
        self.norms: list[tuple[float | None, bool]] = []  # (grad_norm, clipped) per step()
        self.pass_groups: list[dict] | None = None
        self.pass_gate: Gate | None = None
        self.skips: list[StepResult] = []  # passes skipped in backward, not yet reported
        self.updater = ctypes.c_void_p()
        check(lib.emsa_cpu_updater_create(0, SIMD["avx512"], ctypes.byref(self.updater)))

    def _bind(self, i: int, s, pp: dict, state_dtype, state_code) -> dict:
        p = s.param
        arena = self.arenas.get("L2" if pp["tier"] == "L2" else "L1")
        views = {"step": self.steps[i],
                 "exp_avg": state_view(arena, pp["exp_avg_offset"], p, state_dtype)}
        if self.kind != "lion":
            views["exp_avg_sq"] = state_view(arena, pp["exp_avg_sq_offset"], p, state_dtype)
        if p.dtype != torch.float32:
            views["master"] = state_view(arena, pp["master_offset"], p, torch.float32)
            views["master"].copy_(p.detach())
        t = self.table[i]
        lib.emsa_tensor_update_init(ctypes.byref(t))
        code = DTYPE[DTYPE_NAMES[p.dtype]]
        t.param_dtype = t.grad_dtype = code
        t.state_dtype = state_code
        t.param = p.data_ptr()
        t.exp_avg = views["exp_avg"].data_ptr()
        t.exp_avg_sq = views["exp_avg_sq"].data_ptr() if "exp_avg_sq" in views else None
        t.master = views["master"].data_ptr() if "master" in views else None
        t.numel = p.numel()
        t.hyper = ctypes.pointer(self.hyper[s.group])
        return views

    def state(self, i: int) -> dict[str, torch.Tensor]:
        return self.views[i]

    def host_arenas(self) -> list[HostArena]:
        return list(self.arenas.values())

    def state_loaded(self) -> None:
        self.committed = [int(v) for v in self.steps.tolist()]
        self.counts.written()
        self.versions = [p._version for p in self.planned.params]

    def _follow_step_edits(self) -> None:
        """state[p]["step"] written from outside (as torch allows): the bias correction
        counts from what was written, as torch's does."""
        if self.counts.edited():
            self.committed = [int(v) for v in self.steps.tolist()]
            self.counts.written()

    def refresh_master(self, i: int) -> None:
        """Someone else wrote the parameter (emsa's raw writes leave _version alone): the
        master follows the parameter, rather than overwriting that write at the next update."""
        p = self.planned.params[i]
        with torch.no_grad():
            self.views[i]["master"].copy_(p)
        self.versions[i] = p._version

    def close(self) -> None:
        updater, self.updater = self.updater, None
        if updater:
            lib.emsa_cpu_updater_destroy(updater)

    def __del__(self):
        if getattr(self, "updater", None) and lib is not None:
            self.close()

    # ---- the step -----------------------------------------------------------------------
    def _load_hyper(self, param_groups: list[dict]) -> None:
        for h, group in zip(self.hyper, param_groups):
            h.lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            h.beta1 = float(beta1)
            h.beta2 = float(beta2)
            if "eps" in group:
                h.eps = float(group["eps"])
            h.weight_decay = float(group["weight_decay"])
            h.maximize = int(bool(group["maximize"]))

    def _param_changed(self, i: int, p: torch.Tensor) -> None:
        planned = self.planned
        planned.check_shape(i, p)
        planned.check_layout(i, p)
        if p.data_ptr() == planned.ptrs[i]:
            return  # only strides of size-1 dimensions changed: same memory, same master
        if p.device.type != "cpu":
            raise ValueError(f"parameter {planned.names[i]} moved to {p.device} after emsa "
                             "planned it on the CPU; build the optimizer after moving the model")
        check_param(planned.names[i], p)  # its storage was replaced; the new one must be dense
        planned.ptrs[i] = p.data_ptr()
        self.mv[i * _W + _PARAM] = planned.ptrs[i]
        if "master" in self.views[i]:
            self.refresh_master(i)

    def _fill(self, param_groups: list[dict]) -> list[torch.Tensor]:
        """Writes each slot's gradient into the table (numel 0: .grad is None, skipped); returns
        the gradients copied to their parameter's layout, to keep alive until the update."""
        mv, has, committed, planned = self.mv, self._has, self.committed, self.planned
        keep = []
        for i, p in planned.each(param_groups, self._param_changed):
            g = p.grad
            base = i * _W
            if g is None:
                mv[base + _NUMEL] = 0
                has[i] = 0.0
            else:
                g = kernel_grad(planned.names[i], g, p, planned.strides[i])
                if g is not p.grad:
                    keep.append(g)
                mv[base + _GRAD] = g.data_ptr()
                mv[base + _NUMEL] = planned.numels[i]
                mv[base + _STEP] = committed[i] + 1
                has[i] = 1.0
        return keep

    def _gated_step(self, n: int, gate: Gate) -> StepResult:
        """One library call: statistics, verdict, update (or a skip). With a norm group the
        statistics are this rank's, summed over the group first, then handed in."""
        g = self.gate
        g.max_norm = float(gate.max_norm or 0.0)
        g.loss_scale = 1.0 if gate.loss_scale is None else float(gate.loss_scale)
        g.stats_given = 0
        if self.group_stats is not None:  # every rank's part of the gradients
            sum_sq, bad = self.sums
            check(lib.emsa_cpu_grad_stats(self.updater, self.table, n, ctypes.byref(sum_sq),
                                          ctypes.byref(bad)))
            g.sum_sq, g.nonfinite_count = self.group_stats.reduce(sum_sq.value, bad.value)
            g.stats_given = 1
        v = self.verdict
        lib.emsa_step_verdict_init(ctypes.byref(v))
        check(lib.emsa_cpu_step_gated(self.updater, self.table, n, ctypes.byref(self.options),
                                      ctypes.byref(g), ctypes.byref(v)))
        if v.skipped:
            first = v.first_nonfinite_tensor
            if gate.found_inf_out is not None:
                gate.found_inf_out.fill_(1.0)
            return StepResult(True, v.nonfinite_count,
                              self.planned.names[first] if first >= 0 else "",
                              grad_norm=v.grad_norm)
        if gate.max_norm > 0.0:
            clipped = v.clip_coef < 1.0
            self.clips += int(clipped)
            self.last_norm = v.grad_norm
            return StepResult(grad_norm=v.grad_norm, clipped=clipped)
        return StepResult()

    def step(self, param_groups: list[dict], gate: Gate) -> StepResult:
        start = time.perf_counter()
        result = self._step(param_groups, gate)
        self.wall.append((start, time.perf_counter()))
        self.norms.append((result.grad_norm if gate.max_norm > 0.0 and not result.skipped
                           else None, result.clipped))
        return result

    def _step(self, param_groups: list[dict], gate: Gate) -> StepResult:
        self.planned.check_counts(param_groups)
        self._follow_step_edits()
        self._load_hyper(param_groups)
        keep = self._fill(param_groups)
        n, has, committed = len(self.planned), self._has, self.committed
        params = self.planned.params
        for j in self.masters:
            if params[j]._version != self.versions[j]:
                self.refresh_master(j)
        if gate.gated:
            result = self._gated_step(n, gate)
        else:
            self.options.grad_multiplier = 1.0
            self.options.check_finite = 0
            lib.emsa_step_report_init(ctypes.byref(self.report))
            check(lib.emsa_cpu_step(self.updater, self.table, n, ctypes.byref(self.options),
                                    ctypes.byref(self.report)))
            result = StepResult()
        del keep
        if not result.skipped:
            for j in range(n):
                if has[j]:
                    committed[j] += 1
            self.steps.add_(self.has_grad)
            self.counts.written()
        return result

    def last_grad_norm(self) -> float | None:
        return self.last_norm

    def clip_count(self) -> int:
        return self.clips

    def step_stats(self) -> list[dict]:
        """time_s (wall clock from one step() to the next), opt_s (step() itself), and with
        clipping grad_norm and clipped."""
        rows = []
        for k, (start, end) in enumerate(self.wall):
            row = {"step": k + 1, "opt_s": end - start}
            norm, clipped = self.norms[k]
            if norm is not None:
                row["grad_norm"], row["clipped"] = norm, clipped
            if k + 1 < len(self.wall):
                row["time_s"] = self.wall[k + 1][0] - start
            rows.append(row)
        return rows

    # ---- step in backward: one parameter per call, from its post-accumulate-grad hook -----
    def begin_pass(self, param_groups: list[dict], gate: Gate) -> None:
        self.planned.check_counts(param_groups)
        self._follow_step_edits()
        self._load_hyper(param_groups)
        self.pass_groups = param_groups
        self.pass_gate = gate
        self.options.check_finite = 0
        self.options.grad_multiplier = 1.0

    def bucket_slots(self) -> list[list[int]]:
        return [[i] for i in range(len(self.planned))]  # any row can be updated alone

    def step_bucket(self, i: int) -> bool:
        if self.pass_gate is not None and self.pass_gate.gated:
            return False  # end_pass updates it with the verdict
        planned = self.planned
        p = planned.params[i]
        if planned.moved(i, p):
            self._param_changed(i, p)
        g = p.grad
        if g is None:
            return True
        g = kernel_grad(planned.names[i], g, p, planned.strides[i])  # alive until the step
        if "master" in self.views[i] and p._version != self.versions[i]:
            self.refresh_master(i)
        base = i * _W
        self.mv[base + _GRAD] = g.data_ptr()
        self.mv[base + _NUMEL] = planned.numels[i]
        self.mv[base + _STEP] = self.committed[i] + 1
        # The table row alone: emsa_cpu_step takes any run of rows, so no per-call array.
        row = ctypes.cast(ctypes.byref(self.table, i * ctypes.sizeof(TensorUpdate)),
                          ctypes.POINTER(TensorUpdate))
        lib.emsa_step_report_init(ctypes.byref(self.report))
        check(lib.emsa_cpu_step(self.updater, row, 1, ctypes.byref(self.options),
                                ctypes.byref(self.report)))
        del g
        self.committed[i] += 1
        self.steps[i] += 1.0
        self.counts.written()
        return True

    def end_pass(self) -> None:
        """One step over every slot that still holds a gradient: all of a gated pass, and in
        an ungated one the slots whose gradient came only from earlier (accumulated) passes."""
        groups, gate = self.pass_groups, self.pass_gate
        self.pass_groups = self.pass_gate = None
        if groups is None:
            return
        if not gate.gated and all(p.grad is None for p in self.planned.params):
            return
        result = self._step(groups, gate)
        if result.skipped:
            self.skips.append(result)

    def finished_skips(self) -> list[StepResult]:
        skips, self.skips = self.skips, []
        return skips
