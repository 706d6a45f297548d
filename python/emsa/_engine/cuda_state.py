"""The CUDA engine's state memory: its arenas, each slot's views, the host tier's hidden staging,
the masters' values, and the host arena's population.

Views at the plan's offsets: exp_avg, exp_avg_sq (not Lion) and a 16-bit parameter's fp32
master, in the device arena (device tier) or the pinned host arena (host tier). A host-tier slot
also holds, hidden from the state, its gradient staging and, for an fp32 parameter, its host
master. The host arena's page-locked prefix holds every view a copy touches; what only CPU
threads touch lies after it in pageable memory that libemsa populates in the background, and
await_populated makes sure no step faults a page in. Masters are fp32(param) exactly. Where
each byte lives and why: docs/internals.md.
"""

from __future__ import annotations

import ctypes
import time

import torch

from .._native.device_arena import DeviceArena
from .._native.host_arena import HostArena, check_fits, pinned_arena
from .._native.library import lib
from .._native.planner import Plan
from .._native.structs import DTYPE, HostTierTensor
from .params import DTYPE_NAMES, PlannedParams, state_view

__all__ = ["CudaState"]


class CudaState:
    """Allocated and filled synchronously at construction; times its phases into
    setup_times. steps: the engine's "step" mirror (float32 per slot), viewed by each slot's
    "step"."""

    def __init__(self, planned: PlannedParams, plan: Plan, entries: list[dict], kind: str,
                 state_dtype: torch.dtype, device: torch.device, steps: torch.Tensor,
                 setup_times: dict[str, float]):
        self.planned, self.kind, self.device, self.steps = planned, kind, device, steps
        self.setup_times = setup_times
        self.on_host = [pp["tier"] == "L2" for pp in entries]
        self.arena: DeviceArena | None = None
        self.host_arena: HostArena | None = None
        if plan.host_arena_bytes:  # a host too small fails before any allocation
            check_fits(plan.host_arena_bytes, pinned=True)
        if plan.device_arena_bytes:
            start = time.perf_counter()
            self.arena = DeviceArena(plan.device_arena_bytes, device.index)
            setup_times["device_arena"] = time.perf_counter() - start
        if plan.host_arena_bytes:  # locked: the prefix every copy touches
            self.host_arena = pinned_arena(
                plan.host_arena_bytes, setup_times,
                locked_bytes=plan.json["prediction"]["host_locked_bytes"])
        start = time.perf_counter()
        self.hidden: list[dict] = [{} for _ in entries]  # host-tier staging and fp32 masters
        self.views = [self._bind_views(i, s, pp, state_dtype)
                      for i, (s, pp) in enumerate(zip(planned.engine_slots, entries))]
        self.masters = [i for i in range(len(entries)) if self.master(i) is not None]
        # Per slot: the arena offset its host-tier state ends at (0: none), for
        # await_populated; None once the whole arena is resident. populated_to: known resident
        # below it (the locked prefix was populated before the arena was returned).
        arena = self.host_arena
        self.state_end: list[int] | None = None
        self.populated_to = 0
        if arena is not None and not arena.populated:
            self.state_end = [self._state_end(i) for i in range(len(entries))]
            self.populated_to = arena.locked_bytes
        setup_times["bind.views"] = time.perf_counter() - start
        start = time.perf_counter()
        self._fill_masters()
        self.versions = [p._version for p in planned.params]
        setup_times["bind.masters"] = time.perf_counter() - start

    def _bind_views(self, i: int, s, pp: dict, state_dtype) -> dict:
        p = s.param
        arena = self.host_arena if self.on_host[i] else self.arena
        views = {"step": self.steps[i],  # torch.optim's key order: step first
                 "exp_avg": state_view(arena, pp["exp_avg_offset"], p, state_dtype)}
        if self.kind != "lion":
            views["exp_avg_sq"] = state_view(arena, pp["exp_avg_sq_offset"], p, state_dtype)
        if p.dtype != torch.float32 or self.on_host[i]:
            master = state_view(arena, pp["master_offset"], p, torch.float32)
            if p.dtype != torch.float32:
                views["master"] = master
            else:
                self.hidden[i]["master"] = master
        if self.on_host[i]:
            self.hidden[i]["grad"] = state_view(arena, pp["grad_offset"], p, p.dtype)
        return views

    def _state_end(self, i: int) -> int:
        if not self.on_host[i] or self.planned.params[i].numel() == 0:
            return 0
        tensors = [t for k, t in self.views[i].items() if k != "step"]
        tensors += self.hidden[i].values()
        return max(self.host_arena.offset_of(t) + t.numel() * t.element_size()
                   for t in tensors)

    def master(self, i: int) -> torch.Tensor | None:
        return self.views[i].get("master", self.hidden[i].get("master"))

    def _staging(self, i: int) -> torch.Tensor | None:
        """The pinned gradient staging a host-tier 16-bit parameter's master is filled through
        (None: an fp32 or device-tier master, filled directly)."""
        if not self.on_host[i] or self.planned.params[i].dtype == torch.float32:
            return None
        return self.hidden[i]["grad"]

    def _fill_masters(self) -> None:
        """Every master = fp32(param): the copies down all enqueued first, each widened on the
        CPU as soon as its own has landed, so the DMA runs ahead of the conversion."""
        stream = torch.cuda.current_stream(self.device)
        landed = []  # (master, staging, event)
        with torch.no_grad():
            for i in self.masters:
                p, master, staging = self.planned.params[i], self.master(i), self._staging(i)
                if staging is None or p.numel() == 0:
                    # Converted on the device, or an fp32 host master in pinned memory: one DMA.
                    master.copy_(p, non_blocking=True)
                    continue
                staging.copy_(p, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                landed.append((master, staging, event))
            for master, staging, event in landed:
                event.synchronize()
                master.copy_(staging)
        stream.synchronize()

    def refresh_master(self, i: int) -> None:
        """Someone else wrote the parameter (emsa's raw writes leave _version alone): the
        master follows it, on the current stream, which is ordered after the last step's
        uploads by then, and before the slot's gradient is copied into the staging."""
        p, master, staging = self.planned.params[i], self.master(i), self._staging(i)
        with torch.no_grad():
            if staging is None or p.numel() == 0:
                master.copy_(p)  # on the device, or into pinned host memory: synchronous
            else:
                staging.copy_(p)  # synchronous: landed before the CPU widens it
                master.copy_(staging)
        self.versions[i] = p._version

    def refresh_stale(self, slots) -> None:
        """Before these slots' update: their host state resident, and the masters of parameters
        someone else wrote since refreshed (emsa's own writes leave _version)."""
        self.await_populated(slots)
        params = self.planned.params
        for j in slots:
            if params[j]._version != self.versions[j] and self.master(j) is not None:
                self.refresh_master(j)

    def await_populated(self, slots) -> None:
        """Waits until the host arena's background population has passed these slots' state;
        the seconds waited add up in setup_times["host_arena.populate_wait"]."""
        if self.state_end is None:
            return
        end = max((self.state_end[j] for j in slots), default=0)
        if end <= self.populated_to:
            return
        start = time.perf_counter()
        done = self.host_arena.wait_populated(end)
        self.populated_to = end
        times = self.setup_times
        times["host_arena.populate_wait"] = (times.get("host_arena.populate_wait", 0.0)
                                             + time.perf_counter() - start)
        if done:
            times["host_arena.populate"] = self.host_arena.times.get("host_arena.populate", 0.0)
            self.state_end = None

    def host_tensor(self, i: int, b: int, on_gpu: bool) -> HostTierTensor:
        """Slot i of host-tier bucket b as libemsa's host tier takes it (on_gpu: the GPU
        updates the bucket, its moments streamed up and back)."""
        p, v, h = self.planned.params[i], self.views[i], self.hidden[i]
        t = HostTierTensor()
        lib.emsa_host_tier_tensor_init(ctypes.byref(t))
        u = t.update
        u.param_dtype = u.grad_dtype = DTYPE[DTYPE_NAMES[p.dtype]]
        u.state_dtype = DTYPE[DTYPE_NAMES[v["exp_avg"].dtype]]
        # The parameter the CPU updates and the upload reads: an fp32 one's master, else the
        # rounded value, written over its gradient staging (each element read first), beside
        # its master.
        param = h["master"] if p.dtype == torch.float32 else h["grad"]
        u.param = param.data_ptr()
        u.master = v["master"].data_ptr() if p.dtype != torch.float32 else None
        u.grad = h["grad"].data_ptr()
        u.exp_avg = v["exp_avg"].data_ptr()
        u.exp_avg_sq = v["exp_avg_sq"].data_ptr() if "exp_avg_sq" in v else None
        u.numel = p.numel()
        t.group = self.planned.groups[i]
        t.bucket = b
        t.device_param = p.data_ptr()
        t.device_update = int(on_gpu)
        copied = [h["grad"], param] if param is not h["grad"] else [param]
        if on_gpu:  # its moments are streamed up and back
            copied += [v[k] for k in ("exp_avg", "exp_avg_sq") if k in v]
        self._check_locked(i, copied)
        return t

    def _check_locked(self, i: int, copied: list[torch.Tensor]) -> None:
        """Refuses a host-tier view a copy reads or writes that lies outside the arena's
        page-locked prefix: the host tier copies only from pinned memory."""
        arena = self.host_arena
        limit = arena.locked_bytes  # the plan's prefix (all of it on the cudaHostAlloc fallback)
        for t in copied:
            if t.numel() and arena.offset_of(t) + t.numel() * t.element_size() > limit:
                raise RuntimeError(
                    f"emsa internal error: the host tier would copy {self.planned.names[i]} "
                    f"from pageable memory (offset {arena.offset_of(t)} is past the "
                    f"{limit}-byte locked prefix of the host arena); please report it")

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()  # the state views keep the memory while torch holds them
