"""opt.state as torch.optim keeps it, over emsa's own memory.

torch creates a parameter's entry at its first update and forgets it when told to: clear(),
del, pop, `opt.state[p] = {}` or a new mapping assigned to opt.state start those parameters
afresh at their next update (step 0, zero moments). OptimizerState does the same over the
engine's arenas: an entry appears when its parameter is first updated (its tensors are views
into emsa's memory), and forgetting one resets that slot's memory at once (moments zeroed, step
0, a master taken from the parameter), so the next update starts afresh as torch's does. An
entry assigned with tensors is copied into emsa's memory (ZeroRedundancyOptimizer's load assigns
them so); its tensors written in place (state[p]["step"].fill_(1), zeroing) are read at the next
update (StepCounts sees step edits). Before planning it is a plain defaultdict(dict).
"""

from __future__ import annotations

import collections
from typing import Any, Iterable

import torch

from .._distributed import dtensor
from .state_dict import check_entry, write_slot

__all__ = ["StateEntries", "OptimizerState"]


class StateEntries(dict):
    """One parameter's entry of opt.state: emsa's own tensors (views into its arenas). Assigning
    a tensor to a key that holds one writes the values into emsa's tensor (converted to its
    device and dtype) instead of replacing it. A replaced tensor would go unread, since the
    engine updates its arena. Lightning, for one, assigns every state tensor moved to the
    model's device after setup and after loading a checkpoint, which would have put a copy of
    the host tier's state on the GPU and left emsa's state out of the next checkpoint."""

    def __setitem__(self, key, value) -> None:
        held = self.get(key)
        if not (isinstance(held, torch.Tensor) and isinstance(value, torch.Tensor)):
            super().__setitem__(key, value)
            return
        if value is held:
            return
        if tuple(value.shape) != tuple(held.shape):
            raise ValueError(
                f"emsa: opt.state[...][{key!r}] is emsa's own memory of shape "
                f"{tuple(held.shape)}: a tensor assigned to it is copied in, and this one has "
                f"shape {tuple(value.shape)}")
        with torch.no_grad():
            held.copy_(value)


class OptimizerState(collections.defaultdict):
    """The optimizer's opt.state (module docstring). Keys are parameters, as torch's."""

    def __init__(self, items=()):
        super().__init__(dict, items)
        self._engine = None
        self._planned = None
        self._cls = ""  # the optimizer's class name, for messages
        self._slot_of: dict[int, int] = {}  # id(param) -> slot (identity checked on use)
        # Slots with no entry of emsa's views yet: what a step scans (often none, or the few
        # parameters that never get a gradient), never every slot.
        self._unshown: set[int] = set()

    # ---- the optimizer's side ---------------------------------------------------------------
    def attach(self, engine, planned, cls: str) -> None:
        """Planning made the engine: from now on entries are its views. Entries already here
        (a load before planning cannot happen: load plans first) are dropped."""
        self._engine, self._planned, self._cls = engine, planned, cls
        self._slot_of = {id(s.param): i for i, s in enumerate(planned.slots)}
        self._unshown = set(range(len(planned)))
        super().clear()

    @property
    def hidden(self) -> bool:
        """Whether some planned parameter has no entry yet (reveal() has work to do)."""
        return bool(self._unshown)

    def reveal(self, slots: Iterable[int]) -> None:
        """These slots were updated: each gets its entry (emsa's views), as torch's first update
        creates one."""
        for i in slots:
            if i in self._unshown:
                self._show(i)

    def unshown_with_grads(self) -> list[int]:
        """The slots without an entry whose parameter has a gradient now (a step or a pass's
        end updates them), in parameter order."""
        slots = self._planned.slots
        return sorted(i for i in self._unshown if slots[i].param.grad is not None)

    def loaded(self, sources: dict[int, dict]) -> None:
        """load_state_dict wrote every slot from sources (by slot; zero where it has none):
        entries for those it had, an empty one where its entry was empty, none for the rest,
        as torch's load leaves opt.state."""
        super().clear()
        self._unshown = set(range(len(self._planned)))
        for i, st in sources.items():
            if st:
                self._show(i)
            else:
                dict.__setitem__(self, self._planned.slots[i].param, {})

    def copy(self) -> collections.defaultdict:
        return collections.defaultdict(dict, self)

    def __reduce__(self):  # copy.deepcopy, pickle: a plain defaultdict of the entries
        return collections.defaultdict, (dict,), None, None, iter(self.items())

    # ---- torch's ways of forgetting and assigning --------------------------------------------
    def __setitem__(self, p, value) -> None:
        i = self._slot(p)
        if i is None:
            super().__setitem__(p, value)
            return
        if isinstance(value, dict) and not value:  # torch starts this parameter afresh
            self._reset([i])
            super().__setitem__(p, value)
            return
        if i not in self._unshown and value is super().get(p):
            return
        self._assign(i, value)

    def __delitem__(self, p) -> None:
        i = self._slot(p)
        super().__delitem__(p)  # KeyError for a key not present, as a dict's
        if i is not None:
            self._reset([i])

    def pop(self, p, *default):
        if p not in self:
            if default:
                return default[0]
            raise KeyError(p)
        value = super().get(p)
        del self[p]
        return value

    def popitem(self):
        if not self:
            raise KeyError("popitem(): dictionary is empty")
        p = next(reversed(self))
        value = super().get(p)
        del self[p]
        return p, value

    def clear(self) -> None:
        if self._planned is not None:
            self._reset(range(len(self._planned)))
        super().clear()

    def update(self, *args, **kwargs) -> None:
        for p, value in dict(*args, **kwargs).items():
            self[p] = value

    def setdefault(self, p, default=None):
        if p not in self:
            self[p] = {} if default is None else default
        return self[p]

    def replace(self, items) -> None:
        """opt.state = items: every planned parameter starts afresh, then items' entries are
        assigned (a tensor entry is copied into emsa's memory)."""
        items = dict(items)
        self.clear()
        self.update(items)

    # ---- the slots --------------------------------------------------------------------------
    def _slot(self, p) -> int | None:
        i = self._slot_of.get(id(p))
        if i is None or self._planned.slots[i].param is not p:
            return None
        return i

    def _show(self, i: int) -> None:
        s = self._planned.slots[i]
        entry = StateEntries(dtensor.wrap_state(self._engine.state(i), s.param))
        dict.__setitem__(self, s.param, entry)
        self._unshown.discard(i)

    def _reset(self, slots: Iterable[int]) -> None:
        """These slots' memory afresh: step 0, moments zero, a master from its parameter (those
        without an entry are fresh already)."""
        slots = [i for i in slots if i not in self._unshown]
        if not slots:
            return
        engine = self._engine
        engine.sync_state()
        with torch.no_grad():
            for i in slots:
                write_slot(engine.state(i), {}, self._planned.slots[i].param)
        engine.state_loaded()
        self._unshown.update(slots)

    def _assign(self, i: int, value: Any) -> None:
        """opt.state[p] = {...tensors...}: checked, then copied into slot i's memory."""
        engine, s = self._engine, self._planned.slots[i]
        views = engine.state(i)
        if not isinstance(value, dict):
            raise ValueError(f"state for {s.name} is a {type(value).__name__}; emsa expects a "
                             "dict of its state tensors (or {} to start it afresh)")
        check_entry(s, value, set(views) - {"master"}, self._cls)
        engine.sync_state()
        with torch.no_grad():
            write_slot(views, value, s.param)
        engine.state_loaded()
        self._show(i)
