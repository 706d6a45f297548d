"""The machine's profile from its cache (C++ emsa/profile_cache.h, through the C ABI).

The bandwidths are measured once per machine and kept in a JSON file under $XDG_CACHE_HOME/emsa
(else ~/.cache/emsa), keyed by the GPU, the driver, the CPU model, the cores and the format
version; the untimed description (free device memory above all) is read fresh every time. A
file that is corrupt, another machine's, of another version or older than a week is measured
again and rewritten, and the reason is logged at verbose level (the "emsa" logger at INFO).
`emsa profile --refresh` re-measures on request.

Everything is decided in C++; this module only calls it and remembers where the last profile came
from, for the reports (`source_line`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
from typing import Any, Iterator

from .library import check, lib, take_string

__all__ = ["cached_profile", "measurement_count", "source_line", "last_source", "watching"]

_log = logging.getLogger("emsa")
_LAST: dict[str, Any] | None = None
_WATCHERS: list[list[dict[str, Any]]] = []


def cached_profile(gpu_device: int = 0, *, folder: str | os.PathLike | None = None,
                   max_age: float | None = None, refresh: bool = False) -> dict[str, Any]:
    """{"profile": DeviceProfile dict, "path", "from_cache", "age_seconds", "why_measured",
    "why_not_saved", "key"}. folder: the cache folder (None: the user's); max_age: seconds
    (None: the C++ default, a week); refresh: measure and rewrite regardless."""
    global _LAST
    out = ctypes.c_void_p()
    where = os.fspath(folder).encode() if folder is not None else None
    age = -1 if max_age is None else int(max_age)
    check(lib.emsa_profile_cached(int(gpu_device), where, age, int(bool(refresh)),
                                  ctypes.byref(out)))
    result = json.loads(take_string(out))
    _LAST = {k: v for k, v in result.items() if k != "profile"}
    for seen in _WATCHERS:
        seen.append(dict(_LAST))
    line = source_line(_LAST)
    if result["from_cache"]:
        _log.info("emsa: profile %s", line)
    else:
        _log.info("emsa: profile %s; key %s", line, result["key"])
    return result


@contextlib.contextmanager
def watching() -> Iterator[list[dict[str, Any]]]:
    """Yields a list that collects where each profile asked for inside the block came from."""
    seen: list[dict[str, Any]] = []
    _WATCHERS.append(seen)
    try:
        yield seen
    finally:
        _WATCHERS.remove(seen)


def measurement_count() -> int:
    """Bandwidth measurements cached_profile made in this process (a cache hit adds none)."""
    return int(lib.emsa_profile_measurement_count())


def last_source() -> dict[str, Any] | None:
    """Where the last cached_profile() call's profile came from (its result without the
    profile); None before any."""
    return dict(_LAST) if _LAST is not None else None


def source_line(source: dict[str, Any] | None) -> str:
    """"from cache PATH, measured 3.2 h ago" or "measured now (why), cached at PATH" (the C++
    summary); for a profile the caller passed in (source None), "given"."""
    if not source:
        return "given (profile=, or the probe record's)"
    return str(source["summary"])
