"""A torch.distributed launcher for tests: runs a function in each rank of a fresh process group.

    results = dist_util.run(body, world_size=2, backend="gloo", args=(...))

starts world_size processes (torch.multiprocessing, spawn), each joins one group through a file
store in a fresh temporary directory (no TCP port to pick, so parallel runs cannot collide),
calls body(ctx, *args) with ctx = Rank(rank, world_size, backend, device), saves what it returns
(torch.save: tensors, dicts, numbers) and leaves the group. run() returns the ranks' results in
rank order; an exception in any rank is raised in the caller with that rank's traceback. Every
collective times out after `timeout` seconds and the whole run is killed after `timeout` + a
start-up allowance, so a hang fails the test instead of blocking CI.

CONFIGS lists what this machine runs: gloo with 2 CPU ranks always; NCCL at world size 1 on
cuda:0 when a CUDA device and NCCL exist. Tests parametrize over it (config_ids for the ids).
DEVICE_CONFIGS adds (backend, world_size, device type): gloo with 2 ranks sharing cuda:0 when
there is a GPU (gloo reduces CUDA tensors through the host), so that one GPU tests the CUDA
paths with two ranks whose data differ; run(..., device="cuda") for it.
body must be a module-level function (spawn pickles it by name); keep it small and fp32.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Rank(NamedTuple):
    rank: int
    world_size: int
    backend: str
    device: torch.device


def _configs() -> list[tuple[str, int]]:
    out = [("gloo", 2)] if dist.is_available() else []
    if dist.is_available() and torch.cuda.is_available() and dist.is_nccl_available():
        out.append(("nccl", 1))
    return out


CONFIGS = _configs()  # (backend, world_size)
config_ids = [f"{b}x{n}" for b, n in CONFIGS]
DEVICE_CONFIGS = [(b, n, "cuda" if b == "nccl" else "cpu") for b, n in CONFIGS]
if ("gloo", 2) in CONFIGS and torch.cuda.is_available():
    DEVICE_CONFIGS.append(("gloo", 2, "cuda"))
device_config_ids = [f"{b}x{n}-{d}" for b, n, d in DEVICE_CONFIGS]

needs_distributed = pytest.mark.skipif(not dist.is_available(),
                                       reason="torch.distributed is not available")

START_ALLOWANCE = 60.0  # seconds for the processes to import torch and join the group


def _entry(rank: int, fn: Callable, world_size: int, backend: str, store: str, out_dir: str,
           timeout: float, args: tuple, device_type: str) -> None:
    torch.set_num_threads(1)  # the test machine's cores are shared by several ranks
    if device_type == "cuda":
        index = rank if backend == "nccl" else 0  # gloo: every rank on the one GPU
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout))
    try:
        result = fn(Rank(rank, world_size, backend, device), *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank leaves while another may still talk to it
    finally:
        dist.destroy_process_group()
    # The rank's work is saved: leave without the interpreter's teardown. There, once in a few
    # hundred runs, a gloo worker thread still joinable aborted the process ("terminate called
    # without an active exception", SIGABRT), which failed a test whose ranks had all passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(fn: Callable, world_size: int = 2, backend: str = "gloo", args: tuple = (),
        timeout: float = 60.0, device: str | None = None) -> list[Any]:
    """fn(ctx, *args) in each of world_size ranks; returns their results in rank order.
    device: "cpu" or "cuda" (None: cuda for NCCL, else cpu)."""
    device = device or ("cuda" if backend == "nccl" else "cpu")
    with tempfile.TemporaryDirectory(prefix="emsa-dist-") as tmp:
        store = os.path.join(tmp, "store")
        context = mp.start_processes(
            _entry, args=(fn, world_size, backend, store, tmp, timeout, args, device),
            nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout + START_ALLOWANCE
        try:
            while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the {world_size}-rank {backend} run of {fn.__name__} did not finish "
                        f"in {timeout + START_ALLOWANCE:.0f} s (a hang, e.g. a collective that "
                        "only some ranks reached)")
        finally:
            for p in context.processes:  # only the processes started here, by handle
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]
