"""The CPU engine: parameters in host memory, updated in place by libemsa's SIMD worker pool.

Everything a step needs is built once here: the state views in host arenas laid out by the plan,
one emsa_tensor_update per parameter in a ctypes array, one emsa_hyperparams per param group.
A step then only writes gradient pointers, element counts and step numbers into that array
(through an int64 memoryview over it: plain stores, no Python objects per field) and calls
emsa_cpu_step once. A parameter whose .grad is None gets numel 0 for that step: it is skipped,
as torch skips it, and its step count stays.

bf16/fp16 parameters keep an fp32 master copy in the arena. emsa writes parameters through raw
pointers, which leaves torch's version counter alone; so a changed counter means someone else
wrote the parameter (model.load_state_dict, an EMA swap, ...), and the master is refreshed from
it before the update instead of overwriting their write.
"""

from __future__ import annotations

import ctypes
import math
import time
import warnings

import torch

from . import _capi
from ._arena import HostArena, check_fits
from ._backend import (DTYPE_NAMES, Backend, StepResult, check_param, clip_coefficient,
                       kernel_grad, state_view)
from ._binding import Slot
from ._capi import Hyperparams, StepOptions, StepReport, TensorUpdate, check, lib
from ._distributed import reduce_host_stats
from .plan import Plan

_W = ctypes.sizeof(TensorUpdate) // 8
assert ctypes.sizeof(TensorUpdate) % 8 == 0, "TensorUpdate must be a whole number of int64s"
_PARAM = TensorUpdate.param.offset // 8
_GRAD = TensorUpdate.grad.offset // 8
_NUMEL = TensorUpdate.numel.offset // 8
_STEP = TensorUpdate.step.offset // 8


class CpuBackend(Backend):
    name = "cpu"
    wants_bandwidths = False

    def __init__(self, slots: list[Slot], plan: Plan, optimizer: str,
                 state_dtype: torch.dtype, group_count: int, in_backward: bool = False):
        self.slots = slots
        self.params = [s.param for s in slots]
        self.names = [s.name for s in slots]
        self.counts = [0] * group_count
        for s in slots:
            self.counts[s.group] += 1
        self.shapes = [s.param.shape for s in slots]
        self.dtypes = [s.param.dtype for s in slots]
        self.strides = [s.param.stride() for s in slots]
        self.ptrs = [s.param.data_ptr() for s in slots]
        self.numels = [s.param.numel() for s in slots]
        self.committed = [0] * len(slots)  # step counts of updates applied
        self.kind = optimizer
        n = len(slots)

        # The bytes the plan's modules use in each tier, not the device arena's rounding to
        # the GPU's mapping granularity: on the CPU both tiers are plain host memory.
        used = {}
        for m in plan.json.get("modules", []):
            used[m["tier"]] = max(used.get(m["tier"], 0), m["offset"] + m["bytes"])
        sizes = {tier: min(planned, used.get(tier, planned)) for tier, planned in
                 (("L1", plan.device_arena_bytes), ("L2", plan.host_arena_bytes)) if planned}
        if sizes:  # both tiers are host memory: a host too small fails before either exists
            check_fits(sum(sizes.values()), pinned=False)
        start = time.perf_counter()
        self.arenas = {tier: HostArena(nbytes, pinned=False) for tier, nbytes in sizes.items()}
        self.setup_times = {"host_arena": time.perf_counter() - start}

        self.hyper = (Hyperparams * max(group_count, 1))()
        for h in self.hyper:
            lib.emsa_hyperparams_init(ctypes.byref(h))
        self.raw = (ctypes.c_int64 * max(n * _W, 1))()
        self.table = (TensorUpdate * max(n, 1)).from_buffer(self.raw)
        self.mv = memoryview(self.raw).cast("B").cast("q")
        # Step counts as torch keeps them (float32 scalars), one storage for all: "step" in
        # state is a 0-d view of it, bumped by one add_ per step.
        self.steps = torch.zeros(n, dtype=torch.float32)
        self._has_raw = (ctypes.c_float * max(n, 1))()
        self.has_grad = torch.frombuffer(self._has_raw, dtype=torch.float32)[:n]
        self._has = memoryview(self._has_raw).cast("B").cast("f")
        self.views: list[dict[str, torch.Tensor]] = []
        state_code = _capi.DTYPE[DTYPE_NAMES[state_dtype]]
        for i, s in enumerate(slots):
            self.views.append(self._bind(i, s, plan.json["params"][s.record_index], state_dtype,
                                         state_code))
        self.masters = [i for i, v in enumerate(self.views) if "master" in v]
        self.versions = [s.param._version for s in slots]

        self.options = StepOptions()
        lib.emsa_step_options_init(ctypes.byref(self.options))
        self.options.optimizer = _capi.OPTIMIZER[optimizer]
        self.report = StepReport()
        self.grad_norm: float | None = None  # this step's, None when not computed
        self.clipped = False
        self.last_norm: float | None = None  # the last computed one
        self.clips = 0
        self.pass_groups: list[dict] | None = None
        self.pass_gated = False
        self.skips: list[StepResult] = []  # passes skipped in backward, not yet reported
        self.updater = ctypes.c_void_p()
        check(lib.emsa_cpu_updater_create(0, _capi.SIMD["avx512"], ctypes.byref(self.updater)))

    def _bind(self, i: int, s: Slot, pp: dict, state_dtype, state_code) -> dict:
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
        code = _capi.DTYPE[DTYPE_NAMES[p.dtype]]
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

    def state_loaded(self) -> None:
        self.committed = [int(v) for v in self.steps.tolist()]
        self.versions = [p._version for p in self.params]

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
        name = self.names[i]
        if p.shape != self.shapes[i] or p.dtype is not self.dtypes[i]:
            raise ValueError(
                f"parameter {name} changed from {tuple(self.shapes[i])} to {tuple(p.shape)} "
                f"({p.dtype}) after emsa planned it; emsa lays optimizer state out once: build "
                "a new optimizer over the changed model")
        self._check_layout(i, p)
        if p.data_ptr() == self.ptrs[i]:
            return  # only strides of size-1 dimensions changed: same memory, same master
        if p.device.type != "cpu":
            raise ValueError(f"parameter {name} moved to {p.device} after emsa planned it on "
                             "the CPU; build the optimizer after moving the model")
        check_param(name, p)  # its storage was replaced; the new one must still be dense
        self.ptrs[i] = p.data_ptr()
        self.mv[i * _W + _PARAM] = self.ptrs[i]
        if "master" in self.views[i]:
            self.refresh_master(i)

    def _fill(self, param_groups: list[dict]) -> list[torch.Tensor]:
        """Writes each slot's gradient into the table (numel 0: .grad is None, skipped); returns
        the gradients copied to their parameter's layout, to keep alive until the update."""
        mv, has, committed = self.mv, self._has, self.committed
        keep = []
        for i, p in self._planned_params(param_groups, self._param_changed):
            g = p.grad
            base = i * _W
            if g is None:
                mv[base + _NUMEL] = 0
                has[i] = 0.0
            else:
                g = kernel_grad(self.names[i], g, p, self.strides[i])
                if g is not p.grad:
                    keep.append(g)
                mv[base + _GRAD] = g.data_ptr()
                mv[base + _NUMEL] = self.numels[i]
                mv[base + _STEP] = committed[i] + 1
                has[i] = 1.0
        return keep

    def _verdict(self) -> StepResult | None:
        """Gated steps: one statistics pass over the table's gradients gives the non-finite
        verdict and the norm; sets options.grad_multiplier (clip coefficient / loss scale).
        Returns the skipped result, or None to go on."""
        options, n = self.options, len(self.params)
        inv = 1.0
        if self.loss_scale is not None:
            # As GradScaler.unscale_: the reciprocal in float64, rounded to float32.
            inv = float(self.loss_scale.double().reciprocal().float())
        sum_sq, bad = ctypes.c_double(), ctypes.c_int64()
        check(lib.emsa_cpu_grad_stats(self.updater, self.table, n, ctypes.byref(sum_sq),
                                      ctypes.byref(bad)))
        total, nonfinite = sum_sq.value, bad.value
        if self.norm_group is not None:  # every rank's part of the gradients
            total, nonfinite = reduce_host_stats(self, total, nonfinite)
        if nonfinite and (self.check_finite or self.loss_scale is not None):
            return StepResult(True, nonfinite, self._first_nonfinite())
        coef = 1.0
        if self.max_norm > 0.0:
            norm, coef = clip_coefficient(total, inv, self.max_norm)
            self.grad_norm = norm
            self.clipped = coef < 1.0
            self.clips += int(self.clipped)
            self.last_norm = norm
            if not math.isfinite(coef):
                # torch would multiply every gradient by NaN; a NaN multiplier is refused by
                # the engine, so the step (asked for with skip_nonfinite=False) goes unclipped.
                warnings.warn("emsa: the gradient norm is NaN and skip_nonfinite=False: the "
                              "step is applied unclipped (torch's clip_grad_norm_ would make "
                              "every gradient NaN); pass skip_nonfinite=True to skip such steps",
                              RuntimeWarning, stacklevel=5)
                coef = 1.0
        options.grad_multiplier = float(torch.tensor(coef, dtype=torch.float32)
                                        * torch.tensor(inv, dtype=torch.float32))
        return None

    def _first_nonfinite(self) -> str:
        one = ctypes.c_int64()
        for i in range(len(self.params)):
            if self.mv[i * _W + _NUMEL] == 0:
                continue
            row = ctypes.cast(ctypes.byref(self.table, i * ctypes.sizeof(TensorUpdate)),
                              ctypes.POINTER(TensorUpdate))
            check(lib.emsa_cpu_grad_stats(self.updater, row, 1, None, ctypes.byref(one)))
            if one.value:
                return self.names[i]
        return ""

    def step(self, param_groups: list[dict]) -> StepResult:
        self._check_groups(param_groups)
        self._load_hyper(param_groups)
        keep = self._fill(param_groups)
        n, has, committed = len(self.params), self._has, self.committed
        for j in self.masters:
            if self.params[j]._version != self.versions[j]:
                self.refresh_master(j)
        options = self.options
        options.grad_multiplier = 1.0
        options.check_finite = 0
        self.grad_norm, self.clipped = None, False
        if self.gated():
            skipped = self._verdict()
            if skipped is not None:
                if self.found_inf_out is not None:
                    self.found_inf_out.fill_(1.0)
                return skipped
        report = self.report
        lib.emsa_step_report_init(ctypes.byref(report))
        check(lib.emsa_cpu_step(self.updater, self.table, n, ctypes.byref(options),
                                ctypes.byref(report)))
        del keep
        for j in range(n):
            if has[j]:
                committed[j] += 1
        self.steps.add_(self.has_grad)
        return StepResult(grad_norm=self.grad_norm, clipped=self.clipped)

    def last_grad_norm(self) -> float | None:
        return self.last_norm

    def clip_count(self) -> int:
        return self.clips

    # ---- step in backward: one parameter per call, from its post-accumulate-grad hook -----
    # A gated pass (clipping, non-finite skip, loss scale) keeps every gradient until the end
    # of backward and then runs one whole step: the CPU has no copies to overlap, so waiting
    # costs nothing but the gradients' memory until then.
    steps_in_backward = True

    def begin_pass(self, param_groups: list[dict]) -> None:
        self._check_groups(param_groups)
        self._load_hyper(param_groups)
        self.pass_groups = param_groups
        self.pass_gated = self.gated()
        self.options.check_finite = 0
        self.options.grad_multiplier = 1.0

    def bucket_slots(self) -> list[list[int]]:
        return [[i] for i in range(len(self.params))]  # any row can be updated alone

    def step_bucket(self, i: int) -> bool:
        if self.pass_gated:
            return False  # end_pass updates it with the verdict
        p = self.params[i]
        if (p.data_ptr() != self.ptrs[i] or p.shape != self.shapes[i]
                or p.stride() != self.strides[i]):
            self._param_changed(i, p)
        g = p.grad
        if g is None:
            return True
        g = kernel_grad(self.names[i], g, p, self.strides[i])  # alive until the step below
        if "master" in self.views[i] and p._version != self.versions[i]:
            self.refresh_master(i)
        base = i * _W
        self.mv[base + _GRAD] = g.data_ptr()
        self.mv[base + _NUMEL] = self.numels[i]
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
        return True

    def end_pass(self) -> None:
        """One step over every slot that still holds a gradient: all of a gated pass, and in
        an ungated one the slots whose gradient came only from earlier (accumulated) passes."""
        groups, self.pass_groups = self.pass_groups, None
        if groups is None:
            return
        if not self.pass_gated and all(p.grad is None for p in self.params):
            return
        result = self.step(groups)
        if result.skipped:
            self.skips.append(result)

    def finished_skips(self) -> list[StepResult]:
        skips, self.skips = self.skips, []
        return skips
