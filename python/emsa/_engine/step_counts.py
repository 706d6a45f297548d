"""Each slot's step count as torch keeps it: float32, one storage for all, "step" in opt.state a
0-d view of it. The engine writes it through its own code and calls written() after; anything
else that writes it (state[p]["step"].fill_(1), a copy into the view, zeroing a state entry) is
seen by the storage's version counter, one comparison per step whatever the parameter count."""

from __future__ import annotations

import torch

__all__ = ["StepCounts"]


class StepCounts:
    def __init__(self, n: int):
        self.tensor = torch.zeros(n, dtype=torch.float32)
        self._seen = self.tensor._version

    def written(self) -> None:
        """The engine wrote the counts: they are its own again."""
        self._seen = self.tensor._version

    def edited(self) -> bool:
        """Whether someone other than the engine wrote the counts since its last write."""
        return self.tensor._version != self._seen
