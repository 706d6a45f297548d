"""Which probe-record entry each planned parameter is, and the record to plan from.

Three ways to match, in order of preference: by identity (a record emsa.probe() made in this
process keeps weak references), by name (the optimizer got named_parameters()), by position
among the record's trainable parameters (shapes must agree). Record entries the optimizer does
not hold are planned as frozen, so no state is laid out for them.

Without a probe, the record is built at the first step from the parameters' shapes and the
gradient-ready order that hooks installed at construction saw in the first backward
(FirstBackwardRecorder). Forward order is then inferred as the reverse of it: backward visits
layers in the reverse of forward, which is what the planner needs to rank slack.

A DTensor parameter (FSDP2) is planned as its local shard (emsa._distributed.dtensor.local): its shape,
bytes and record entry are this rank's piece; hooks and names stay on the DTensor.
"""

from __future__ import annotations

import copy
import time
import weakref

import torch

from .._distributed.dtensor import local
from ..probe_record import ParamRecord, ProbeRecord
from .params import DTYPE_NAMES, Slot


class FirstBackwardRecorder:
    """Post-accumulate-grad hooks that note when each gradient became final, first time only.

    The hooks hold the recorder weakly, so they cost nothing once it is gone; remove() takes
    them off (the optimizer calls it when it plans)."""

    def __init__(self, params: list[torch.Tensor]):
        self.t0: float | None = None
        self.seen: dict[int, tuple[int, float]] = {}
        ref = weakref.ref(self)

        def hook(p, ref=ref):
            recorder = ref()
            if recorder is not None:
                recorder._ready(p)

        self.handles = [p.register_post_accumulate_grad_hook(hook) for p in params
                        if p.requires_grad and p.is_leaf]
        weakref.finalize(self, _remove_all, self.handles)

    def _ready(self, p: torch.Tensor) -> None:
        if id(p) in self.seen:
            return
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        self.seen[id(p)] = (len(self.seen), now - self.t0)

    def remove(self) -> None:
        _remove_all(self.handles)


def _remove_all(handles) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def _shape_entry(s: Slot, **given) -> ParamRecord:
    """The record entry of slot s from its (local) tensor alone: name, module, shape, dtype,
    bytes; the trainable flag and the orders as given."""
    p = local(s.param)
    return ParamRecord(
        name=s.name,
        module=s.name.rsplit(".", 1)[0] if "." in s.name else f"param_groups[{s.group}]",
        shape=list(p.shape), dtype=DTYPE_NAMES[p.dtype], numel=p.numel(),
        bytes=p.numel() * p.element_size(), use_count=1, **given)


def unprobed_record(slots: list[Slot], recorder: FirstBackwardRecorder | None,
                    frozen: list[Slot] = ()) -> ProbeRecord:
    """Entry i is slot i; the frozen parameters follow, marked not trainable (no state), so
    the planner still counts their bytes on the device."""
    seen = recorder.seen if recorder is not None else {}
    observed = len(seen)
    params = []
    for s in slots:
        order, t = seen.get(id(s.param), (-1, 0.0))
        params.append(_shape_entry(s, trainable=True,
                                   forward_order=observed - 1 - order if order >= 0 else -1,
                                   grad_ready_order=order, grad_ready_time=t))
    for s in frozen:
        params.append(_shape_entry(s, trainable=False, forward_order=-1, grad_ready_order=-1,
                                   grad_ready_time=0.0))
    backward = max((t for _, t in seen.values()), default=0.0)
    device = str(slots[0].param.device) if slots else "cpu"
    return ProbeRecord(model="(not probed: recorded by the optimizer's first backward)",
                       device=device, forward_time=0.0, backward_time=backward, params=params)


def match(slots: list[Slot], record: ProbeRecord) -> ProbeRecord:
    """Sets each slot's record_index; returns the record to plan (a copy, with entries the
    optimizer does not hold marked frozen). Raises ValueError saying what did not match."""
    if record.tensors is not None:
        by_id = {id(r()): i for i, r in enumerate(record.tensors) if r() is not None}
        for s in slots:
            s.record_index = by_id.get(id(s.param), -1)
        how = "the probed model's parameters"
    elif all(not s.name.startswith("param_groups[") for s in slots):
        by_name = {}
        for i, p in enumerate(record.params):
            for n in [p.name, *p.tied_names]:
                by_name[n] = i
        for s in slots:
            s.record_index = by_name.get(s.name, -1)
        how = "the probe record's parameter names"
    else:
        trainable = [i for i, p in enumerate(record.params) if p.trainable]
        if len(trainable) != len(slots):
            raise ValueError(
                f"the probe record has {len(trainable)} trainable parameters, the optimizer "
                f"{len(slots)}; pass model.named_parameters() to the optimizer so they can be "
                "matched by name, or probe the model whose parameters you pass")
        for s, i in zip(slots, trainable):
            s.record_index = i
        how = "position among the record's trainable parameters"
    for s in slots:
        if s.record_index < 0:
            raise ValueError(f"parameter {s.name} is not in the probe record (matched by {how}); "
                             "probe the model whose parameters you pass to the optimizer")
        rec = record.params[s.record_index]
        p = local(s.param)
        if list(p.shape) != list(rec.shape) or DTYPE_NAMES[p.dtype] != rec.dtype:
            raise ValueError(
                f"parameter {s.name} is {tuple(p.shape)} {p.dtype} but the probe "
                f"record's {rec.name!r} is {tuple(rec.shape)} {rec.dtype} (matched by {how}); "
                "probe the model again after changing it")
    held = {s.record_index for s in slots}
    if len(held) != len(slots):
        raise ValueError("two optimizer parameters matched one probe-record entry (matched by "
                         f"{how}); pass model.named_parameters() to the optimizer")
    planned = copy.deepcopy(ProbeRecord(**{k: v for k, v in vars(record).items()
                                           if k != "tensors"}))
    for i, p in enumerate(planned.params):
        p.trainable = i in held
        if not p.trainable:
            p.grad_ready_order = -1
    return planned
