"""DTensor parameters (FSDP2's fully_shard, tensor parallel): emsa optimizes each rank's shard.

The engines plan, bind and update the local pieces (plain tensors of the local shape); the param
groups and opt.state keep the DTensors, as torch.optim does under FSDP2, and each rank plans its
own shards under its own budget=. Shards.pull points each local .grad at the DTensor gradient's
local piece before an engine reads it; release() drops both. forward_waits() makes each FSDP
unit's pre-forward wait for exactly its own parameters' host-tier uploads. State is returned as
DTensors with the parameter's mesh and placements (aliasing emsa's arenas), so
torch.distributed.checkpoint reshards it; norm_group() is the group whose SUM all-reduce gives
the global norm. The whole story (FSDP2's streams, root units, accumulation): docs/internals.md.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import replace

import torch

from .._native import host_tier as _host_tier


def _dtensor_class():
    """torch's DTensor class once something imported it, else None: no tensor can be a DTensor
    before its module is imported, and importing it here would add seconds to `import emsa`."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (outside autograd: the tensor the DTensor holds, whose
    storage is the parameter's); t itself for any other tensor."""
    return t._local_tensor if is_dtensor(t) else t


def norm_group(params) -> "torch.distributed.ProcessGroup | None":
    """The group over which the summed squared gradient norm is all-reduced so that it is the
    whole model's: the mesh group of the dimension the DTensor parameters are sharded on; None
    when no parameter is a DTensor (or every one is replicated: each rank holds the whole)."""
    params = list(params)
    dtensors = [p for p in params if is_dtensor(p)]
    if not dtensors:
        return None
    if len(dtensors) != len(params):
        raise ValueError(
            "the optimizer holds DTensor parameters and plain ones: a global gradient norm "
            "summed over the ranks would count each plain parameter once per rank. Build one "
            "emsa optimizer for the DTensor (sharded) parameters and another for the others")
    mesh = dtensors[0].device_mesh
    sharded: set[int] = set()
    for p in dtensors:
        if p.device_mesh != mesh:
            raise ValueError("the optimizer's DTensor parameters live on different device "
                             "meshes; build one emsa optimizer per mesh")
        for dim, placement in enumerate(p.placements):
            if placement.is_partial():
                raise ValueError("a DTensor parameter has a Partial placement; emsa updates "
                                 "Shard or Replicate parameters (redistribute it first)")
            if placement.is_shard():
                sharded.add(dim)
    if not sharded:
        return None
    if len(sharded) > 1:
        raise NotImplementedError(
            f"DTensor parameters are sharded over mesh dimensions {sorted(sharded)}; emsa "
            "all-reduces the gradient norm over one mesh dimension: pass process_group= (a "
            "group spanning every rank that holds a distinct shard)")
    return mesh.get_group(sharded.pop())


class Shards:
    """The engines' view of an optimizer's slots: local tensors in place of DTensors, and the
    gradients carried over to them (module docstring)."""

    def __init__(self, slots):
        self.sources = [s.param for s in slots]
        self.locals = [local(p) for p in self.sources]
        self.engine_slots = [replace(s, param=t) if t is not s.param else s
                             for s, t in zip(slots, self.locals)]
        self.any = any(is_dtensor(p) for p in self.sources)
        self._index = {id(p): i for i, p in enumerate(self.sources)}

    def pull(self, members=None) -> None:
        """Each listed slot's local tensor gets its DTensor's gradient (its local piece)."""
        if not self.any:
            return
        for i in range(len(self.sources)) if members is None else members:
            src, dst = self.sources[i], self.locals[i]
            if src is not dst:
                g = src.grad
                dst.grad = None if g is None else local(g)

    def release(self, members=None) -> None:
        """.grad = None for each listed slot (both the DTensor and its local tensor)."""
        for i in range(len(self.sources)) if members is None else members:
            self.sources[i].grad = None
            self.locals[i].grad = None

    def _drop(self) -> None:
        """The local tensors' aliases of the gradients, dropped: the DTensors keep theirs (a
        step() leaves .grad to the user, as torch's does)."""
        if self.any:
            for src, dst in zip(self.sources, self.locals):
                if src is not dst:
                    dst.grad = None

    def groups(self, groups: list[dict]) -> list[dict]:
        """The engine's param groups: each DTensor replaced by the local tensor bound at
        planning (a parameter that is not a planned one is left for the engine to refuse)."""
        if not self.any:
            return groups
        index, locs = self._index, self.locals
        return [{**g, "params": [locs[index[id(p)]] if id(p) in index else p
                                 for p in g["params"]]} for g in groups]

    @contextlib.contextmanager
    def step_groups(self, groups: list[dict]):
        """For one step(): the engine's param groups with every gradient pulled; the local
        aliases are dropped afterwards."""
        self.pull()
        try:
            yield self.groups(groups)
        finally:
            self._drop()


def wrap_state(views: dict[str, torch.Tensor], param: torch.Tensor) -> dict[str, torch.Tensor]:
    """A slot's state as opt.state holds it: for a DTensor parameter each state tensor (not the
    scalar "step") a DTensor with the parameter's mesh, placements, shape and strides, aliasing
    emsa's memory (so a checkpoint load written into it lands in emsa's state)."""
    if not is_dtensor(param):
        return views
    from_local = _dtensor_class().from_local
    return {k: v if k == "step" else from_local(
        v, param.device_mesh, param.placements, run_check=False, shape=param.shape,
        stride=param.stride()) for k, v in views.items()}


def shard_like(src: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """What to copy into the state tensor of param's local piece from a loaded state tensor
    src of param's global shape: a DTensor (redistributed to param's placements if they
    differ), or the full tensor (this rank's piece cut out). For a plain parameter a DTensor
    src is gathered (a collective: every rank must load)."""
    if not is_dtensor(param):
        return src.full_tensor() if is_dtensor(src) else src
    if is_dtensor(src):
        if src.device_mesh != param.device_mesh or tuple(src.placements) != tuple(
                param.placements):
            src = src.redistribute(param.device_mesh, param.placements)
        return src._local_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    return src[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def forward_waits(backend, shards: Shards):
    """With DTensor parameters in a CUDA host tier: a global module forward pre-hook that makes
    each FSDP unit's pre-forward (and each module holding DTensor parameters) wait for the
    pending uploads of just the parameters it reads (module docstring). Returns the hook's
    handle, or None when nothing needs it."""
    host = getattr(backend, "host", None)
    if not shards.any or host is None:
        return None
    bucket_of = {}
    for src, loc in zip(shards.sources, shards.locals):
        b = host._bucket_of.get(id(loc))
        if src is not loc and b is not None:
            bucket_of[id(src)] = b
    host.sharded = True
    waits = _UploadWaits(host, bucket_of)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(waits)
    weakref.finalize(host, handle.remove)  # gone with the tier
    return handle


_OPAQUE_UNIT = object()  # the state of an FSDP unit this torch's FSDP does not show


def _fsdp_state(module: torch.nn.Module):
    """module's FSDP2 state when it is an FSDP unit (fully_shard applied to it), else None."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None)
    if cls is None or not isinstance(module, cls):
        return None
    getter = getattr(module, "_get_fsdp_state", None)
    return _OPAQUE_UNIT if getter is None else getter()


def _unit_params(state) -> list[torch.Tensor]:
    """The sharded parameters an FSDP unit's pre-forward reads: its parameter groups' and
    those of the units it prefetches in forward. Raises AttributeError where this torch's FSDP
    keeps them under other names."""
    out = []
    for st in (state, *state._states_to_forward_prefetch):
        groups = getattr(st, "_fsdp_param_groups", None)
        if groups is None:  # torch before per-parameter meshes: at most one group
            group = st._fsdp_param_group
            groups = [] if group is None else [group]
        out += [fp.sharded_param for g in groups for fp in g.fsdp_params]
    return out


def reads(module: torch.nn.Module) -> tuple[list[torch.Tensor], object] | None:
    """What module's forward (with its pre-hooks) reads of the sharded parameters: (its own
    DTensor parameters, plus for an FSDP unit those of unit_params; the unit's FSDP state or
    None). None: a unit whose parameters this torch's FSDP does not show."""
    own = [p for p in module._parameters.values() if is_dtensor(p)]
    state = _fsdp_state(module)
    if state is None:
        return own, None
    try:
        unit = _unit_params(state)
    except (AttributeError, TypeError, AssertionError):  # another torch's FSDP internals
        return None
    seen = {id(p) for p in own}
    return own + [p for p in unit if id(p) not in seen], state


class _UploadWaits:
    """The forward pre-hook of forward_waits: per module the host-tier buckets its forward
    reads (HostTier.buckets_of; cached, for an FSDP unit while its forward-prefetch targets
    stay the same); the current stream, and for an FSDP unit its all-gather streams, wait for
    those still pending (HostTier.wait_pending)."""

    _STREAMS = ("all_gather_copy_in_stream", "all_gather_stream")

    def __init__(self, tier, bucket_of: dict[int, int]):
        self._tier = weakref.ref(tier)
        self._bucket_of = bucket_of
        self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, module, args):
        tier = self._tier()
        if tier is None or not tier.pending:
            return
        if _host_tier._compiling():  # traced by torch.compile: one eager wait for everything
            tier.wait_all_compiled()
            return
        state = _fsdp_state(module)  # not cached: it would keep the module alive
        key = None if state is None else tuple(
            map(id, getattr(state, "_states_to_forward_prefetch", ())))
        entry = self._cache.get(module)
        if entry is None or entry[0] != key:
            read = reads(module)  # None: a unit whose parameters this torch's FSDP hides
            entry = self._cache[module] = (
                key, None if read is None else tier.buckets_of(read[0], self._bucket_of))
        buckets = entry[1]
        current = torch.cuda.current_stream(tier.device)
        if buckets is None:
            tier.wait_all(current)
            return
        if not any(b in tier.pending for b in buckets):
            return
        streams = [current]
        if state is not None:
            ctx = getattr(state, "_comm_ctx", None)
            found = [getattr(ctx, name, None) for name in self._STREAMS]
            if None in found:  # not the FSDP this was written against: wait for everything
                tier.wait_all(current)
                return
            streams += found
        tier.wait_pending(buckets, streams)


# ---- probing a sharded model (emsa.probe) ------------------------------------------------------
def backward(loss: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """torch.autograd.backward(loss, inputs=inputs), except when an input is a DTensor: FSDP2's
    sharded parameters are not in the autograd graph (the forward read their unsharded copies)
    and get their gradients from FSDP's reduce-scatter, which a backward restricted to them
    never runs; then the whole backward runs."""
    if any(is_dtensor(t) for t in inputs):
        torch.autograd.backward(loss)
    else:
        torch.autograd.backward(loss, inputs=inputs)


def holder_ids(model: torch.nn.Module) -> dict[tuple[int, str], int]:
    """(id(module), attribute) -> id of the parameter it holds now. A forward hook that finds
    another tensor there (FSDP2 swaps in the unsharded copy for the forward) maps it back to
    the parameter the optimizer holds through this."""
    return {(id(m), k): id(p) for m in model.modules() for k, p in m._parameters.items()
            if p is not None}
