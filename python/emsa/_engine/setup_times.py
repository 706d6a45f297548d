"""Where an optimizer's set-up seconds go, where its profile came from, and the "set-up" part of
opt.report().

SetupTimes.times is an insertion-ordered dict of seconds per phase ("profile", "plan",
"host_arena" with finer "host_arena.*" phases, "device_arena", "bind", "first_step"), filled
by planning (at construction, or at the first step) through emsa._progress.timed(), and by the
engines, which add their own phases and the first step's waits. The probe record's own
record.setup_times ("profile", "passes", "trace", "under_load") is reported beside it when the
plan was made from a record that emsa.probe() made in this process.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from .. import _progress
from .._native import profile_cache

__all__ = ["SetupTimes"]


class SetupTimes:
    def __init__(self):
        self.times: dict[str, float] = {}
        self.profile_source: str | None = None  # where the plan's profile came from

    def planning(self, label: str) -> contextlib.AbstractContextManager:
        """The scope of one planning: its phases share one progress line."""
        return _progress.setup(label)

    def timed(self, phase: str) -> contextlib.AbstractContextManager:
        return _progress.timed(phase, self.times)

    @contextlib.contextmanager
    def first_step(self) -> Iterator[None]:
        """Times the block as "first_step" if no step was timed yet."""
        start = time.perf_counter()
        yield
        self.times.setdefault("first_step", time.perf_counter() - start)

    @contextlib.contextmanager
    def profile_phase(self) -> Iterator[None]:
        """Times the block as "profile" and notes where the profile it measures came from."""
        with profile_cache.watching() as seen, _progress.timed("profile", self.times):
            yield
        self.profile_source = (profile_cache.source_line(seen[-1]) if seen
                               else "description only (the plan needs no bandwidths)")

    def summary(self, record, profile_given: bool) -> dict[str, Any]:
        """{"times": the phases, "total": their sum (top-level phases only), "profile": where
        the plan's profile came from, "probe": {"times": ..., "profile": ...} when a record made
        in this process planned it}."""
        times = dict(self.times)
        out: dict[str, Any] = {"times": times,
                               "total": sum(v for k, v in times.items() if "." not in k),
                               "profile": self._profile_line(record, profile_given)}
        if record is not None and getattr(record, "setup_times", None):
            out["probe"] = {"times": dict(record.setup_times),
                            "total": sum(record.setup_times.values()),
                            "profile": record.profile_source or "given (profile=)"}
        return out

    def _profile_line(self, record, profile_given: bool) -> str:
        if profile_given:
            return "given (profile=)"
        if self.profile_source:
            return self.profile_source
        if record is not None and record.profile is not None:
            return "the probe record's" + (f": {record.profile_source}" if record.profile_source
                                           else "")
        return "not recorded"
