"""The CUDA engine: parameters on the GPU, updated in place by libemsa's fused multi-tensor
kernels on torch's current stream; state the plan puts on the host tier updated by the CPU while
the GPU runs.

Bound once, before the first step: the arenas, views and masters (CudaState), the scalars and
buckets as update tables (DeviceKernels) and, when the plan uses it, libemsa's host tier. A step
enqueues on torch.cuda.current_stream() and never waits for the GPU. A parameter whose .grad is
None gets a NULL gradient in its table (not updated, its step count stays). Gated steps wait for
every gradient's statistics and the device's verdict (kernels/step_verdict.h, the CPU engine's
rule too); skips and norms are learned late (cuda_stats.HeaderRing). Parameters stay at the
addresses they had when planned: replacing the storage raises. Details: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings

import torch

from .._native.host_tier import HostTier
from .._native.library import lib
from .._native.planner import Plan, measure_profile
from .cuda_kernels import Buckets, DeviceKernels
from .cuda_passes import CudaPasses
from .cuda_state import CudaState
from .cuda_stats import HeaderRing, StepClock, counted_mask
from .engine import Engine, Gate, StepResult
from .params import PlannedParams, kernel_grad
from .step_counts import StepCounts

__all__ = ["CudaEngine", "planning_profile"]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def on(index: int):
    """torch's and libemsa's current device set to `index` (emsa checks it on every call)."""
    if torch.cuda.current_device() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def planning_profile(device: torch.device, measure_bandwidth: bool) -> str:
    """The profile to plan with when none is given: measured now, not cached (the default
    budget is the device's free memory). Bandwidths (about a second) only when the plan may use
    the host tier: they decide what leaves the device and predict the step."""
    return json.dumps(measure_profile(measure_bandwidth=measure_bandwidth,
                                      gpu_device=_index(device)))


class CudaEngine(Engine):
    name = "cuda"
    deferred = True

    def __init__(self, planned: PlannedParams, plan: Plan, optimizer: str,
                 state_dtype: torch.dtype, group_count: int, *, in_backward: bool = False,
                 norm_group=None, setup_times: dict[str, float] | None = None):
        self.closed = True  # until everything below exists
        self.planned = planned
        self.kind = optimizer
        self.index = _index(planned.params[0].device)
        self.device = torch.device("cuda", self.index)
        entries = [plan.json["params"][s.record_index] for s in planned.engine_slots]
        # Step counts as torch keeps them (float32 CPU scalars), one storage for all: "step" in
        # state is a 0-d view of it.
        self.counts = StepCounts(len(planned))
        self.steps = self.counts.tensor
        # The optimizer's set-up phases: those measured here, and later the first step's waits.
        self.setup_times = {} if setup_times is None else setup_times
        self.memory: CudaState | None = None
        self.kernels: DeviceKernels | None = None
        self.host: HostTier | None = None
        self.clock = StepClock()
        self.warned_unwaited = False
        try:
            with on(self.index):
                self.memory = CudaState(planned, plan, entries, optimizer, state_dtype,
                                       self.device, self.steps, self.setup_times)
                bind_start = time.perf_counter()
                self.buckets = Buckets(planned, plan, self.memory.on_host)
                self.kernels = DeviceKernels(planned, self.buckets, self.memory.views, optimizer,
                                             state_dtype, group_count, self.device, norm_group)
                self.setup_times["bind.tables"] = time.perf_counter() - bind_start
                self._make_host_tier(group_count, in_backward, _pacing_hold(plan))
                self.setup_times["bind"] = (time.perf_counter() - bind_start
                                            + self.setup_times["bind.views"]
                                            + self.setup_times["bind.masters"])
                stream = torch.cuda.current_stream(self.device)
                self.kernels.set_inputs(0.0, None, stream)
                self.last_stream = stream  # the masters were copied on it
                self.headers = HeaderRing(self.counts)
        except BaseException:
            self._release()
            raise
        self.calls = 0  # step() calls and in-backward passes that enqueued an update
        self.noop_last = False  # the last step() had no gradients at all
        self.passes = CudaPasses(self)
        self.closed = False

    def _make_host_tier(self, group_count: int, in_backward: bool, hold_bytes: int) -> None:
        b = self.buckets
        if not b.host:
            return
        start = time.perf_counter()
        tensors, params = [], []
        for k, members in enumerate(b.host):
            for i in members:
                tensors.append(self.memory.host_tensor(i, k, b.host_on_gpu[k]))
                params.append(self.planned.params[i])
        self.host = HostTier(tensors, b.host, group_count, self.kind, self.device, params,
                             in_backward=in_backward, hold_bytes=hold_bytes)
        self.setup_times["bind.host_tier"] = time.perf_counter() - start

    def state(self, i: int) -> dict[str, torch.Tensor]:
        return self.memory.views[i]

    def host_arenas(self) -> list:
        return [self.memory.host_arena] if self.memory.host_arena is not None else []

    # ---- the step -------------------------------------------------------------------------
    def _moved(self, i: int, p: torch.Tensor) -> None:
        self.planned.check_shape(i, p)
        self.planned.check_layout(i, p)
        if p.data_ptr() == self.planned.ptrs[i]:
            return  # only strides of size-1 dimensions changed: nothing to re-lay
        raise ValueError(
            f"parameter {self.planned.names[i]} no longer lives where emsa planned it (its "
            "storage was replaced: p.data = ..., or the model moved); emsa's CUDA tables record "
            "parameter addresses: copy new values into the parameter instead "
            "(model.load_state_dict copies), or build a new optimizer after replacing it")

    def _gradients(self, param_groups: list[dict]):
        """Each slot's gradient (as the kernels read it; None where .grad is None: skipped this
        step), or None when no parameter has a gradient; raises before anything is enqueued."""
        grads, present, planned = [], 0, self.planned
        for i, p in planned.each(param_groups, self._moved):
            g = p.grad
            if g is not None:
                g = kernel_grad(planned.names[i], g, p, planned.strides[i])
                present += 1
            grads.append(g)
        return grads if present else None

    def bucket_grads(self, members: list[int]) -> list[torch.Tensor | None]:
        """A bucket's gradients as the kernels read them (None: absent), after checking each
        parameter is where emsa planned it."""
        grads, planned = [], self.planned
        for i in members:
            p = planned.params[i]
            if planned.moved(i, p):
                self._moved(i, p)
            g = p.grad
            grads.append(None if g is None else kernel_grad(planned.names[i], g, p,
                                                            planned.strides[i]))
        return grads

    def step(self, param_groups: list[dict], gate: Gate) -> StepResult:
        with on(self.index):
            self._follow_step_edits()
            self.headers.poll(wait=False)
            grads = self._gradients(param_groups)
            if grads is None:
                self.noop_last = True
                if gate.gated:  # norm group: the others wait for this rank's part
                    self.kernels.reduce_stats(nothing=True)
                return StepResult()
            stream = torch.cuda.current_stream(self.device)
            self.follow(stream)
            self.clock.tick(stream)
            handle = stream.cuda_stream
            kernels = self.kernels
            kernels.send_hyper(param_groups, handle)
            kernels.point_step_table(grads, handle)
            if self.host is not None:
                self.claim_unwaited(stream)
                self.host.begin_step(kernels.hyper, gate.gated)
            self.memory.refresh_stale(self.memory.masters)
            device = int(any(grads[i] is not None for i in self.buckets.step_members))
            if gate.gated:
                try:
                    self._gated_step(grads, device, gate, stream)
                except BaseException:
                    if self.host is not None:  # nothing of this step may apply
                        self.host.discard()
                    raise
            else:
                kernels.set_inputs(0.0, None, stream)
                kernels.step(device, 0, handle)
                self._submit_host(grads, stream)
                # The caller may write gradients in place next (zero_grad(set_to_none=False)).
                if self.host is not None:
                    self.host.wait_grads_copied(stream)
            present = [i for i, g in enumerate(grads) if g is not None]
            del grads  # freed in stream order: the caching allocator reuses them after use
            self.calls += 1
            self.noop_last = False
            self.last_stream = stream
            counted = counted_mask(present, len(self.planned))
            self.steps.add_(1.0 if counted is None else counted)  # taken back if skipped
            self.counts.written()
            if gate.gated:
                self.headers.record(kernels.scalars, stream, self.calls, counted)
        return StepResult()

    def _submit_host(self, grads: list[torch.Tensor | None], stream) -> None:
        """In forward order: the copies land, and the CPU updates, first what the next forward
        needs first. A bucket with no gradient at all is not submitted."""
        if self.host is None:
            return
        for b in reversed(range(len(self.buckets.host))):
            mine = [grads[i] for i in self.buckets.host[b]]
            if any(g is not None for g in mine):
                self.host.submit(b, mine, stream)

    def _gated_step(self, grads, device: int, gate: Gate, stream: torch.cuda.Stream) -> None:
        """step() of a gated step: the statistics, the finish, one launch over the device tier,
        the host tier's release."""
        handle, kernels = stream.cuda_stream, self.kernels
        kernels.set_inputs(float(gate.max_norm or 0.0), gate.loss_scale, stream)
        self._submit_host(grads, stream)  # the copies wait only for the gradients
        if self.host is None and kernels.group_stats is None:
            kernels.step(device, 1, handle)  # begin, statistics, finish, update: one call
        else:
            kernels.begin(handle)
            if device:
                kernels.accumulate(kernels.step_table, handle)
            for b in [b for b, (host, _) in enumerate(self.buckets.order) if host]:
                members = self.buckets.all[b]
                if all(grads[i] is None for i in members):
                    continue
                t = kernels.stats_table_of(b)
                kernels.point(t, [None if grads[i] is None else grads[i].data_ptr()
                                  for i in members], handle)
                kernels.accumulate(t, handle)
            kernels.reduce_stats()  # norm group: every rank's sums, before the finish
            kernels.finish(device, handle)
        kernels.write_found_inf(gate.found_inf_out, stream)
        if self.host is not None:
            self.host.release(kernels.scalars, stream)
            # The caller may write gradients in place next (zero_grad(set_to_none=False)).
            self.host.wait_grads_copied(stream)

    def follow(self, stream: torch.cuda.Stream) -> None:
        """Orders `stream` after the last step's stream: both write the same state."""
        if stream.cuda_stream != self.last_stream.cuda_stream:
            stream.wait_stream(self.last_stream)

    def claim_unwaited(self, stream: torch.cuda.Stream) -> None:
        """Before a new step: every upload of the last one should have been waited for by a
        module forward reading it. One that was not means its parameters were read outside
        their own module's forward (a functional use, compiled code that skips module hooks),
        possibly before the update landed: warn once, then wait, so nothing later races."""
        missed = sorted(self.host.pending)
        if not missed:
            return
        if not self.warned_unwaited:
            self.warned_unwaited = True
            names = [self.planned.names[i] for b in missed for i in self.buckets.host[b]]
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

    # ---- step in backward: the passes (cuda_passes) ---------------------------------------
    def bucket_slots(self) -> list[list[int]]:
        return self.buckets.all

    def begin_pass(self, param_groups: list[dict], gate: Gate) -> None:
        with on(self.index):
            self._follow_step_edits()
            self.passes.begin(param_groups, gate)

    def step_bucket(self, b: int) -> bool:
        with on(self.index):
            return self.passes.bucket(b)

    def end_pass(self) -> None:
        with on(self.index):
            self.passes.end()

    # ---- what is learned late: skipped steps, norms ---------------------------------------
    def finished_skips(self) -> list[StepResult]:
        return self.headers.finished_skips()

    def last_step_skipped(self) -> bool:
        if self.calls == 0 or self.noop_last:
            return False
        with on(self.index):
            self.headers.poll(wait=True)
        return self.headers.last_skipped_call == self.calls

    def last_grad_norm(self) -> float | None:
        with on(self.index):
            self.headers.poll(wait=True)
        return self.headers.last_norm

    def clip_count(self) -> int:
        with on(self.index):
            self.headers.poll(wait=True)
        return self.headers.clips

    # ---- state_dict -----------------------------------------------------------------------
    def sync_state(self) -> None:
        """Reads each slot's step count (waits for the GPU and the host tier) into "step"."""
        if self.closed:
            return
        with on(self.index):
            self.headers.poll(wait=True)
            self.synchronize()
            stream = torch.cuda.current_stream(self.device)
            self.follow(stream)
            values = self.kernels.read_steps(stream.cuda_stream)
            if self.host is not None:  # the host tier counts its own tensors' steps
                for i, step in zip(self.buckets.host_order, self.host.read_steps()):
                    values[i] = step
        self.steps.copy_(torch.tensor(values, dtype=torch.float32))
        self.counts.written()

    def state_loaded(self) -> None:
        """The optimizer wrote the views (steps included): the device's counts follow."""
        with on(self.index):
            self.headers.poll(wait=True, count_steps=False)  # older skips: superseded
            self.synchronize()
            memory = self.memory
            for i in range(len(self.planned)):  # an fp32 host master follows its parameter
                if "master" in memory.hidden[i]:
                    memory.refresh_master(i)
            stream = torch.cuda.current_stream(self.device)
            self.follow(stream)
            values = [int(v) for v in self.steps.tolist()]
            self.kernels.set_steps(values, stream.cuda_stream)
            if self.host is not None:
                self.host.set_steps([values[i] for i in self.buckets.host_order])
            self.last_stream = stream
        self.counts.written()

    def _follow_step_edits(self) -> None:
        """state[p]["step"] written from outside (as torch allows): the device's and the host
        tier's counts follow, as after a load (waits for the GPU, only when it happened)."""
        if self.counts.edited():
            self.state_loaded()
        self.memory.versions = [p._version for p in self.planned.params]

    # ---- measurements and lifetime ----------------------------------------------------------
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
            self.headers.poll(wait=True)
        norms = self.headers.take_norms()
        host = {s["step"]: s for s in self.host.stats()} if self.host is not None else {}
        out = []
        for step, time_s, peak in self.clock.read():
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

    def _release(self) -> None:
        if self.host is not None:
            self.host.close()
            self.host = None
        if self.kernels is not None:
            self.kernels.close()
        if self.memory is not None:
            self.memory.close()

    def __del__(self):
        if not getattr(self, "closed", True) and lib is not None:  # not at interpreter exit
            self.close()


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
