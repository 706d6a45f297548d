#!/usr/bin/env python3
"""CPU optimizer-step throughput: emsa's host-tier kernels vs torch.optim.AdamW on the CPU.

Same parameter set, same process, all cores. Prints a table and writes every figure as JSON.
Layer shapes follow a Llama decoder (hidden H, intermediate I) so tensor sizes are realistic.

  python bench/cpu_update_vs_torch.py --params-m 256 --out bench/results/cpu-update-DATE.json

Bytes per parameter per step (each read once, each write once):
  fp32 params, grads, states: p r+w 8, g r 4, m r+w 8, v r+w 8            = 28 B
  fp32 params/grads, bf16 states (the params are the fp32 master):       = 20 B
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
from emsa._native import structs as _capi  # noqa: E402
from emsa._native.library import check, lib, take_string  # noqa: E402


def llama_shapes(params_m: float, hidden: int, inter: int) -> list[tuple[int, ...]]:
    """Decoder-layer shapes repeated until about params_m million parameters."""
    layer = [(hidden,), (hidden, hidden), (hidden // 4, hidden), (hidden // 4, hidden),
             (hidden, hidden), (hidden,), (inter, hidden), (inter, hidden), (hidden, inter)]
    shapes, total = [], 0
    while total < params_m * 1e6:
        for s in layer:
            shapes.append(s)
            n = 1
            for d in s:
                n *= d
            total += n
    return shapes


def stream_bandwidth(total_bytes: int, reps: int = 5) -> float:
    """In-place a += 0.5*b over two buffers far beyond any cache (12 B moved per element, no
    write-allocate traffic): the memory ceiling for an update that writes back what it read."""
    n = total_bytes // 8
    a, b = torch.randn(n), torch.randn(n)
    a.add_(b, alpha=0.5)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a.add_(b, alpha=0.5)
        times.append(time.perf_counter() - t0)
    return 12 * n / statistics.median(times)


def make_set(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) * 1e-2 for s in shapes]
    return params, grads


class EmsaRunner:
    """emsa_cpu_step over the same tensors, states in the given dtype."""

    def __init__(self, params, grads, state_dtype: torch.dtype, hp: dict, threads: int, max_simd):
        self.params, self.grads = params, grads
        self.exp_avg = [torch.zeros(p.shape, dtype=state_dtype) for p in params]
        self.exp_avg_sq = [torch.zeros(p.shape, dtype=state_dtype) for p in params]
        up = ctypes.c_void_p()
        check(lib.emsa_cpu_updater_create(threads, max_simd, ctypes.byref(up)))
        self.updater = up
        t, s = ctypes.c_int32(), ctypes.c_int32()
        check(lib.emsa_cpu_updater_info(up, ctypes.byref(t), ctypes.byref(s)))
        self.threads, self.simd = t.value, {0: "scalar", 1: "avx2", 2: "avx512"}[s.value]
        self.hyper = _capi.Hyperparams()
        lib.emsa_hyperparams_init(ctypes.byref(self.hyper))
        for k, v in hp.items():
            setattr(self.hyper, k, v)
        sd = _capi.DTYPE["bfloat16" if state_dtype == torch.bfloat16 else "float32"]
        self.tensors = (_capi.TensorUpdate * len(params))()
        for i, (p, gr) in enumerate(zip(params, grads)):
            t = self.tensors[i]
            lib.emsa_tensor_update_init(ctypes.byref(t))
            t.param_dtype = t.grad_dtype = _capi.DTYPE["float32"]
            t.state_dtype = sd
            t.param, t.grad = p.data_ptr(), gr.data_ptr()
            t.exp_avg, t.exp_avg_sq = self.exp_avg[i].data_ptr(), self.exp_avg_sq[i].data_ptr()
            t.numel = p.numel()
            t.hyper = ctypes.pointer(self.hyper)
        self.options = _capi.StepOptions()
        lib.emsa_step_options_init(ctypes.byref(self.options))
        self.report = _capi.StepReport()
        lib.emsa_step_report_init(ctypes.byref(self.report))
        self.step_count = 0

    def step(self):
        self.step_count += 1
        for t in self.tensors:
            t.step = self.step_count
        check(lib.emsa_cpu_step(self.updater, self.tensors, len(self.tensors),
                                ctypes.byref(self.options), ctypes.byref(self.report)))

    def close(self):
        lib.emsa_cpu_updater_destroy(self.updater)


def git_commit() -> str:
    # The GPU host gets the working tree without .git: scripts/gpu-check passes EMSA_COMMIT.
    if os.environ.get("EMSA_COMMIT"):
        return os.environ["EMSA_COMMIT"]
    try:
        return subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--params-m", type=float, default=64, help="millions of parameters")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--reps", type=int, default=15, help="interleaved rounds")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="0 = all cores")
    ap.add_argument("--out", type=str, default="", help="JSON results path")
    ap.add_argument("--stream-gib", type=int, default=4, help="GiB for the in-run stream ceiling")
    ap.add_argument("--device", type=str, default="", help="free text naming the machine")
    args = ap.parse_args()

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    shapes = llama_shapes(args.params_m, args.hidden, args.intermediate)
    n = sum(torch.Size(s).numel() for s in shapes)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    profile = json.loads(take_string(_measure_profile()))
    host_bw = profile["cpu"]["host_mem_bandwidth"]
    host_update_bw = profile["cpu"].get("host_update_bandwidth", 0.0)
    stream_bw = stream_bandwidth(args.stream_gib << 30)

    rows = {}

    # Every variant gets its own copy of the same inputs, made up front; then rounds time one step
    # of each in turn, so a slow spell of the shared machine hits all variants alike.
    def torch_variant(**kw):
        params, grads = make_set(shapes, 0)
        ps = [torch.nn.Parameter(p) for p in params]
        for p, g in zip(ps, grads):
            p.grad = g
        opt = torch.optim.AdamW(ps, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                                weight_decay=hp["weight_decay"], **kw)
        return opt.step, [p.detach() for p in ps], {}

    def emsa_variant(state_dtype):
        params, grads = make_set(shapes, 0)
        r = EmsaRunner(params, grads, state_dtype, hp, threads, 2)
        return r.step, params, dict(simd=r.simd, threads=r.threads)

    variants = {
        "torch fused=True fp32": (torch_variant(fused=True), 28),
        "torch foreach=True fp32": (torch_variant(foreach=True), 28),
        "emsa fp32": (emsa_variant(torch.float32), 28),
        "emsa bf16 state": (emsa_variant(torch.bfloat16), 20),
    }
    for name, ((step, _, info), bpp) in variants.items():
        for _ in range(args.warmup):
            step()
        rows[name] = dict(bytes_per_param=bpp, times_s=[], **info)
    names = list(variants)
    for rnd in range(args.reps):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            t0 = time.perf_counter()
            variants[name][0][0]()
            rows[name]["times_s"].append(time.perf_counter() - t0)

    # Same inputs, same number of steps: emsa fp32 must agree with torch fused (guards against
    # timing a kernel that does the wrong thing).
    steps = args.warmup + args.reps
    ref = variants["torch fused=True fp32"][0][1]
    mine = variants["emsa fp32"][0][1]
    for a, b in zip(mine[:8], ref[:8]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    del variants, ref, mine

    base = statistics.median(rows["torch fused=True fp32"]["times_s"])
    table = []
    for name, r in rows.items():
        med = statistics.median(r["times_s"])
        r["median_s"] = med
        r["gparam_per_s"] = n / med / 1e9
        r["effective_gb_per_s"] = n * r["bytes_per_param"] / med / 1e9
        r["fraction_of_host_mem_bw"] = n * r["bytes_per_param"] / med / host_bw if host_bw else None
        r["fraction_of_stream_bw"] = n * r["bytes_per_param"] / med / stream_bw
        r["speedup_vs_torch_fused"] = base / med
        table.append(r)

    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(
        benchmark="cpu-update", date=now.strftime("%Y-%m-%d"), time_utc=now.isoformat(),
        device=args.device or platform.node(), cpu=profile["cpu"], commit=git_commit(),
        command=" ".join([sys.executable] + sys.argv), torch=torch.__version__, threads=threads,
        params=n, tensors=len(shapes), steps_checked_equal=steps, method="interleaved rounds, median",
        stream_bandwidth_bytes_per_s=stream_bw, profile_host_mem_bandwidth=host_bw,
        rows=rows)
    print(f"\nCPU AdamW step, {n / 1e6:.0f} M params in {len(shapes)} tensors, {threads} threads, "
          f"torch {torch.__version__}; stream ceiling {stream_bw / 1e9:.1f} GB/s in this run "
          f"(profile: {host_bw / 1e9:.1f}, Adam-shaped {host_update_bw / 1e9:.1f})")
    print(f"{'variant':28s} {'median ms':>10s} {'Gparam/s':>9s} {'GB/s':>7s} {'of bw':>6s} "
          f"{'vs fused':>8s}")
    for name, r in rows.items():
        frac = r["fraction_of_stream_bw"]
        print(f"{name:28s} {r['median_s'] * 1e3:10.2f} {r['gparam_per_s']:9.3f} "
              f"{r['effective_gb_per_s']:7.1f} {frac * 100 if frac else 0:5.0f}% "
              f"{r['speedup_vs_torch_fused']:7.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


def _measure_profile():
    out = ctypes.c_void_p()
    check(lib.emsa_profile_measure(1, 0, ctypes.byref(out)))
    return out


if __name__ == "__main__":
    main()
