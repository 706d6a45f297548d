"""Arena views handed to torch through DLPack capsules (emsa._native.dlpack), on host arenas.

The CUDA path hands its device arena to torch the same way; here the capsule and ownership logic
is checked where it runs everywhere: torch tensors alias emsa's memory, outlive emsa's handle,
and each export's deleter runs exactly once, whether torch consumed the capsule or not.
"""

import ctypes
import gc

import pytest
import torch

from emsa._native import dlpack as _dlpack
from emsa._native.library import EmsaError, check, lib

DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    # deleter as a plain address: reading it copies the value (a function-pointer field would
    # be a view of the struct's memory, and follow the replacement below)
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class Arena:
    """A plain (unpinned) host arena through the C ABI."""

    def __init__(self, nbytes=4096):
        self.handle = ctypes.c_void_p()
        check(lib.emsa_host_arena_create(nbytes, 0, ctypes.byref(self.handle)))

    def export(self, offset, shape, dtype=0):
        dims = (ctypes.c_int64 * len(shape))(*shape)
        out = ctypes.c_void_p()
        check(lib.emsa_host_arena_export(self.handle, offset, dims, len(shape), dtype,
                                         ctypes.byref(out)))
        return out.value

    def destroy(self):
        lib.emsa_host_arena_destroy(self.handle)
        self.handle = None


class Counted:
    """Replaces an export's deleter with one that counts its calls, then runs the original."""

    def __init__(self, address):
        managed = DLManagedTensor.from_address(address)
        self.original = DELETER(managed.deleter)
        self.calls = 0

        def counting(self_address, me=self):
            me.calls += 1
            me.original(self_address)

        self.callback = DELETER(counting)  # kept alive here: torch calls it later
        managed.deleter = ctypes.cast(self.callback, ctypes.c_void_p).value


def test_export_describes_the_view():
    arena = Arena()
    address = arena.export(256, [4, 8])
    t = DLManagedTensor.from_address(address).dl_tensor
    assert (t.device.device_type, t.ndim, t.byte_offset) == (1, 2, 0)  # kDLCPU
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (2, 32, 1)  # float32
    assert [t.shape[0], t.shape[1], t.strides[0], t.strides[1]] == [4, 8, 8, 1]
    lib.emsa_dlpack_delete(address)
    arena.destroy()


def test_views_alias_the_arena_and_outlive_its_handle():
    arena = Arena()
    a_address, b_address = arena.export(256, [4, 8]), arena.export(256, [32])
    a_count, b_count = Counted(a_address), Counted(b_address)
    a, b = _dlpack.to_torch(a_address), _dlpack.to_torch(b_address)
    assert a.shape == (4, 8) and a.dtype == torch.float32 and a.device.type == "cpu"
    assert a.data_ptr() == b.data_ptr()
    a.fill_(3.0)
    assert torch.equal(b, torch.full((32,), 3.0))  # one memory
    arena.destroy()  # emsa lets go; the views keep the memory
    a.add_(1.0)
    assert torch.equal(b, torch.full((32,), 4.0))
    assert (a_count.calls, b_count.calls) == (0, 0)
    del a
    gc.collect()
    assert (a_count.calls, b_count.calls) == (1, 0), "torch must release each view once"
    assert torch.equal(b, torch.full((32,), 4.0))
    del b
    gc.collect()
    assert (a_count.calls, b_count.calls) == (1, 1)


def test_an_unconsumed_capsule_releases_the_view_once():
    arena = Arena()
    address = arena.export(0, [16])
    count = Counted(address)
    capsule = _dlpack.capsule(address)
    del capsule  # never given to torch: still named "dltensor"
    gc.collect()
    assert count.calls == 1, "a capsule torch never took must release its view when it dies"
    arena.destroy()


def test_a_consumed_capsule_leaves_the_release_to_torch():
    arena = Arena()
    address = arena.export(64, [2, 3])
    count = Counted(address)
    capsule = _dlpack.capsule(address)
    t = torch.utils.dlpack.from_dlpack(capsule)
    del capsule  # renamed "used_dltensor" by torch: its destructor must not release the view
    gc.collect()
    assert count.calls == 0
    t.zero_()
    del t
    gc.collect()
    assert count.calls == 1
    arena.destroy()


def test_export_view_keeps_dtype_and_dense_layouts():
    arena = Arena(1 << 16)
    like = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    view = _dlpack.export_view(lib.emsa_host_arena_export, arena.handle, 512, like, torch.bfloat16)
    assert view.dtype == torch.bfloat16 and view.shape == like.shape
    assert view.stride() == like.stride()
    view.copy_(torch.arange(view.numel(), dtype=torch.float32).view(like.shape))
    flat = _dlpack.export_view(lib.emsa_host_arena_export, arena.handle, 512,
                               torch.empty(like.numel()), torch.bfloat16)
    # The same bytes, in channels_last memory order.
    assert torch.equal(flat, view.permute(0, 2, 3, 1).reshape(-1))
    arena.destroy()


def test_bad_exports_are_refused():
    arena = Arena()
    with pytest.raises(EmsaError, match="needs 128 bytes there, but the range holds 4096"):
        arena.export(4000, [32])
    with pytest.raises(EmsaError, match="not aligned to the 4-byte element size"):
        arena.export(2, [4])
    with pytest.raises(EmsaError, match="dtype = 9 is not an EMSA_DTYPE_"):
        arena.export(0, [4], dtype=9)
    arena.destroy()
