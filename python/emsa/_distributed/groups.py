"""emsa under torch.distributed: which ranks share what, decided once per optimizer.

emsa builds no communication layer of its own; everything here is a torch.distributed collective
on a group the user's setup already has. configure() answers, at construction:
  - whose gradients the norm covers (norm_group: None for one process or DDP replicas; the
    group of ranks that each hold part of the parameters under ZeRO or FSDP2, over which the
    sum of squares and the non-finite count are all-reduced before the verdict);
  - which ranks must plan alike (replicas compare their planned layouts once: agreed_plan);
  - whether gradients are final when emsa's hooks see them (step_in_backward under DDP needs
    ddp=, or ddp=False for gradients that are each rank's own: check_first_pass).
docs/usage.md ("torch.distributed") has the whole story.
"""

from __future__ import annotations

import json
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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


@dataclass
class DistributedSetup:
    """One optimizer's place in torch.distributed (see the module docstring)."""

    ddp_model: Any = None  # the DistributedDataParallel model given as ddp=
    zero: Any = None  # weakref to the ZeroRedundancyOptimizer that built the optimizer
    norm_group: Any = None  # the ranks the norm and the non-finite count are summed over
    replicas: Any = None  # the ranks whose plans must agree
    gradients_local: bool = False  # ddp=False or DTensor shards: nothing reduces after hooks

    def first_pass_error(self) -> str:
        """step_in_backward: why the first update must be refused (gradients reduced after the
        hooks used them), or "" (also asked at the first backward: the process group may be
        newer than the optimizer)."""
        if self.ddp_model is not None or self.gradients_local or not initialized():
            return ""
        n = dist.get_world_size()
        return _DDP_UNKNOWN.format(n=n) if n > 1 else ""

    def agreed_plan(self, plan):
        """The plan after the replicas compared theirs (agree_on_plan); raises on a
        mismatch."""
        if self.replicas is not None:
            agree_on_plan(plan.text, self.replicas)
        return plan


def configure(params: list[torch.Tensor], process_group, ddp, *, in_backward: bool,
              accumulate: int) -> DistributedSetup:
    """Constructor, before planning: the norm group, the replicas, the refusals."""
    setup = DistributedSetup()
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
        if in_backward and accumulate != 1:
            raise ValueError(
                f"accumulate={accumulate} with ddp=: accumulate with ddp_model.no_sync() "
                "instead (backward passes under no_sync() reduce nothing, so emsa updates "
                "nothing and .grad accumulates; the next synchronized backward updates)")
        setup.ddp_model = ddp
    if zero is not None:
        if in_backward:
            raise ValueError(
                "ZeroRedundancyOptimizer steps its local optimizer after backward; "
                "step_in_backward=True would update each rank's partition from local gradients "
                "during backward: use step_in_backward=False under ZeroRedundancyOptimizer")
        setup.zero = weakref.ref(zero)
        if process_group is None:
            process_group = zero.process_group
    if process_group is None and sharded:
        from .dtensor import norm_group

        process_group = norm_group(params)
    if process_group is None and any(getattr(p, "_is_flat_param", False) for p in params):
        raise ValueError(
            "these are FullyShardedDataParallel's flat parameters: each rank holds a shard, "
            "so emsa's gradient norm and non-finite check would see only this rank's part. "
            "Pass process_group=<FSDP's process group> (the norm is then summed over it), or "
            "shard with FSDP2 (torch.distributed.fsdp.fully_shard)")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError("process_group= takes a torch.distributed ProcessGroup (e.g. "
                        f"dist.group.WORLD), not {type(process_group).__name__}")
    setup.norm_group = process_group
    # Replicas hold the same parameters: their plans must agree. Partitions plan their own.
    if ddp is False or zero is not None or sharded or process_group is not None:
        setup.replicas = None
    elif setup.ddp_model is not None:
        setup.replicas = setup.ddp_model.process_group
    else:
        setup.replicas = dist.group.WORLD if initialized() else None
    setup.gradients_local = ddp is False or sharded
    if in_backward and ddp is None:
        why = setup.first_pass_error()
        if why:
            raise RuntimeError(why)
    return setup


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


# ---- the norm and the non-finite count over a group ------------------------------------------
class HostStats:
    """CPU engine: (sum of squares, non-finite count) summed over a group, through one float64
    pair made once."""

    def __init__(self, group):
        self.group = group
        self.pair = torch.zeros(2, dtype=torch.float64)

    def reduce(self, sum_sq: float, nonfinite: int) -> tuple[float, int]:
        self.pair[0] = sum_sq
        self.pair[1] = float(nonfinite)  # exact below 2**53 elements
        dist.all_reduce(self.pair, group=self.group)
        return float(self.pair[0]), int(self.pair[1])


class _DeviceMemory:
    """A device address as __cuda_array_interface__, for torch.as_tensor (no copy)."""

    def __init__(self, address: int, typestr: str):
        self.__cuda_array_interface__ = {"shape": (1,), "typestr": typestr,
                                         "data": (address, False), "version": 2}


class DeviceStats:
    """CUDA engine: the step header's sum_sq and nonfinite_count (at these device addresses)
    as torch tensors on the device, summed over a group in a float64 pair (one all-reduce for
    both), on the current stream with no host synchronization."""

    def __init__(self, group, sum_sq_address: int, nonfinite_address: int,
                 device: torch.device):
        self.group = group
        with torch.cuda.device(device):
            self.sum_sq = torch.as_tensor(_DeviceMemory(sum_sq_address, "<f8"), device=device)
            self.nonfinite = torch.as_tensor(_DeviceMemory(nonfinite_address, "<i8"),
                                             device=device)
        if (self.sum_sq.data_ptr(), self.nonfinite.data_ptr()) != (sum_sq_address,
                                                                   nonfinite_address):
            raise RuntimeError("emsa internal error: torch copied the step header instead of "
                               "viewing it, so the norm could not be summed over the ranks; "
                               "please report it")
        self.pair = torch.zeros(2, dtype=torch.float64, device=device)

    def all_reduce(self) -> None:
        """After the step's statistics are accumulated and before they are finished: NCCL's
        stream waits for this one and this one for it."""
        self.pair[:1].copy_(self.sum_sq)
        self.pair[1:].copy_(self.nonfinite)  # exact below 2**53 elements
        dist.all_reduce(self.pair, group=self.group)
        self.sum_sq.copy_(self.pair[:1])
        self.nonfinite.copy_(self.pair[1:])

    def contribute_nothing(self) -> None:
        """A rank with no gradient this step still takes part: the others wait for it."""
        self.pair.zero_()
        dist.all_reduce(self.pair, group=self.group)
