"""Arena views handed to torch as DLPack capsules: torch tensors aliasing emsa's memory.

libemsa exports a view as a DLManagedTensor (src/memory/dlpack_export.h) that holds a reference
on the arena's memory. Here it is wrapped in a PyCapsule named "dltensor", the DLPack hand-over
object: torch.from_dlpack takes the tensor over (renaming the capsule "used_dltensor") and runs
the deleter when the last torch tensor aliasing the memory dies. A capsule that never reached
torch still has its name, and its destructor runs the deleter instead: exactly once either way.
The memory therefore lives until emsa and every tensor viewing it have let go, in any order.
"""

from __future__ import annotations

import ctypes

import torch

from .library import check, lib
from .structs import DTYPE

_NAME = b"dltensor"  # module-lifetime bytes: capsules keep a pointer to this name
_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# Private prototypes, so that the argtypes other libraries set on ctypes.pythonapi's shared
# function objects neither affect nor are affected by these.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 _Destructor)(("PyCapsule_New", ctypes.pythonapi))
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


@_Destructor
def _release_unconsumed(capsule):
    if _capsule_is_valid(capsule, _NAME):
        lib.emsa_dlpack_delete(_capsule_pointer(capsule, _NAME))


def capsule(dlmanaged: int):
    """A "dltensor" capsule owning the export; on failure the export is released here."""
    try:
        return _capsule_new(dlmanaged, _NAME, _release_unconsumed)
    except BaseException:
        lib.emsa_dlpack_delete(dlmanaged)
        raise


def to_torch(dlmanaged: int) -> torch.Tensor:
    """The torch tensor of a libemsa export (a DLManagedTensor address), without a copy."""
    return torch.utils.dlpack.from_dlpack(capsule(dlmanaged))


_DTYPE_CODES = {torch.float32: DTYPE["float32"], torch.bfloat16: DTYPE["bfloat16"],
                torch.float16: DTYPE["float16"]}


def export_view(export_fn, handle, offset: int, like: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `like`'s shape and strides (a dense layout: channels_last stays channels_last,
    as torch's own state does) and `dtype`, at byte `offset` of the arena behind `handle`;
    export_fn is lib.emsa_device_arena_export or lib.emsa_host_arena_export."""
    shape = (ctypes.c_int64 * 1)(like.numel())
    out = ctypes.c_void_p()
    check(export_fn(handle, offset, shape, 1, _DTYPE_CODES[dtype], ctypes.byref(out)))
    return to_torch(out.value).as_strided(like.shape, like.stride())
