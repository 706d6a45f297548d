"""Step in backward on CUDA: the passes of CudaBackend (emsa._cuda_backend), a mixin that uses
the engine's tables, scalars, host tier and header ring.

A pass is one backward() call of an updating pass. begin_pass reads the hyperparameters and the
gating attributes; step_bucket(b) runs as each bucket's gradients become final; end_pass, from
the autograd engine callback, finishes it. Per bucket:
  - ungated, device tier: the bucket's table updates at once (emsa_device_table_update), each
    present tensor stepping its own count; the gradients are consumed.
  - ungated, host tier: the bucket is submitted (copies paced to the CPU's progress).
  - gated, device tier: the bucket's sums are added to the step header and its gradients kept
    (step_bucket returns False); end_pass finishes the statistics and updates every device-tier
    bucket in one launch over the step table (emsa_device_finish_step).
  - gated, host tier: the bucket's sums are added, then it is submitted (its copies enqueued
    whole at once, so its device gradients are freed as they land); the host tier's updates
    wait for the release end_pass gives after the finish.
Buckets that never completed in the pass (a member got no gradient) are done by end_pass with
the gradients there are, absent members skipped. A pass that never reached end_pass (its
backward raised) is discarded at the next begin_pass: a gated one updated nothing (its host-tier
step is released as skipped), an ungated one keeps what step_bucket updated.
"""

from __future__ import annotations

import contextlib

import torch

from ._capi import check, lib
from ._cuda_stats import counted_mask
from ._distributed import reduce_device_stats


def on(index: int):
    """torch's and libemsa's current device set to `index` (emsa checks it on every call)."""
    if torch.cuda.current_device() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def ptr(g: torch.Tensor | None) -> int | None:
    """A gradient's address for a table; None (NULL) for an absent one."""
    return None if g is None else g.data_ptr()


class Pass:
    """One in-backward pass: what it updated and, gated, what waits for its end."""

    def __init__(self, gated: bool, found_inf_out: torch.Tensor | None, count: int):
        self.gated = gated
        self.found_inf_out = found_inf_out
        self.stepped: set[int] = set()  # buckets done by step_bucket or end_pass
        self.present: list[int] = []  # slots with a gradient in the pass
        self.ptrs: list[int | None] = [None] * count  # gated: device-tier gradients, as read
        self.keep: list[torch.Tensor] = []  # gated: those gradients (copies included), till end
        self.streams: set[int] = set()  # gated: the streams that summed them


class InBackward:
    steps_in_backward = True

    def begin_pass(self, param_groups: list[dict]) -> None:
        self._check_groups(param_groups)
        with on(self.index):
            if self.pass_ is not None:
                self._discard_pass()
            stream = torch.cuda.current_stream(self.device)
            self._follow(stream)
            handle = stream.cuda_stream
            self.step_times.tick(stream)
            self._send_hyper(param_groups, handle)
            gated = self.gated()
            if self.host is not None:
                self._claim_unwaited(stream)
                self.host.begin_step(self.hyper, gated)
            self.pass_ = Pass(gated, self.found_inf_out, len(self.params))  # open from here
            if gated:
                self._set_inputs(float(self.max_norm or 0.0), self.loss_scale, stream)
                check(lib.emsa_device_begin_step(self.scalars, handle))
            else:
                # Begun and finished without statistics: multiplier 1, found_inf 0; each
                # table's update then advances its own tensors' counts.
                self._set_inputs(0.0, None, stream)
                check(lib.emsa_device_step(self.scalars, self.step_array, 0, 0, handle))
            self.calls += 1
            self.noop_last = False
            self.last_stream = stream

    def _discard_pass(self) -> None:
        """The last pass never reached end_pass: a gated one applied nothing (its host-tier
        step gets no verdict), an ungated one keeps what step_bucket updated."""
        self.pass_ = None
        if self.host is not None:
            self.host.discard()

    def step_bucket(self, b: int) -> bool:
        p = self.pass_
        if p is None:
            raise RuntimeError("emsa internal error: step_bucket outside a pass; please report "
                               "it")
        with on(self.index):
            return self._bucket_in_pass(p, b)

    def _bucket_in_pass(self, p: Pass, b: int) -> bool:
        """Bucket b in pass p, from the gradients its members have now (None: absent); True if
        they were consumed."""
        host, t = self.order[b]
        members = self.buckets[b]
        grads = self._bucket_grads(members)
        p.stepped.add(b)
        present = [i for i, g in zip(members, grads) if g is not None]
        if not present:
            return True
        stream = torch.cuda.current_stream(self.device)
        self._follow(stream)
        handle = stream.cuda_stream
        consumed = True
        if host:
            self._refresh_stale_masters(members)  # the tier is idle: begin_step waited for it
            if p.gated:
                self._point_table(self.stats_table[t], [ptr(g) for g in grads], handle)
                self._accumulate(self.stats_table[t], handle)
            self.host.submit(t, grads, stream)
        elif p.gated:
            self._point_table(t, [ptr(g) for g in grads], handle)
            self._accumulate(t, handle)
            for i, g in zip(members, grads):
                p.ptrs[i] = ptr(g)
            p.keep.extend(g for g in grads if g is not None)
            p.streams.add(handle)
            consumed = False
        else:
            self._point_table(t, [ptr(g) for g in grads], handle)
            self._refresh_stale_masters(members)
            check(lib.emsa_device_table_update(self.tables[t], self.scalars, handle))
        p.present.extend(present)
        if not p.gated:  # counted now: nothing can take it back
            self.steps[torch.tensor(present, dtype=torch.int64)] += 1.0
        self.last_stream = stream
        return consumed

    def end_pass(self) -> None:
        p, self.pass_ = self.pass_, None
        if p is None:
            return
        with on(self.index):
            for b in range(len(self.order)):
                if b not in p.stepped:  # incomplete in this pass: what it has
                    self._bucket_in_pass(p, b)
            if p.gated:
                self._finish_pass(p)

    def _finish_pass(self, p: Pass) -> None:
        """The verdict of a gated pass: the finish and the device tier's one launch on the
        current stream, the host tier's release, found_inf_out, the header for the host."""
        stream = torch.cuda.current_stream(self.device)
        self._follow(stream)
        handle = stream.cuda_stream
        ptrs = [p.ptrs[i] for i in self.step_members]
        device = int(any(q is not None for q in ptrs))
        if device:
            self._point_table(self.step_table, ptrs, handle)
            self._refresh_stale_masters([i for i in self.step_members if p.ptrs[i] is not None])
        reduce_device_stats(self)  # norm_group: every rank's sums, before the finish
        check(lib.emsa_device_finish_step(self.scalars, self.step_array, device, handle))
        self._write_found_inf(p.found_inf_out, stream)
        if self.host is not None:
            self.host.release(self.scalars, stream)
        if p.streams - {handle}:  # summed on another stream: freed only after this update too
            for g in p.keep:
                g.record_stream(stream)
        counted = counted_mask(p.present, len(self.params))
        self.steps.add_(1.0 if counted is None else counted)  # taken back if skipped
        self.headers.record(self.scalars, stream, self.calls, counted)
        self.last_stream = stream
