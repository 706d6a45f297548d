"""A libemsa host arena seen from torch: one allocation, state tensors are views, no copies.

Lifetime: every view holds the torch storage, which holds the ctypes buffer, which holds the
arena's owner; the arena is freed when the last view is gone, never earlier, even if a
state_dict outlives its optimizer.
"""

from __future__ import annotations

import ctypes

import torch

from ._capi import check, lib


class _Owner:
    """Frees the C arena exactly once, when nothing refers to its memory any more."""

    def __init__(self, handle: ctypes.c_void_p):
        self.handle = handle

    def __del__(self):
        # Safe on a partly built object and at interpreter exit (lib may be gone by then).
        handle, self.handle = getattr(self, "handle", None), None
        if handle and lib is not None:
            lib.emsa_host_arena_destroy(handle)


class HostArena:
    def __init__(self, nbytes: int, pinned: bool):
        """pinned: page-locked (cudaHostAlloc) when a CUDA device is usable; `self.pinned`
        says."""
        handle = ctypes.c_void_p()
        check(lib.emsa_host_arena_create(nbytes, int(pinned), ctypes.byref(handle)))
        owner = _Owner(handle)
        data, size, got_pinned = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_int32()
        check(lib.emsa_host_arena_info(handle, ctypes.byref(data), ctypes.byref(size),
                                       ctypes.byref(got_pinned)))
        buf = (ctypes.c_uint8 * size.value).from_address(data.value)
        buf._emsa_owner = owner
        self.pinned = bool(got_pinned.value)
        self.nbytes = size.value
        self.bytes = torch.frombuffer(buf, dtype=torch.uint8)

    def view(self, offset: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `like`'s shape and strides (dense layouts: channels_last stays
        channels_last, as torch's own state does) and `dtype`, at byte `offset`."""
        nbytes = like.numel() * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > self.nbytes:
            raise RuntimeError(f"emsa internal error: view [{offset}, {offset + nbytes}) is "
                               f"outside the {self.nbytes}-byte arena; please report it")
        flat = self.bytes[offset:offset + nbytes].view(dtype)
        return flat.as_strided(like.shape, like.stride())
