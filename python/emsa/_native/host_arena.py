"""A libemsa host arena seen from torch: one allocation, state tensors are views, no copies.

libemsa maps it on 2 MiB boundaries (huge pages where the kernel offers them), populates every
page on all CPUs (no page fault in a step), then page-locks it with one cudaHostRegister when
pinned memory is asked for and a device is usable (cudaHostAlloc only when registering fails:
`pin` and `fallback_reason` say which way it went). Only a prefix may be locked (locked_bytes:
the plan's host_locked_bytes, every view a copy to or from the device touches); the rest is
pageable and may be populated in the background (wait_populated). `check_fits` refuses, before
anything is allocated, an arena the host cannot hold now (all of it, locked or not), naming the
size that fits.

Lifetime: every view holds the torch storage, which holds the ctypes buffer, which holds the
arena's owner; the arena is freed when the last view is gone, never earlier, even if a
state_dict outlives its optimizer.
"""

from __future__ import annotations

import ctypes
import time
import warnings

import torch

from .library import check, lib, take_string
from .structs import HostArenaFacts, HostArenaOptions

# EMSA_HOST_PIN_* as words, for reports.
PIN_NAMES = {0: "pageable", 1: "cudaHostRegister", 2: "cudaHostAlloc"}


def _options(pinned: bool, available_bytes: int = 0, locked_bytes: int | None = None,
             background: bool = False) -> HostArenaOptions:
    options = HostArenaOptions()
    lib.emsa_host_arena_options_init(ctypes.byref(options))
    options.want_pinned = int(pinned)
    options.available_bytes = int(available_bytes)
    if locked_bytes is not None:  # else libemsa's default: all of it
        options.locked_bytes = int(locked_bytes)
    options.populate_in_background = int(background)
    return options


def check_fits(nbytes: int, pinned: bool, available_bytes: int = 0) -> None:
    """Raises EmsaError (out of memory, with the largest size that fits) when the host cannot
    hold `nbytes` of arena now; allocates nothing. available_bytes=0: MemAvailable."""
    check(lib.emsa_host_arena_check(int(nbytes), ctypes.byref(_options(pinned, available_bytes))))


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
    def __init__(self, nbytes: int, pinned: bool, locked_bytes: int | None = None,
                 background: bool = False):
        """pinned: page-locked when a CUDA device is usable; `self.pinned` says, `self.pin`
        how. locked_bytes: only that prefix is locked (None: all of it); background: the rest is
        populated after this returns (wait_populated). `self.times`: seconds of the whole
        creation ("host_arena") and of its parts, as opt._setup_times names them."""
        start = time.perf_counter()
        handle = ctypes.c_void_p()
        options = _options(pinned, locked_bytes=locked_bytes, background=background)
        check(lib.emsa_host_arena_create_with(nbytes, ctypes.byref(options),
                                              ctypes.byref(handle)))
        owner = _Owner(handle)
        data, size, got_pinned = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_int32()
        check(lib.emsa_host_arena_info(handle, ctypes.byref(data), ctypes.byref(size),
                                       ctypes.byref(got_pinned)))
        facts, reason = HostArenaFacts(), ctypes.c_void_p()
        lib.emsa_host_arena_facts_init(ctypes.byref(facts))
        check(lib.emsa_host_arena_describe(handle, ctypes.byref(facts), ctypes.byref(reason)))
        buf = (ctypes.c_uint8 * size.value).from_address(data.value)
        buf._emsa_owner = owner
        self._owner = owner  # the handle, for wait_populated (the views keep the memory)
        self.pinned = bool(got_pinned.value)
        self.pin = PIN_NAMES.get(facts.pin, "unknown")
        self.fallback_reason = take_string(reason)
        self.huge_pages = bool(facts.huge_pages)
        self.locked_bytes = facts.locked_bytes
        self.pageable_bytes = facts.pageable_bytes
        self.nbytes = size.value
        self.bytes = torch.frombuffer(buf, dtype=torch.uint8)
        if facts.pin == 2:  # pinned, but the slow way: say so rather than be slow silently
            warnings.warn(f"emsa: {self.fallback_reason}", RuntimeWarning, stacklevel=3)
        self.populated = False
        self.times = {"host_arena": time.perf_counter() - start,
                      "host_arena.fill": facts.fill_seconds,
                      "host_arena.pin": facts.pin_seconds}
        self._note_population(facts)

    def _note_population(self, facts: HostArenaFacts) -> None:
        if facts.populated and not self.populated:
            self.populated = True
            if facts.populate_in_background:
                self.times["host_arena.populate"] = facts.populate_seconds

    def wait_populated(self, offset: int) -> bool:
        """Blocks until every page before byte `offset` is resident (at once without a
        background population, or once it got there); raises EmsaError when the kernel could
        not supply the pages. Returns whether every page of the arena is resident now; once it
        is, times["host_arena.populate"] holds the background population's seconds."""
        if self.populated:
            return True
        check(lib.emsa_host_arena_wait_populated(self._owner.handle, int(offset)))
        facts = HostArenaFacts()
        lib.emsa_host_arena_facts_init(ctypes.byref(facts))
        check(lib.emsa_host_arena_describe(self._owner.handle, ctypes.byref(facts), None))
        self._note_population(facts)
        return self.populated

    def offset_of(self, t: torch.Tensor) -> int:
        """t's first byte as an offset into the arena (t must be a view of it)."""
        return t.data_ptr() - self.bytes.data_ptr()

    def describe(self) -> dict:
        """What the report shows: bytes locked and pageable, and how the memory was pinned."""
        return {"bytes": self.nbytes, "locked_bytes": self.locked_bytes,
                "pageable_bytes": self.pageable_bytes, "pin": self.pin,
                "huge_pages": self.huge_pages, "fallback_reason": self.fallback_reason}

    def view(self, offset: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `like`'s shape and strides (dense layouts: channels_last stays
        channels_last, as torch's own state does) and `dtype`, at byte `offset`."""
        nbytes = like.numel() * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > self.nbytes:
            raise RuntimeError(f"emsa internal error: view [{offset}, {offset + nbytes}) is "
                               f"outside the {self.nbytes}-byte arena; please report it")
        flat = self.bytes[offset:offset + nbytes].view(dtype)
        return flat.as_strided(like.shape, like.stride())


def pinned_arena(nbytes: int, times: dict, locked_bytes: int | None = None) -> HostArena:
    """The host tier's arena, page-locked (the host tier copies only from pinned memory), or
    an error saying why it could not be; its set-up phases are added to `times`. locked_bytes:
    only that prefix is locked (the plan's host_locked_bytes: every view a copy touches lies
    there), and the rest is populated in the background (wait before a step reads it)."""
    background = locked_bytes is not None and locked_bytes < nbytes
    arena = HostArena(nbytes, pinned=True, locked_bytes=locked_bytes, background=background)
    times.update(arena.times)
    if not arena.pinned:
        raise RuntimeError(f"emsa could not pin the host arena ({arena.fallback_reason}), and "
                           "the host tier copies only from pinned memory; free host memory, "
                           "or raise the budget so less state goes to the host")
    return arena


def host_memory(arenas: list[HostArena]) -> dict:
    """The host memory these arenas hold: bytes page-locked and pageable, and how each arena
    was obtained (for the report)."""
    described = [a.describe() for a in arenas]
    return {"locked_bytes": sum(d["locked_bytes"] for d in described),
            "pageable_bytes": sum(d["pageable_bytes"] for d in described),
            "arenas": described}


# Elements converted per piece on the device: bounds the temporary to 256 MiB of fp32.
_CONVERT_PIECE = 1 << 26


def copy_converted(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a parameter on the GPU into host memory of another dtype (the fp32
    master of a bf16 parameter): converted on the device, piece by piece along dim 0, then copied
    down as dst's dtype. torch converts a CPU-GPU copy on the CPU, through a pageable temporary
    of the source's size: a 7 B model's masters took seconds that way instead of one DMA."""
    with torch.no_grad():
        if src.device == dst.device or src.dtype == dst.dtype or src.dim() == 0:
            dst.copy_(src)
            return
        rows = max(1, _CONVERT_PIECE // max(1, src[0].numel()))
        for a in range(0, src.shape[0], rows):
            dst[a:a + rows].copy_(src[a:a + rows].to(dst.dtype))

