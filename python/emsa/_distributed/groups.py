"""emsa under torch.distributed: which ranks share what, set up once per optimizer.

emsa builds no communication layer of its own; everything here is a torch.distributed collective
on a group the user's setup already has.

Three questions, answered at construction (configure) and at planning (agreed_plan):
  - Whose gradients does the norm cover? `opt._norm_group` (the keyword process_group=): None
    means this rank's gradients are the whole model's (one process, or DDP, whose gradients are
    averaged and so identical on every rank); a group means each rank holds part of the
    parameters (ZeroRedundancyOptimizer's partitions, FSDP2's shards), so the step's summed
    squared norm and non-finite count are all-reduced (SUM) over it before the clip coefficient
    and the skip verdict: every rank clips by the global norm and skips together. Built by
    ZeroRedundancyOptimizer, emsa takes its process_group; for DTensor parameters the mesh's
    group (emsa._dtensor.norm_group) unless one is named.
  - Which ranks must plan alike? Replicas (DDP, or any rank set holding the same parameters)
    must lay state out identically, or the same update could run on a device on one rank and
    on the CPU on another and the replicas drift apart: the planned layouts are compared once
    (agree_on_plan) and a mismatch is refused on every rank. Partitions (ZeRO, DTensor shards)
    plan their own parameters and are not compared.
  - Are gradients final when emsa's hooks see them? With step_in_backward=True the update runs
    from the gradient hooks, before DDP's all-reduce: under torch.distributed with world size >
    1 emsa refuses (at construction, or at the first backward if the process group came later)
    unless ddp=ddp_model is given (emsa then updates from DDP's communication hook, once each
    bucket's all-reduce is done: emsa._ddp) or ddp=False says that this rank's gradients are
    its own (nothing reduces them).
"""

from __future__ import annotations

import collections
import ctypes
import json
import sys
import weakref

import torch
import torch.distributed as dist

from ._capi import DeviceStepHeader, check, lib


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_dtensor(p: torch.Tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before its import
    return module is not None and isinstance(p, module.DTensor)


def _zero_building():
    """The ZeroRedundancyOptimizer whose _init_local_optimizer is constructing the optimizer
    now, if any (it sets process_group before building its local optimizer, and takes the
    keyword process_group= for itself, so emsa cannot be handed the group by keyword)."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:
        return None
    code = ZeroRedundancyOptimizer._init_local_optimizer.__code__
    frame = sys._getframe(1)
    for _ in range(12):  # the optimizer's own constructors, a user subclass or two
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


_DDP_UNKNOWN = (
    "emsa: step_in_backward=True updates each parameter from its gradient hook, but "
    "torch.distributed is initialized with world size {n}, and gradient reduction (DDP's "
    "all-reduce) happens after those hooks: each rank would update from its own local "
    "gradient, silently wrong. Wrap the model in DistributedDataParallel first and pass "
    "ddp=ddp_model (emsa then updates from DDP's averaged gradients, in its communication "
    "hook); or pass ddp=False if each rank trains its own parameters and nothing reduces "
    "their gradients; or use step_in_backward=False (DDP then works as with torch.optim).")


def configure(opt, process_group, ddp) -> None:
    """Constructor, before planning: the norm group, the replicas, the refusals."""
    opt._ddp = None  # the emsa._ddp.DdpUpdates driving in-backward updates, once attached
    opt._ddp_model = None
    opt._zero = None
    params = opt._all_params()
    sharded = any(_is_dtensor(p) for p in params)
    zero = _zero_building() if initialized() else None
    if ddp is not None and ddp is not False:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"ddp= takes the DistributedDataParallel module whose parameters "
                            f"this optimizer holds, or False, not {type(ddp).__name__}")
        if process_group is not None:
            raise ValueError(
                "process_group= names the ranks that each hold part of the parameters (for the "
                "global gradient norm); under DDP every rank holds all of them and its averaged "
                "gradients, so the local norm is the global one: drop process_group=")
        if opt._in_backward and opt._accumulate != 1:
            raise ValueError(
                f"accumulate={opt._accumulate} with ddp=: accumulate with ddp_model.no_sync() "
                "instead (backward passes under no_sync() reduce nothing, so emsa updates "
                "nothing and .grad accumulates; the next synchronized backward updates)")
        opt._ddp_model = ddp
    if zero is not None:
        if opt._in_backward:
            raise ValueError(
                "ZeroRedundancyOptimizer steps its local optimizer after backward; "
                "step_in_backward=True would update each rank's partition from local gradients "
                "during backward: use step_in_backward=False under ZeroRedundancyOptimizer")
        opt._zero = weakref.ref(zero)
        if process_group is None:
            process_group = zero.process_group
    if process_group is None and sharded:
        try:
            from . import _dtensor
        except ImportError:
            _dtensor = None
        if _dtensor is not None and hasattr(_dtensor, "norm_group"):
            process_group = _dtensor.norm_group(params)
    if process_group is None and any(getattr(p, "_is_flat_param", False) for p in params):
        raise ValueError(
            "these are FullyShardedDataParallel's flat parameters: each rank holds a shard, "
            "so emsa's gradient norm and non-finite check would see only this rank's part. "
            "Pass process_group=<FSDP's process group> (the norm is then summed over it), or "
            "shard with FSDP2 (torch.distributed.fsdp.fully_shard)")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError("process_group= takes a torch.distributed ProcessGroup (e.g. "
                        f"dist.group.WORLD), not {type(process_group).__name__}")
    opt._norm_group = process_group
    # Replicas hold the same parameters: their plans must agree. Partitions plan their own.
    if ddp is False or zero is not None or sharded or process_group is not None:
        opt._replicas = None
    elif opt._ddp_model is not None:
        opt._replicas = opt._ddp_model.process_group
    else:
        opt._replicas = dist.group.WORLD if initialized() else None
    opt._gradients_local = ddp is False or sharded
    if opt._in_backward and ddp is None:
        check_first_pass(opt)


def check_first_pass(opt) -> None:
    """step_in_backward: refuses before any update when gradients would be reduced after the
    hooks used them (also run at the first backward: the process group may be newer than the
    optimizer)."""
    if opt._ddp_model is not None or opt._gradients_local or not initialized():
        return
    n = dist.get_world_size()
    if n > 1:
        opt.remove_hooks()
        raise RuntimeError(_DDP_UNKNOWN.format(n=n))


def attach(opt) -> None:
    """Constructor, after planning: ddp= in backward installs the communication hook; under
    ZeroRedundancyOptimizer, state it assigns (its load_state_dict) is taken into emsa's."""
    if opt._zero is not None:
        if opt._backend is None:
            opt._bind(None)  # ZeRO may load state before the first step: it needs a home
        opt.state = AssignedState(opt, opt.state)
    if opt._ddp_model is not None and opt._in_backward:
        from ._ddp import DdpUpdates

        opt._ddp = DdpUpdates(opt, opt._ddp_model)


# ---- plan agreement ------------------------------------------------------------------------
def _layout(plan: dict) -> list:
    """What must agree between replicas: every parameter's tier, state and place, the
    buckets. Budget and predictions may differ (each GPU's free memory)."""
    keys = ("tier", "state_dtype", "master_weights", "bucket", "device_update",
            "exp_avg_offset", "exp_avg_sq_offset", "master_offset", "grad_offset")
    return ([[pp.get(k) for k in keys] for pp in plan["params"]],
            [[b.get("tier"), b.get("params")] for b in plan["buckets"]])


def _difference(ref: dict, other: dict, rank: int) -> str:
    """Why rank `rank`'s plan cannot stand beside rank 0's, or ""."""
    a, b = ref["params"], other["params"]
    if len(a) != len(b):
        return (f"rank {rank} holds {len(b)} parameters, rank 0 {len(a)}: every replica must "
                "build the optimizer over the same parameters")
    for k, (x, y) in enumerate(zip(a, b)):
        if (x["numel"], x["param_dtype"]) != (y["numel"], y["param_dtype"]):
            return (f"parameter {k} ({y['name']}) has {y['numel']} elements of "
                    f"{y['param_dtype']} on rank {rank}, {x['numel']} of {x['param_dtype']} "
                    "on rank 0: every replica must build the optimizer over the same "
                    "parameters (the same model, unsharded, in the same order)")
    if _layout(ref) != _layout(other):
        first = next((y["name"] for x, y in zip(a, b) if x.get("tier") != y.get("tier")), None)
        where = f" (e.g. {first}: {a[[p['name'] for p in b].index(first)]['tier']} on rank 0)" \
            if first else ""
        return (f"rank {rank} planned another state layout than rank 0{where}: the same "
                "update could then run on the device on one rank and on the CPU on another, "
                "and the replicas drift apart. Give every rank the same budget= (the default "
                "is each GPU's own free memory), tier= and profile=")
    return ""


def agree_on_plan(plan_json: str, group) -> str:
    """Every rank of `group` returns rank 0's plan. emsa binds only plans it made itself (the C
    planner owns the handle), so each rank plans and the layouts are compared: every rank sees
    every plan (one all_gather) and every rank raises the same error on a mismatch (different
    parameter shapes, or another layout), so none goes on to a step the others do not take."""
    size = dist.get_world_size(group)
    texts: list = [None] * size
    dist.all_gather_object(texts, plan_json, group=group)
    ref = json.loads(texts[0])
    for rank in range(1, size):
        why = _difference(ref, json.loads(texts[rank]), rank)
        if why:
            raise RuntimeError(f"emsa: the ranks' plans disagree: {why}")
    return texts[0]


def agreed_plan(opt, plan):
    """The plan after the replicas compared theirs (see agree_on_plan); raises on a mismatch."""
    if opt._replicas is not None:
        agree_on_plan(plan.text, opt._replicas)
    return plan


# ---- the norm and the non-finite count over a group ------------------------------------------
def reduce_host_stats(backend, sum_sq: float, nonfinite: int) -> tuple[float, int]:
    """CPU engine: (sum of squares, non-finite count) summed over backend.norm_group."""
    buf = backend.__dict__.get("group_stats")
    if buf is None:
        buf = backend.group_stats = torch.zeros(2, dtype=torch.float64)
    buf[0] = sum_sq
    buf[1] = float(nonfinite)  # exact below 2**53 elements
    dist.all_reduce(buf, group=backend.norm_group)
    return float(buf[0]), int(buf[1])


class _DeviceMemory:
    """A device address as __cuda_array_interface__, for torch.as_tensor (no copy)."""

    def __init__(self, address: int, typestr: str):
        self.__cuda_array_interface__ = {"shape": (1,), "typestr": typestr,
                                         "data": (address, False), "version": 2}


class DeviceStats:
    """The CUDA step header's sum_sq and nonfinite_count as torch tensors on the device, and a
    float64 pair they are summed in (one all-reduce for both)."""

    def __init__(self, scalars, device: torch.device):
        header = ctypes.c_void_p()
        check(lib.emsa_device_scalars_header_address(scalars, ctypes.byref(header)))
        with torch.cuda.device(device):
            self.sum_sq = torch.as_tensor(
                _DeviceMemory(header.value + DeviceStepHeader.sum_sq.offset, "<f8"),
                device=device)
            self.nonfinite = torch.as_tensor(
                _DeviceMemory(header.value + DeviceStepHeader.nonfinite_count.offset, "<i8"),
                device=device)
        if (self.sum_sq.data_ptr(), self.nonfinite.data_ptr()) != (
                header.value + DeviceStepHeader.sum_sq.offset,
                header.value + DeviceStepHeader.nonfinite_count.offset):
            raise RuntimeError("emsa internal error: torch copied the step header instead of "
                               "viewing it, so the norm could not be summed over the ranks; "
                               "please report it")
        self.pair = torch.zeros(2, dtype=torch.float64, device=device)

    def all_reduce(self, group) -> None:
        """On the current stream (the step's), after accumulate_stats and before finish_stats:
        no host synchronization (NCCL's stream waits for this one and this one for it)."""
        self.pair[:1].copy_(self.sum_sq)
        self.pair[1:].copy_(self.nonfinite)  # exact below 2**53 elements
        dist.all_reduce(self.pair, group=group)
        self.sum_sq.copy_(self.pair[:1])
        self.nonfinite.copy_(self.pair[1:])

    def contribute_nothing(self, group) -> None:
        """A rank with no gradient this step still takes part: the others wait for it."""
        self.pair.zero_()
        dist.all_reduce(self.pair, group=group)


def reduce_device_stats(backend, nothing: bool = False) -> None:
    """CUDA engine, with a norm group: between the step's last accumulate_stats and its finish,
    on the current stream, the header's sums over the group's ranks. nothing: this rank has no
    gradient in a gated step (it still takes part; its header is untouched)."""
    if backend.norm_group is None or (nothing and not backend.gated()):
        return
    stats = backend.__dict__.get("group_stats")
    if stats is None:
        stats = backend.group_stats = DeviceStats(backend.scalars, backend.device)
    if nothing:
        stats.contribute_nothing(backend.norm_group)
    else:
        stats.all_reduce(backend.norm_group)


# ---- ZeroRedundancyOptimizer: state assigned from outside -----------------------------------
class AssignedState(collections.defaultdict):
    """opt.state under ZeroRedundancyOptimizer. Its load_state_dict assigns opt.state[p] = {...}
    (copies of the saved tensors) instead of calling opt.load_state_dict; emsa's engine reads only
    its own memory, so an assigned entry is copied into emsa's state (checked first) and the
    entry stays emsa's."""

    def __init__(self, opt, items):
        super().__init__(dict, items)
        self._opt = weakref.ref(opt)

    def __setitem__(self, p, value) -> None:
        opt = self._opt()
        backend = None if opt is None else opt._backend
        i = None if backend is None else next(
            (k for k, q in enumerate(backend.params) if q is p), None)
        if i is None or value is backend.state(i):
            super().__setitem__(p, value)
            return
        views = backend.state(i)
        name = backend.names[i]
        keys = set(views) - {"master"}
        if not isinstance(value, dict) or not keys - {"step"} <= set(value) or (
                set(value) - keys - {"master"}):
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ValueError(f"state for {name} has keys {got}; emsa expects {sorted(keys)}: "
                             "is it another optimizer's?")
        for key, t in value.items():
            if key != "step" and (not isinstance(t, torch.Tensor) or t.shape != p.shape):
                raise ValueError(f"state for {name}: {key} does not have the parameter's shape "
                                 f"{tuple(p.shape)}; load a state_dict saved for this model")
        backend.sync_state()
        with torch.no_grad():
            for key, view in views.items():
                if key == "step":
                    view.fill_(float(value.get("step", 0)))
                elif key in value:
                    view.copy_(value[key])
        backend.state_loaded()
        super().__setitem__(p, views)
