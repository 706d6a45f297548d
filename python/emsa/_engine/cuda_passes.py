"""Step in backward on CUDA: the passes of the CUDA engine (emsa._engine.cuda), a part it owns
that drives its kernels, state and host tier.

A pass is one backward() call of an updating pass. begin reads the hyperparameters and the gate;
bucket(b) runs as each bucket's gradients become final; end, from the autograd engine callback,
finishes it. Per bucket:
  - ungated, device tier: the bucket's table updates at once, each present tensor stepping its
    own count; the gradients are consumed.
  - ungated, host tier: the bucket is submitted (copies paced to the CPU's progress).
  - gated, device tier: the bucket's sums are added to the step header and its gradients kept
    (bucket returns False); end finishes the statistics and updates every device-tier bucket
    in one launch over step()'s table.
  - gated, host tier: the bucket's sums are added, then it is submitted (its copies enqueued
    whole at once, so its device gradients are freed as they land); the host tier's updates
    wait for the release end gives after the finish.
Buckets that never completed in the pass (a member got no gradient) are done by end with the
gradients there are, absent members skipped. A pass that never reached end (its backward
raised) is discarded at the next begin: a gated one updated nothing (its host-tier step is
released as skipped), an ungated one keeps what bucket updated.
"""

from __future__ import annotations

import torch

from .cuda_kernels import ptr
from .cuda_stats import counted_mask
from .engine import Gate

__all__ = ["CudaPasses"]


class Pass:
    """One in-backward pass: what it updated and, gated, what waits for its end."""

    def __init__(self, gate: Gate, count: int):
        self.gated = gate.gated
        self.found_inf_out = gate.found_inf_out
        self.stepped: set[int] = set()  # buckets done by bucket() or end()
        self.present: list[int] = []  # slots with a gradient in the pass
        self.ptrs: list[int | None] = [None] * count  # gated: device-tier gradients, as read
        self.keep: list[torch.Tensor] = []  # gated: those gradients (copies included), till end
        self.streams: set[int] = set()  # gated: the streams that summed them


class CudaPasses:
    def __init__(self, engine):
        self.engine = engine  # the owner, whose parts the passes use
        self.current: Pass | None = None

    def begin(self, param_groups: list[dict], gate: Gate) -> None:
        e = self.engine
        if self.current is not None:
            self.discard()
        stream = torch.cuda.current_stream(e.device)
        e.follow(stream)
        handle = stream.cuda_stream
        e.clock.tick(stream)
        e.kernels.send_hyper(param_groups, handle)
        if e.host is not None:
            e.claim_unwaited(stream)
            e.host.begin_step(e.kernels.hyper, gate.gated)
        self.current = Pass(gate, len(e.planned))  # open from here
        if gate.gated:
            e.kernels.set_inputs(float(gate.max_norm or 0.0), gate.loss_scale, stream)
            e.kernels.begin(handle)
        else:
            # Begun and finished without statistics: multiplier 1, found_inf 0; each table's
            # update then advances its own tensors' counts.
            e.kernels.set_inputs(0.0, None, stream)
            e.kernels.step(0, 0, handle)
        e.calls += 1
        e.noop_last = False
        e.last_stream = stream

    def discard(self) -> None:
        """The last pass never reached end: a gated one applied nothing (its host-tier step
        gets no verdict), an ungated one keeps what bucket() updated."""
        self.current = None
        if self.engine.host is not None:
            self.engine.host.discard()

    def bucket(self, b: int) -> bool:
        p = self.current
        if p is None:
            raise RuntimeError("emsa internal error: step_bucket outside a pass; please report "
                               "it")
        return self._bucket_in_pass(p, b)

    def _bucket_in_pass(self, p: Pass, b: int) -> bool:
        """Bucket b in pass p, from the gradients its members have now (None: absent); True if
        they were consumed."""
        e = self.engine
        host, t = e.buckets.order[b]
        members = e.buckets.all[b]
        grads = e.bucket_grads(members)
        p.stepped.add(b)
        present = [i for i, g in zip(members, grads) if g is not None]
        if not present:
            return True
        stream = torch.cuda.current_stream(e.device)
        e.follow(stream)
        handle = stream.cuda_stream
        consumed = True
        kernels = e.kernels
        if host:
            e.memory.refresh_stale(members)  # the tier is idle: begin_step waited for it
            if p.gated:
                kernels.point(kernels.stats_table[t], [ptr(g) for g in grads], handle)
                kernels.accumulate(kernels.stats_table[t], handle)
            e.host.submit(t, grads, stream)
        elif p.gated:
            kernels.point(t, [ptr(g) for g in grads], handle)
            kernels.accumulate(t, handle)
            for i, g in zip(members, grads):
                p.ptrs[i] = ptr(g)
            p.keep.extend(g for g in grads if g is not None)
            p.streams.add(handle)
            consumed = False
        else:
            kernels.point(t, [ptr(g) for g in grads], handle)
            e.memory.refresh_stale(members)
            kernels.update(t, handle)
        p.present.extend(present)
        if not p.gated:  # counted now: nothing can take it back
            e.steps[torch.tensor(present, dtype=torch.int64)] += 1.0
            e.counts.written()
        e.last_stream = stream
        return consumed

    def end(self) -> None:
        p, self.current = self.current, None
        if p is None:
            return
        for b in range(len(self.engine.buckets.order)):
            if b not in p.stepped:  # incomplete in this pass: what it has
                self._bucket_in_pass(p, b)
        if p.gated:
            self._finish(p)

    def _finish(self, p: Pass) -> None:
        """The verdict of a gated pass: the finish and the device tier's one launch on the
        current stream, the host tier's release, found_inf_out, the header for the host."""
        e = self.engine
        kernels = e.kernels
        stream = torch.cuda.current_stream(e.device)
        e.follow(stream)
        handle = stream.cuda_stream
        ptrs = [p.ptrs[i] for i in e.buckets.step_members]
        device = int(any(q is not None for q in ptrs))
        if device:
            kernels.point(kernels.step_table, ptrs, handle)
            e.memory.refresh_stale([i for i in e.buckets.step_members if p.ptrs[i] is not None])
        kernels.reduce_stats()  # norm group: every rank's sums, before the finish
        kernels.finish(device, handle)
        kernels.write_found_inf(p.found_inf_out, stream)
        if e.host is not None:
            e.host.release(kernels.scalars, stream)
        if p.streams - {handle}:  # summed on another stream: freed only after this update too
            for g in p.keep:
                g.record_stream(stream)
        counted = counted_mask(p.present, len(e.planned))
        e.steps.add_(1.0 if counted is None else counted)  # taken back if skipped
        e.counts.written()
        e.headers.record(kernels.scalars, stream, e.calls, counted)
        e.last_stream = stream
