"""The host arena from Python (emsa._arena, issue 22): the host-memory check before any
allocation, zero-filled aligned memory, and honest accounting of what is locked and what is
pageable, in the arena and in opt._host_memory; the set-up phases in opt._setup_times."""

import pytest
import torch
from torch import nn

import emsa
from emsa import _arena
from emsa._capi import EmsaError
from conftest import requires_cuda

MiB = 1 << 20


def test_shortfall_is_refused_before_allocation_with_the_size_that_fits():
    # 64 MiB available (injected): an eighth is kept back, 56 MiB fits.
    with pytest.raises(EmsaError) as err:
        _arena.check_fits(57 * MiB, pinned=False, available_bytes=64 * MiB)
    message = str(err.value)
    assert f"largest host arena that fits now is {56 * MiB} bytes (0.05 GiB)" in message
    assert f"{57 * MiB} bytes" in message and "Nothing was allocated" in message
    _arena.check_fits(56 * MiB, pinned=False, available_bytes=64 * MiB)


def test_absurd_size_is_refused_against_this_host():
    with pytest.raises(EmsaError, match=r"largest host arena that fits now is \d+ bytes"):
        _arena.check_fits(1 << 50, pinned=True)


def test_arena_is_zeroed_aligned_and_accounted_pageable():
    a = _arena.HostArena(5 * MiB + 3, pinned=False)
    assert a.bytes.data_ptr() % (2 * MiB) == 0
    assert a.nbytes == 5 * MiB + 3 and int(a.bytes.count_nonzero()) == 0
    d = a.describe()
    assert d["pin"] == "pageable" and d["locked_bytes"] == 0
    assert d["pageable_bytes"] == 6 * MiB  # whole 2 MiB pages
    assert d["fallback_reason"] == ""  # pinning was not asked for
    assert set(a.times) == {"host_arena", "host_arena.fill", "host_arena.pin"}
    v = a.view(4096, torch.empty(3, 5), torch.float32)
    v.fill_(2.0)
    assert float(a.bytes[4096:4096 + 60].view(torch.float32).sum()) == 30.0


def test_cpu_optimizer_records_set_up_and_host_memory():
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    opt = emsa.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    assert "host_arena" in opt._setup_times and "first_step" in opt._setup_times
    assert all(v >= 0 for v in opt._setup_times.values())
    mem = opt._host_memory
    assert mem["locked_bytes"] == 0 and mem["pageable_bytes"] > 0
    assert all(a["pin"] == "pageable" for a in mem["arenas"])


@requires_cuda
def test_host_tier_arena_is_registered_and_fully_locked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)).cuda()
    opt = emsa.AdamW(model.parameters(), lr=1e-3, tier="host")
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    opt.synchronize()
    mem = opt._host_memory
    (arena,) = mem["arenas"]
    assert arena["pin"] == "cudaHostRegister", arena["fallback_reason"]
    assert mem["pageable_bytes"] == 0 and mem["locked_bytes"] >= arena["bytes"] > 0
    state = opt.state[model[0].weight]
    assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].is_pinned()
    for phase in ("host_arena", "host_arena.fill", "host_arena.pin", "bind", "first_step"):
        assert phase in opt._setup_times, phase
