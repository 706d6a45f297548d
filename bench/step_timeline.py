"""Where a host-tier step's time goes: bench/offload_e2e.py's Llama trained with emsa
(tier="host" or the half budget, step_in_backward), a few steps recorded by torch.profiler (CUPTI
sees every copy and kernel of the process, emsa's own streams included).

Per recorded step (from one forward's first kernel to the next's): the step, the host's forward
span, the compute stream's busy time; each PCIe direction's busy time and, per stream, the bytes,
time and rate of its copies (emsa's streams: the CPU path's parameter uploads, the GPU path's
moments up and down, the gradients down); 2 ms bins of link and compute utilisation; and what the
autograd thread did (its operators' count and time, its kernel launches' median). Step times
without the profiler come first, for comparison.

JSON: bench/results/step-timeline-<mode>-<shape>-<date>.json unless --out.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offload_e2e as oe  # noqa: E402


def union(intervals) -> float:
    total, cur = 0.0, None
    for a, b in sorted(intervals):
        if cur is None or a > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + (cur[1] - cur[0] if cur is not None else 0.0)


def clip(intervals, lo, hi):
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def analyse(events: list[dict]) -> dict:
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e]
    streams = collections.defaultdict(list)
    for e in gpu:
        streams[e["args"].get("stream")].append(e)
    compute = max(streams, key=lambda s: sum(1 for e in streams[s] if e["cat"] == "kernel"))
    forwards = sorted((e for e in events if e.get("cat") == "gpu_user_annotation"
                       and e["name"].startswith("forward")), key=lambda e: e["ts"])
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in streams[compute] if e["cat"] == "kernel"]
    copies = {d: [(e["ts"], e["ts"] + e["dur"], e["args"].get("stream"), e["args"].get("bytes", 0))
                  for e in gpu if e["cat"] == "gpu_memcpy" and d in e["name"]]
              for d in ("HtoD", "DtoH")}
    steps = []
    for k in range(len(forwards) - 1):
        t0, t1 = forwards[k]["ts"], forwards[k + 1]["ts"]
        row = dict(step_ms=(t1 - t0) / 1e3, forward_span_ms=forwards[k]["dur"] / 1e3,
                   compute_busy_ms=union(clip(kernels, t0, t1)) / 1e3)
        for d, name in (("HtoD", "up"), ("DtoH", "down")):
            mine = [c for c in copies[d] if t0 <= c[0] < t1]
            row[f"{name}_busy_ms"] = union(clip([(a, b) for a, b, _, _ in mine], t0, t1)) / 1e3
            per = collections.defaultdict(lambda: [0, 0, 0.0])
            for a, b, s, n in mine:
                per[s][0] += 1
                per[s][1] += n
                per[s][2] += (b - a) / 1e3
            row[f"{name}_by_stream"] = {str(s): dict(copies=v[0], gb=v[1] / 1e9, ms=v[2],
                                                     gb_per_s=v[1] / 1e6 / max(v[2], 1e-9))
                                        for s, v in per.items()}
        bins, t = [], t0
        while t < t1:
            def busy(iv):
                return round(union(clip(iv, t, t + 2000.0)) / 2000.0, 2)
            bins.append([round((t - t0) / 1e3), busy([(a, b) for a, b, _, _ in copies["HtoD"]]),
                         busy([(a, b) for a, b, _, _ in copies["DtoH"]]), busy(kernels)])
            t += 2000.0
        row["bins_ms_up_down_compute"] = bins
        steps.append(row)
    # The two threads with the most CPU operators: the main thread (forward) and autograd's.
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e["tid"]].append(e)
    main_tid = next((e["tid"] for e in events if e.get("cat") == "user_annotation"
                     and e["name"].startswith("forward")), None)
    cpu_threads = sorted(ops, key=lambda t: -len(ops[t]))
    autograd = {}
    for tid in cpu_threads[:2]:
        top, end = [], -1.0
        for e in sorted(ops[tid], key=lambda e: e["ts"]):
            if e["ts"] >= end:
                top.append(e)
                end = e["ts"] + e["dur"]
        launches = sorted(e["dur"] for e in events if e.get("tid") == tid
                          and e.get("cat") == "cuda_runtime" and e["name"] == "cudaLaunchKernel")
        autograd[str(tid)] = dict(operators=len(top), operators_ms=sum(e["dur"] for e in top) / 1e3,
                                  launches=len(launches),
                                  launch_median_us=launches[len(launches) // 2] if launches else 0)
    return dict(compute_stream=compute, main_thread=main_tid, steps=steps, cpu_threads=autograd)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=("host", "half"), default="host")
    ap.add_argument("--shape", default="4x512")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import emsa

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    batch, seq = (int(x) for x in args.shape.split("x"))
    warm, plain, recorded = 3, 6, 4
    batches = oe.token_batches(oe.LLAMA_1B["vocab_size"], batch, seq, warm + plain + recorded,
                               device)
    profile = emsa.measure_profile(measure_bandwidth=True)
    model = oe.make_llama(oe.LLAMA_1B, device)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16)
    with ctx:
        record = emsa.probe(model, input_ids=batches[0], labels=batches[0], profile=profile,
                            trace=False)
    budget = oe.half_budget(record, True)["budget_bytes"] if args.mode == "half" else None
    opt = emsa.AdamW(model.parameters(), **oe.HYPER, tier="host" if args.mode == "host" else None,
                     probe=record, budget=budget, step_in_backward=True)
    marks = []

    def step(i):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append(e)
        with torch.profiler.record_function(f"forward{i}"), ctx:
            loss = model(input_ids=batches[i], labels=batches[i]).loss
        with torch.profiler.record_function(f"backward{i}"):
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(warm + plain):
        step(i)
    torch.cuda.synchronize()
    plain_ms = [marks[i].elapsed_time(marks[i + 1]) for i in range(warm, warm + plain - 1)]
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(warm + plain, warm + plain + recorded):
            step(i)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    result = oe.provenance("step-timeline", device)
    result.update(mode=args.mode, shape=args.shape, plain_steps_ms=plain_ms,
                  plain_step_median_ms=statistics.median(plain_ms),
                  predicted=opt.plan.json["prediction"], stats=opt.step_stats()[-recorded:],
                  **analyse(events))
    print(f"steps without the profiler: median {result['plain_step_median_ms']:.1f} ms; plan "
          f"{result['predicted']['step_time'] * 1e3:.1f} ms")
    for row in result["steps"]:
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                          if k != "bins_ms_up_down_compute"}))
    print("CPU threads (operators, their ms, launches, median launch us):", result["cpu_threads"])
    name = f"step-timeline-{args.mode}-{args.shape}"
    print(f"JSON: {oe.write_json(result, args.out, name)}")


if __name__ == "__main__":
    main()
