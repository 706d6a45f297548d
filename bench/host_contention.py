"""What the host tier's load does to the framework: bench/offload_e2e.py's Llama (953 M params,
bf16 autocast) trained with torch.optim.AdamW(fused=True), all on the GPU, while a background
load like the host tier's runs on the same machine:

  - the CPU update over DRAM: build-gpu/bench/cpu_update_bench on 268 M fp32 parameters (7.5 GB
    of state, far past the last-level cache) with --threads K, in a second process;
  - the same update in cache: 1 M parameters (28 MB), the cores as busy, host memory idle;
  - PCIe both ways: pinned-memory copies of 256 MiB up and down on two side streams, enqueued
    16 pairs at a time from a Python thread (one GIL touch per ~80 ms of copies);
  - both: the DRAM update and the copies.

Per condition: the step (CUDA events), and the host's wall time to launch the forward and to run
backward() (which returns when autograd has launched its last kernel). At 4 x 512 tokens the step
is bound by the host launching kernels, so whatever slows the host's threads lengthens it; what
does is what the planner has to know (ProbeRecord::period_under_load). JSON: every figure, under
bench/results/host-contention-<date>.json unless --out.

Run on the GPU host with the prebuilt binaries (scripts/gpu-check none first).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offload_e2e as oe  # noqa: E402  (the model, batches and provenance of the end-to-end run)

BENCH = Path(__file__).resolve().parent.parent / "build-gpu" / "bench" / "cpu_update_bench"


def measure(model, opt, batches, ctx) -> dict:
    forward, backward, events = [], [], []
    for i, ids in enumerate(batches):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append(e)
        t0 = time.perf_counter()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            forward.append((t1 - t0) * 1e3)
            backward.append((t2 - t1) * 1e3)
    torch.cuda.synchronize()
    steps = [events[i].elapsed_time(events[i + 1]) for i in range(2, len(events) - 1)]
    return dict(step_ms=statistics.median(steps), steps_ms=steps,
                forward_launch_ms=statistics.median(forward),
                backward_host_ms=statistics.median(backward))


@contextlib.contextmanager
def cpu_update(params: int, threads: int):
    p = subprocess.Popen([str(BENCH), "--params", str(params), "--tensors", "64" if params > 1 << 24
                          else "16", "--threads", str(threads), "--iters", "100000000",
                          "--states", "fp32"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(3.0)  # allocation and first touch of up to 7.5 GB
    try:
        yield
    finally:
        p.kill()
        p.wait()


@contextlib.contextmanager
def pcie(device):
    n = 256 << 20
    host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(n, dtype=torch.uint8, device=device)
    dev_out = torch.empty(n, dtype=torch.uint8, device=device)
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)
    stop = threading.Event()

    def loop():
        torch.cuda.set_device(device)
        while not stop.is_set():
            for _ in range(16):
                with torch.cuda.stream(up):
                    dev_in.copy_(host_in, non_blocking=True)
                with torch.cuda.stream(down):
                    host_out.copy_(dev_out, non_blocking=True)
            up.synchronize()
            down.synchronize()

    t = threading.Thread(target=loop)
    t.start()
    time.sleep(0.5)
    try:
        yield
    finally:
        stop.set()
        t.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=15, help="CPU update threads (the host tier's "
                    "pool on the 16-core H200 host)")
    ap.add_argument("--shape", default="4x512", help="batch x tokens")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not BENCH.is_file():
        sys.exit(f"host_contention: needs a CUDA GPU and {BENCH} (scripts/gpu-check none)")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    batch, seq = (int(x) for x in args.shape.split("x"))
    shape = oe.LLAMA_1B
    batches = oe.token_batches(shape["vocab_size"], batch, seq, args.steps + 2, device)
    model = oe.make_llama(shape, device)
    opt = torch.optim.AdamW(model.parameters(), **oe.HYPER, fused=True)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16)
    k = args.threads

    @contextlib.contextmanager
    def both():
        with pcie(device), cpu_update(268435456, k):
            yield

    conditions = [
        ("warm-up", contextlib.nullcontext),
        ("alone", contextlib.nullcontext),
        (f"CPU update over DRAM, {k} threads", lambda: cpu_update(268435456, k)),
        (f"CPU update in cache, {k} threads", lambda: cpu_update(1048576, k)),
        ("PCIe both ways", lambda: pcie(device)),
        (f"PCIe both ways + CPU update over DRAM, {k} threads", both),
        ("alone again", contextlib.nullcontext),
    ]
    result = oe.provenance("host-contention", device)
    result.update(shape=args.shape, threads=k, conditions={})
    for label, make in conditions:
        with make():
            r = measure(model, opt, batches, ctx)
        result["conditions"][label] = r
        print(f"{label:48s} step {r['step_ms']:7.1f} ms   forward launch "
              f"{r['forward_launch_ms']:6.1f}   backward (host) {r['backward_host_ms']:6.1f}",
              flush=True)
    print(f"JSON: {oe.write_json(result, args.out, 'host-contention')}")


if __name__ == "__main__":
    main()
