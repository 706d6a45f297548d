"""What the CUDA engine learns about its gated steps after the fact.

HeaderRing. A gated step (non-finite check, clipping or a loss scale) decides on the GPU: a
step whose gradients hold inf/nan writes nothing and advances no step count, and the clip
coefficient is applied inside the update. The host is not told at once: after each gated step a
copy of the step header is enqueued into a pinned ring (RING slots) with an event, and the host
reads it once the event has completed, at a later step() (an event query, no waiting) or when
asked (last_step_skipped, last_grad_norm, state_dict wait). Until a skip is read, the "step"
counts in opt.state include it; reading it takes it back from the slots the step counted.
"""

from __future__ import annotations

import collections
import ctypes

import torch

from .._native.library import check, lib
from .._native.structs import DeviceStepHeader
from .engine import StepResult
from .step_counts import StepCounts

RING = 8  # gated steps whose headers may be in flight before step() waits for the oldest
HEADER = ctypes.sizeof(DeviceStepHeader)
_FOUND_INF = DeviceStepHeader.found_inf.offset // 4  # as an int32 index
_NONFINITE = DeviceStepHeader.nonfinite_count.offset // 8  # as an int64 index
_GRAD_NORM = DeviceStepHeader.grad_norm.offset // 8  # as a float64 index
_CLIP_COEF = DeviceStepHeader.clip_coef.offset // 4  # as a float32 index


class HeaderRing:
    """The pinned ring of step headers. counts: the engine's "step" mirror (StepCounts), from
    which a skipped step's counts are taken back."""

    def __init__(self, counts: StepCounts):
        self.counts = counts
        self.steps = counts.tensor
        self.ring = torch.zeros((RING, HEADER), dtype=torch.uint8, pin_memory=True)
        self.events = [torch.cuda.Event() for _ in range(RING)]
        self.found = self.ring.view(torch.int32)[:, _FOUND_INF]
        self.nonfinite = self.ring.view(torch.int64)[:, _NONFINITE]
        self.norm = self.ring.view(torch.float64)[:, _GRAD_NORM]
        self.coef = self.ring.view(torch.float32)[:, _CLIP_COEF]
        # (ring slot, step() call or pass, the slots the step counted: a 0/1 float32 tensor, or
        # None for every slot)
        self.pending: collections.deque = collections.deque()
        self.recorded = 0  # headers copied so far; the ring slot is recorded % RING
        self.skips: list[StepResult] = []
        self.last_skipped_call = 0
        self.last_norm: float | None = None
        self.clips = 0  # steps read so far whose clip coefficient was < 1
        self.norms: dict[int, tuple[float, bool]] = {}  # call -> (grad_norm, clipped), unread

    def record(self, scalars, stream: torch.cuda.Stream, call: int,
               counted: torch.Tensor | None) -> None:
        """After the step's statistics are finished on `stream`: a copy of its header."""
        while len(self.pending) >= RING:
            self._read_oldest(wait=True)
        slot = self.recorded % RING  # consecutive records take consecutive slots: FIFO holds
        self.recorded += 1
        dst = self.ring.data_ptr() + slot * HEADER
        check(lib.emsa_device_scalars_copy_header(scalars, dst, stream.cuda_stream))
        self.events[slot].record(stream)
        self.pending.append((slot, call, counted))

    def _read_oldest(self, wait: bool, count_steps: bool = True) -> bool:
        slot, call, counted = self.pending[0]
        event = self.events[slot]
        if not wait and not event.query():
            return False
        event.synchronize()
        self.pending.popleft()
        norm = float(self.norm[slot])
        if int(self.found[slot]) != 0:
            self.skips.append(StepResult(True, int(self.nonfinite[slot]), "", call,
                                         grad_norm=norm, clipped=False))
            self.last_skipped_call = call
            self.norms[call] = (norm, False)
            if count_steps:  # the host counted it when it was enqueued
                self.steps.sub_(1.0 if counted is None else counted)
                self.counts.written()
        else:
            clipped = float(self.coef[slot]) < 1.0
            self.clips += int(clipped)
            self.norms[call] = (norm, clipped)
        self.last_norm = norm
        return True

    def poll(self, wait: bool, count_steps: bool = True) -> None:
        while self.pending and self._read_oldest(wait, count_steps):
            pass

    def finished_skips(self) -> list[StepResult]:
        found, self.skips = self.skips, []
        return found

    def take_norms(self) -> dict[int, tuple[float, bool]]:
        found, self.norms = self.norms, {}
        return found


def counted_mask(present: list[int], count: int) -> torch.Tensor | None:
    """The slots a step counted as a 0/1 float32 tensor; None when it counted every slot."""
    if len(present) == count:
        return None
    mask = torch.zeros(count, dtype=torch.float32)
    if present:
        mask[torch.tensor(present, dtype=torch.int64)] = 1.0
    return mask


class StepClock:
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
