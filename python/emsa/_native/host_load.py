"""emsa::HostLoad (emsa/profile.h) from Python: the host tier's kind of load on the CPU and the
copy engines, run while the probe times forward and backward under it."""

from __future__ import annotations

import contextlib
import ctypes
from typing import Iterator

from .library import check, lib

__all__ = ["host_load"]


@contextlib.contextmanager
def host_load(device_index: int) -> Iterator[None]:
    """Runs the load for the block: the host tier's CPU update (its thread count) over 64 Mi
    fp32 parameters' state, and 64 MiB copies both ways with device `device_index`. Raises EmsaError before the block when it cannot start (no
    room for its buffers on a full device, say)."""
    load = ctypes.c_void_p()
    check(lib.emsa_host_load_start(0, 64 << 20, device_index, 1, 64 << 20, ctypes.byref(load)))
    try:
        yield
    finally:
        check(lib.emsa_host_load_stop(load, None, None))
