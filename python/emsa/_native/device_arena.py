"""A libemsa device arena seen from torch: one device allocation, state tensors are CUDA views.

Each view is a DLPack export holding the arena's memory (emsa._native.dlpack), so the memory is freed
when this handle is closed and the last view is gone, in either order: a state_dict may outlive
its optimizer.
"""

from __future__ import annotations

import ctypes

import torch

from .dlpack import export_view
from .library import check, lib, take_string

KINDS = {0: "vmm", 1: "cudaMalloc"}


class DeviceArena:
    def __init__(self, nbytes: int, device_index: int):
        handle = ctypes.c_void_p()
        check(lib.emsa_device_arena_create(nbytes, device_index, ctypes.byref(handle)))
        self._handle = handle
        size, kind, reason = ctypes.c_uint64(), ctypes.c_int32(), ctypes.c_void_p()
        check(lib.emsa_device_arena_info(handle, None, ctypes.byref(size), ctypes.byref(kind),
                                         ctypes.byref(reason)))
        self.nbytes = size.value
        self.kind = KINDS.get(kind.value, str(kind.value))
        self.fallback_reason = take_string(reason)  # "" for VMM

    def view(self, offset: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._handle is None:
            raise RuntimeError("emsa internal error: view of a closed device arena")
        return export_view(lib.emsa_device_arena_export, self._handle, offset, like, dtype)

    def close(self) -> None:
        """emsa lets go of the arena; views made so far keep its memory."""
        handle, self._handle = self._handle, None
        if handle:
            lib.emsa_device_arena_destroy(handle)

    def __del__(self):
        if getattr(self, "_handle", None) and lib is not None:
            self.close()
