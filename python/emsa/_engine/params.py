"""The parameters an optimizer planned, and the one place that checks they still are.

A Slot is one parameter the optimizer updates: only those with requires_grad=True when it
plans get one (state, arena bytes, a state_dict entry), as torch.optim keeps state only for
parameters it updates; the others are frozen for this optimizer. PlannedParams holds both lists
as planned and answers, before anything changes, whether the optimizer's param groups still
hold exactly those parameters where they were (engine_groups, for the optimizer; each, for the
engines, which also see where each parameter's memory is).

Also here: what any engine can update in place (check_param) and the small layout rules the
engines share (dense, kernel_grad, state_view).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

__all__ = ["DTYPE_NAMES", "Slot", "PlannedParams", "check_param", "dense", "kernel_grad",
           "same_layout", "state_view"]

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class Slot:
    """One parameter the optimizer updates."""

    param: torch.Tensor
    group: int
    index: int  # position within its group
    name: str
    record_index: int = -1


def _name(group: dict, g: int, j: int) -> str:
    names = group.get("param_names")
    return names[j] if names else f"param_groups[{g}].params[{j}]"


def slots_of(param_groups: list[dict]) -> list[Slot]:
    """The planned parameters: those with requires_grad=True, in param_groups order."""
    return [Slot(param=p, group=g, index=j, name=_name(group, g, j))
            for g, group in enumerate(param_groups)
            for j, p in enumerate(group["params"]) if p.requires_grad]


def frozen_of(param_groups: list[dict]) -> list[Slot]:
    """The parameters frozen at planning (requires_grad=False): no slot, no state."""
    return [Slot(param=p, group=g, index=j, name=_name(group, g, j))
            for g, group in enumerate(param_groups)
            for j, p in enumerate(group["params"]) if not p.requires_grad]


class PlannedParams:
    """slots: the optimizer's planned parameters as its groups hold them (DTensors stay
    DTensors); engine_slots: the same slots as the engine binds them (a DTensor's local shard);
    frozen: the parameters frozen at planning; sizes: each group's length when planned."""

    def __init__(self, slots: list[Slot], engine_slots: list[Slot], frozen: list[Slot],
                 sizes: list[int]):
        self.slots, self.frozen, self.sizes = slots, frozen, list(sizes)
        self.engine_slots = engine_slots
        held: list[list[int]] = [[] for _ in sizes]
        for s in slots:
            held[s.group].append(s.index)
        # Each group's planned positions; None when it holds only planned parameters.
        self.picks = [None if len(h) == n else h for h, n in zip(held, sizes)]
        self.counts = [len(h) for h in held]
        self.params = [s.param for s in engine_slots]
        self.names = [s.name for s in engine_slots]
        self.groups = [s.group for s in engine_slots]
        self.shapes = [p.shape for p in self.params]
        self.dtypes = [p.dtype for p in self.params]
        self.strides = [p.stride() for p in self.params]
        self.ptrs = [p.data_ptr() for p in self.params]
        self.numels = [p.numel() for p in self.params]

    def __len__(self) -> int:
        return len(self.params)

    # ---- the optimizer's view: its param groups -------------------------------------------
    def engine_groups(self, param_groups: list[dict], unfrozen: bool = False) -> list[dict]:
        """param_groups as the engine planned them (frozen parameters left out), after checking
        that no parameter was added or removed and that no frozen one has a gradient (or,
        with unfrozen=True, requires one: at a pass's first hook, before anything of the pass
        is updated); raises before anything changes."""
        got = [len(g["params"]) for g in param_groups]
        if got != self.sizes:
            raise ValueError(
                f"the optimizer's parameter groups hold {got} parameters but emsa planned "
                f"{self.sizes}: parameters added or removed after planning are not optimized; "
                "build a new optimizer over the new parameter set")
        for f in self.frozen:
            p = param_groups[f.group]["params"][f.index]
            if p is not f.param:
                raise ValueError(f"{f.name} was replaced by another tensor after emsa planned "
                                 "it; build a new optimizer over the new parameter set")
            if p.grad is not None or (unfrozen and p.requires_grad):
                now = "has a gradient" if p.grad is not None else "requires a gradient now"
                raise RuntimeError(
                    f"{f.name} {now}, but it did not require one (requires_grad=False) "
                    "when emsa planned this optimizer, so emsa keeps no state for it and cannot "
                    "update it; nothing was changed. To train it, build a new optimizer after "
                    "unfreezing (load this one's state_dict into it to keep the others' state); "
                    "to keep it frozen, set its .grad to None (or its requires_grad=False "
                    "before backward)")
        return [g if picks is None else {**g, "params": [g["params"][j] for j in picks]}
                for g, picks in zip(param_groups, self.picks)]

    def owns(self, p: torch.Tensor) -> bool:
        """Whether p is one of the planned parameters (identity, not id(): a freed
        parameter's id may be reused)."""
        return any(s.param is p for s in self.slots)

    # ---- the engine's view: its own groups, where each parameter's memory is ----------------
    def check_counts(self, param_groups: list[dict]) -> None:
        """The engine's groups (engine_groups' result) hold as many parameters as planned."""
        if len(param_groups) != len(self.counts) or any(
                len(g["params"]) != c for g, c in zip(param_groups, self.counts)):
            got = [len(g["params"]) for g in param_groups]
            raise ValueError(
                f"the optimizer's parameter groups hold {got} parameters but emsa planned "
                f"{self.counts}: parameters added or removed after planning are not "
                "optimized; build a new optimizer over the new parameter set")

    def each(self, param_groups: list[dict],
             moved: Callable[[int, torch.Tensor], None]) -> Iterator[tuple[int, torch.Tensor]]:
        """Each parameter of the engine's groups with its slot, in slot order, as (i, p),
        checked first: another tensor than the planned one raises; one whose storage, shape or
        strides changed since planning goes to moved(i, p), which raises or takes it."""
        i = 0
        for group in param_groups:
            for p in group["params"]:
                if p is not self.params[i]:
                    raise ValueError(
                        f"{self.names[i]} was replaced by another tensor after emsa planned it; "
                        "build a new optimizer over the new parameter set")
                if self.moved(i, p):
                    moved(i, p)
                yield i, p
                i += 1

    def moved(self, i: int, p: torch.Tensor) -> bool:
        """Whether p's storage, shape or strides changed since slot i was planned or last
        checked."""
        return (p.data_ptr() != self.ptrs[i] or p.shape != self.shapes[i]
                or p.stride() != self.strides[i])

    def check_layout(self, i: int, p: torch.Tensor) -> None:
        """Raises if p's memory layout is not the planned one: the state tensors keep the
        planned strides and are updated elementwise beside the parameter's memory, so a
        permuted parameter would meet its moments in another order. Strides of size-1
        dimensions do not matter and are taken."""
        old = self.strides[i]
        if not all(a == b for a, b, n in zip(old, p.stride(), p.shape) if n > 1):
            raise ValueError(
                f"parameter {self.names[i]} changed memory layout after emsa planned it "
                f"(strides {tuple(old)} -> {tuple(p.stride())} for shape {tuple(p.shape)}, e.g. "
                "model.to(memory_format=...) or a transposed .data); emsa keeps the optimizer "
                "state in the planned layout: restore the parameter's layout, or build a new "
                "optimizer after the change and load this one's state_dict into it")
        self.strides[i] = p.stride()

    def check_shape(self, i: int, p: torch.Tensor) -> None:
        if p.shape != self.shapes[i] or p.dtype is not self.dtypes[i]:
            raise ValueError(
                f"parameter {self.names[i]} changed from {tuple(self.shapes[i])} to "
                f"{tuple(p.shape)} ({p.dtype}) after emsa planned it; emsa lays optimizer state "
                "out once: build a new optimizer over the changed model")


def dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its numel elements fill one span of memory (contiguous,
    channels_last, any permutation), so an elementwise update may treat it as flat. A tensor
    with no elements is dense (there is nothing to lay out)."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def state_view(arena, offset: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """arena.view(offset, like, dtype); a parameter with no elements has no planned bytes (the
    plan may have no arena at all), so its state is an empty tensor of its shape."""
    if like.numel() == 0:
        return torch.empty_strided(like.shape, like.stride(), dtype=dtype, device=like.device)
    return arena.view(offset, like, dtype)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Elementwise-compatible memory layout: equal strides wherever the size is > 1."""
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def kernel_grad(name: str, g: torch.Tensor, p: torch.Tensor, stride) -> torch.Tensor:
    """g as the kernels read it, element i beside p's element i. Sparse gradients are refused;
    g itself is returned when its layout is p's (the usual case), else a copy in p's layout,
    which the caller keeps alive until the update that reads it has run."""
    if g.layout is not torch.strided:
        raise ValueError(f"{name} has a sparse gradient ({g.layout}); emsa updates dense "
                         "gradients only: use torch.optim.SparseAdam for sparse embeddings, or "
                         "make the embedding dense (sparse=False)")
    if g.stride() != stride and not same_layout(g, p):
        return torch.empty_like(p).copy_(g)
    return g


def check_param(name: str, p: torch.Tensor) -> None:
    """What any emsa engine can update in place; raises ValueError saying what to do."""
    if p.dtype not in DTYPE_NAMES:
        if p.is_complex():
            advice = ("optimize torch.view_as_real(...) of it, or use torch.optim for complex "
                      "parameters")
        elif p.is_floating_point():
            advice = "cast the model (model.float()), or use torch.optim for it"
        else:
            advice = "integer tensors are not trainable parameters; remove it from the optimizer"
        raise ValueError(f"parameter {name} is {p.dtype}; emsa updates float32, bfloat16 and "
                         f"float16 parameters: {advice}")
    if p.layout is not torch.strided:
        raise ValueError(f"parameter {name} has layout {p.layout}; emsa updates dense "
                         "(strided) parameters only: use torch.optim for it")
    if not dense(p):
        raise ValueError(f"parameter {name} is not dense in memory (strides {p.stride()} for "
                         f"shape {tuple(p.shape)}); emsa updates parameters in place through "
                         "raw pointers: make it contiguous before building the optimizer")
