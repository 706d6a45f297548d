"""Where an optimizer's set-up seconds go: opt._setup_times, where its profile came from, and the
"set-up" part of opt.report().

opt._setup_times is an insertion-ordered dict of seconds per phase ("profile", "plan",
"host_arena" with finer "host_arena.*" phases, "device_arena", "bind", "first_step"), filled
through emsa._progress.timed() by the constructor (or by planning at the first step). The probe
record's own record.setup_times ("profile", "passes", "trace", "under_load") is reported beside
it when the plan was made from a record that emsa.probe() made in this process.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from . import _profile_cache, _progress

__all__ = ["planning", "profile_phase", "summary"]


def planning(opt: Any) -> contextlib.AbstractContextManager:
    """The scope of one planning (constructor or first step): its phases share one progress
    line, labelled by the optimizer's class."""
    return _progress.setup(f"emsa.{type(opt).__name__} set-up")


@contextlib.contextmanager
def profile_phase(opt: Any) -> Iterator[None]:
    """Times the block as "profile" and notes where the profile it measures came from."""
    with _profile_cache.watching() as seen, _progress.timed("profile", opt._setup_times):
        yield
    opt._profile_source = (_profile_cache.source_line(seen[-1]) if seen
                           else "description only (the plan needs no bandwidths)")


def summary(opt: Any) -> dict[str, Any]:
    """{"times": opt's phases, "total": their sum (top-level phases only), "profile": where the
    plan's profile came from, "probe": {"times": ..., "profile": ...} when a record made in this
    process planned it}."""
    times = dict(getattr(opt, "_setup_times", {}))
    out: dict[str, Any] = {"times": times,
                           "total": sum(v for k, v in times.items() if "." not in k),
                           "profile": _plan_profile_source(opt)}
    record = getattr(opt, "_record", None)
    if record is not None and getattr(record, "setup_times", None):
        out["probe"] = {"times": dict(record.setup_times),
                        "total": sum(record.setup_times.values()),
                        "profile": record.profile_source or "given (profile=)"}
    return out


def _plan_profile_source(opt: Any) -> str:
    if getattr(opt, "_profile", None) is not None:
        return "given (profile=)"
    source = getattr(opt, "_profile_source", None)
    if source:
        return source
    record = getattr(opt, "_record", None)
    if record is not None and record.profile is not None:
        return "the probe record's" + (f": {record.profile_source}" if record.profile_source
                                       else "")
    return "not recorded"
