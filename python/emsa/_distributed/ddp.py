"""step_in_backward under DistributedDataParallel: updates from DDP's communication hook.

emsa's own gradient hooks fire before DDP has averaged a gradient, so here DDP's comm hook
drives the pass: per DDP bucket it averages and all-reduces (as DDP's default hook), and once
the all-reduce is done hands the bucket's parameters to the optimizer's in-backward path with
.grad pointing at the averaged gradient. On CUDA the updates are enqueued on a side stream that
waits for the all-reduce; on gloo a bucket is taken at the next hook call that finds it done.
The end of backward, after DDP's own finalize, handles unused parameters and ends emsa's pass.
Under ddp_model.no_sync() nothing updates and .grad accumulates (accumulate= stays 1). Another
comm hook (fp16 compression, PowerSGD) cannot be combined with ddp=. Details: docs/internals.md.
"""

from __future__ import annotations

import collections
import contextlib
import weakref

import torch
import torch.distributed as dist


class DdpUpdates:
    def __init__(self, passes, ddp):
        """passes: the optimizer's in-backward passes (emsa._engine.passes.Passes), held
        weakly; their own hooks are removed, DDP's buckets drive them instead."""
        slots = passes.binding.planned.slots
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        reduced = {id(p) for name, p in ddp.module.named_parameters()
                   if p.requires_grad and name not in ignored}
        missing = [s.name for s in slots if id(s.param) not in reduced]
        if missing:
            raise ValueError(
                f"ddp=: {', '.join(missing[:3])}{' and more' if len(missing) > 3 else ''} "
                "are not among the DDP model's reduced parameters (another module's, or "
                "ignored by DDP), so no DDP bucket would ever hand them to emsa: build the "
                "optimizer over the DDP model's parameters (ddp_model.parameters())")
        if getattr(ddp, "_comm_hooks", None) or getattr(ddp, "_emsa_updates", None):
            raise ValueError("ddp=: this DDP model already has a communication hook; DDP takes "
                             "one, and emsa's averages like DDP's default: drop the other hook, "
                             "or build one emsa optimizer over all the model's parameters")
        self.passes = weakref.ref(passes)
        self.group = ddp.process_group
        self.size = dist.get_world_size(self.group)
        self.params = [s.param for s in slots]
        self.slot_of = {id(s.param): i for i, s in enumerate(slots)}
        self.pending: collections.deque = collections.deque()  # (future, [(slot, averaged)])
        self.unused: list[int] = []  # slots with no local gradient this pass
        self.consumed: list[int] = []  # slots updated from (their .grad set to None)
        self.in_pass = False
        self.early = 0  # buckets updated from within backward, before its end (for tests)
        device = self.params[0].device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        passes.remove_hooks()  # local gradients are not final under DDP: the buckets drive
        ddp.register_comm_hook(self, _comm_hook)
        ddp._emsa_updates = self

    # ---- in backward ----------------------------------------------------------------------
    def reduced(self, passes, bucket, future) -> None:
        """A bucket's all-reduce is under way (its gradients are in the bucket)."""
        if not self.in_pass:
            self.in_pass = True
            # DDP queues its finalize when its last bucket is ready, after this: a callback
            # queued by this callback runs after DDP's.
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(self._end_of_backward))
            if not passes.is_open:
                try:
                    passes.open_pass()
                except BaseException:
                    self._reset()
                    passes.abandon_pass()
                    raise
        entries = []
        for p, averaged in zip(bucket.parameters(), bucket.gradients()):
            i = self.slot_of.get(id(p))
            if i is None:
                continue  # a parameter DDP reduces for another optimizer
            if p.grad is None:
                self.unused.append(i)  # decided at the end: did any rank use it?
            else:
                entries.append((i, averaged))
        self.pending.append((future, entries))
        self._drain(passes, wait=False)

    def _drain(self, passes, wait: bool) -> None:
        """Updates from every bucket whose all-reduce is done (all of them with wait)."""
        with self._on_side():
            while self.pending:
                future, entries = self.pending[0]
                if not wait and not future.done():
                    return
                self.pending.popleft()
                self.early += not wait
                future.wait()  # CUDA: the side stream waits for the all-reduce's events
                for i, averaged in entries:
                    self._update(passes, i, averaged)

    def _update(self, passes, i: int, grad: torch.Tensor) -> None:
        p = self.params[i]
        p.grad = grad
        passes.grad_ready(i)
        if p.grad is None:
            self.consumed.append(i)

    def _end_of_backward(self) -> None:
        passes = self.passes()
        try:
            if passes is None or not passes.is_open:
                return
            if self.side is not None:  # DDP's finalize wrote .grad on the compute stream
                self.side.wait_stream(torch.cuda.current_stream(self.side.device))
            self._drain(passes, wait=True)
            with self._on_side():
                for i in self.unused:
                    g = self.params[i].grad
                    if g is not None:  # another rank used it: DDP wrote the average
                        self._update(passes, i, g)
            for i in self.consumed:
                self.params[i].grad = None  # DDP's finalize wrote it back; already updated
            if self.side is not None:  # the next forward reads what the side stream wrote
                torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            passes.close_current()  # the optimizer's end of the pass (end_pass)
        except BaseException:
            if passes is not None:
                passes.abandon_pass()
            raise
        finally:
            self._reset()

    def _on_side(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def _reset(self) -> None:
        self.in_pass = False
        self.pending.clear()
        self.unused.clear()
        self.consumed.clear()


def _comm_hook(state, bucket):  # no annotations: DDP compares them with its own types
    """DDP's default reduction (average: divide, then sum), and emsa's updates once done."""
    buffer = bucket.buffer()
    buffer.div_(state.size)
    future = dist.all_reduce(buffer, group=state.group, async_op=True).get_future()
    passes = state.passes()
    if passes is not None:
        state.reduced(passes, bucket, future)
    return future.then(lambda f: f.value()[0])
