#!/usr/bin/env python3
"""Time to the first step (issue 22): what a new user waits for before training runs at speed.

Each case runs in its own process, in the order a new user meets it:
  1b  0.95 B Llama (hidden 2048, 16 layers, ffn 5632, 16 heads, vocab 32000; fp32 parameters,
      bf16 autocast), batch 4 x 512: emsa.probe; emsa.AdamW(tier="host", step_in_backward=True,
      probe=record), all Adam state on the host; the first training step; the steady step
      (median of the steps after the second); then, for reference, one torch training step
      (torch.optim.AdamW fused on the device, median of 3 after 2 warm-ups).
  7b  llama-2-7b shape (hidden 4096, 32 layers, ffn 11008, 32 heads, vocab 32000; bf16
      parameters on the GPU, activation checkpointing), batch 1 x 1024: from the constructor's
      call, emsa.AdamW(tier="host", step_in_backward=True, budget="24GiB") with no probe, to the
      end of the first step; then the steady step.
  torch1b  (only with --only) the 1b model trained with torch's fused AdamW alone, as its
      process's first GPU work: the first step a user pays without emsa, the reference for the
      probe in a machine's first process (which pays the same first-use costs in its warm-up).
A step is forward, backward (emsa updates in backward), step(), zero_grad(), then a device
synchronize; each step's forward and backward are timed too (a synchronize after each), so a
slow first step shows where its time goes. opt.setup_stats() (set-up phases, host memory)
(bytes page-locked and pageable, how the arena was pinned) and the plan's arena sizes are kept,
and printed: each phase with its parts (host_arena: fill and pin of the locked prefix, populate:
the pageable rest in the background, populate_wait: what the first step waited for it; bind:
views, masters, tables, host_tier).

Bars: probe <= torch step + 1 s; constructor (1b) <= 2 s; first step <= 2x steady (1b);
7b constructor-to-end-of-first-step <= 15 s, steady step no slower than 1.6 s.
JSON: bench/results/first_step-<date>.json; a table with the bars is printed last.

--dry-run runs tiny Llamas on the CPU (bars not judged) to check this script, its JSON and
its table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench"))

from offload_capacity import SIZES, enable_checkpointing  # noqa: E402
from offload_e2e import LLAMA_1B, LLAMA_TINY, make_llama, provenance  # noqa: E402

SHAPES = {"1b": LLAMA_1B, "7b": SIZES["7b"]}
DRY_SHAPES = {"1b": LLAMA_TINY, "7b": dict(LLAMA_TINY, hidden_size=96, intermediate_size=192)}
BATCH = {"1b": (4, 512), "7b": (1, 1024)}
DRY_BATCH = {"1b": (2, 32), "7b": (1, 64)}
STEPS = {"1b": 7, "7b": 4}  # emsa steps per case: the first, one more, then the steady ones
BUDGET_7B = "24GiB"
TODAY_7B_STEP_S = 1.6  # issue 22: the 7b steady step must be no slower
CASE_TIMEOUT_S = 240


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(model, opt, ids, ctx, device, count: int) -> list[dict]:
    """count training steps, each as {"step_s", "forward_s", "backward_s"} of wall time."""
    out = []
    for _ in range(count):
        sync(device)
        t0 = time.perf_counter()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        opt.step()
        t_step = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        sync(device)
        t3 = time.perf_counter()
        # step_call_s: opt.step() itself; the rest of the step's tail is the wait for the GPU
        # (with step_in_backward, the host tier's last uploads).
        out.append(dict(step_s=t3 - t0, forward_s=t1 - t0, backward_s=t2 - t1,
                        step_call_s=t_step - t2, loss=float(loss.detach())))
    return out


def optimizer_facts(opt) -> dict:
    """Set-up phases, host memory, arena sizes, and the engine's own per-step times (GPU time,
    host-tier copy and CPU busy times, forward waits): a slow first step shows which part of
    emsa, if any, it spent in."""
    stats = opt.setup_stats()
    return dict(setup_times=dict(stats["times"]), host_memory=stats["host_memory"],
                device_arena_bytes=opt.plan.device_arena_bytes,
                host_arena_bytes=opt.plan.host_arena_bytes,
                engine_steps=opt.step_stats())


def steady(steps: list[dict]) -> float:
    """Median over the steps after the second (the second may still settle)."""
    rest = steps[2:] or steps[1:] or steps
    return statistics.median(s["step_s"] for s in rest)


def model_1b(device, dry: bool):
    """The 1b case's Llama, its batch of token ids and its bf16 autocast context."""
    shape = (DRY_SHAPES if dry else SHAPES)["1b"]
    batch, seq = (DRY_BATCH if dry else BATCH)["1b"]
    model = make_llama(shape, device)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device=device)
    return model, ids, torch.autocast(device.type, dtype=torch.bfloat16)


def torch_steps(model, ids, ctx, device, count: int) -> list[dict]:
    """count timed steps of torch's AdamW (fused on a GPU): the reference."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    return timed_steps(model, opt, ids, ctx, device, count)


def case_1b(device, dry: bool) -> dict:
    import emsa

    model, ids, ctx = model_1b(device, dry)
    out = dict(params=sum(p.numel() for p in model.parameters()), batch=list(ids.shape))
    sync(device)
    t0 = time.perf_counter()
    with ctx:
        record = emsa.probe(model, input_ids=ids, labels=ids)
    out["probe_s"] = time.perf_counter() - t0
    out["probe_setup_times"] = dict(getattr(record, "setup_times", {}) or {})
    t0 = time.perf_counter()
    opt = emsa.AdamW(model.parameters(), lr=1e-5, tier="host", step_in_backward=True,
                     probe=record)
    out["ctor_s"] = time.perf_counter() - t0
    steps = timed_steps(model, opt, ids, ctx, device, STEPS["1b"])
    opt.synchronize()
    out.update(optimizer_facts(opt), steps=steps, first_step_s=steps[0]["step_s"],
               steady_step_s=steady(steps))
    del opt, record
    model.zero_grad(set_to_none=True)
    ref = torch_steps(model, ids, ctx, device, 5)
    out["torch_step_s"] = statistics.median(s["step_s"] for s in ref[2:])
    out["torch_steps"] = ref
    return out


def case_torch1b(device, dry: bool) -> dict:
    t0 = time.perf_counter()
    model, ids, ctx = model_1b(device, dry)
    sync(device)
    out = dict(model_s=time.perf_counter() - t0, batch=list(ids.shape))
    steps = torch_steps(model, ids, ctx, device, 6)
    out.update(steps=steps, first_step_s=steps[0]["step_s"], steady_step_s=steady(steps))
    return out


def case_7b(device, dry: bool) -> dict:
    import emsa

    shape = (DRY_SHAPES if dry else SHAPES)["7b"]
    batch, seq = (DRY_BATCH if dry else BATCH)["7b"]
    model = make_llama(shape, device, torch.bfloat16)
    enable_checkpointing(model)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device=device)
    out = dict(params=sum(p.numel() for p in model.parameters()), batch=[batch, seq],
               budget=BUDGET_7B)
    sync(device)
    t0 = time.perf_counter()
    opt = emsa.AdamW(model.parameters(), lr=1e-5, tier="host", step_in_backward=True,
                     budget=BUDGET_7B)
    out["ctor_s"] = time.perf_counter() - t0
    steps = timed_steps(model, opt, ids, contextlib.nullcontext(), device, STEPS["7b"])
    out["ctor_to_first_end_s"] = out["ctor_s"] + steps[0]["step_s"]
    opt.synchronize()
    out.update(optimizer_facts(opt), steps=steps, first_step_s=steps[0]["step_s"],
               steady_step_s=steady(steps))
    return out


def child(args) -> None:
    """One case in this process; its result as JSON into args.child_out."""
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        cases = {"1b": case_1b, "7b": case_7b, "torch1b": case_torch1b}
        result = dict(ok=True, **cases[args.case](device, args.dry_run))
    except Exception as e:  # noqa: BLE001  the parent reports it in the table
        result = dict(ok=False, error=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc())
    Path(args.child_out).write_text(json.dumps(result, indent=1))


def run_case(case: str, dry: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        cmd = [sys.executable, __file__, "--case", case, "--child-out", str(out)]
        if dry:
            cmd.append("--dry-run")
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return dict(ok=False, error=f"timed out after {CASE_TIMEOUT_S} s")
        result = (json.loads(out.read_text()) if out.is_file()
                  else dict(ok=False, error=f"exit {proc.returncode}",
                            stderr=proc.stderr[-4000:]))
        result["process_s"] = time.perf_counter() - start
        return result


def bars(results: dict) -> list[tuple[str, str, str, str]]:
    """(what, measured, bar, verdict) rows."""
    rows = []

    def row(what, value, limit, text):
        verdict = "n/a" if value is None or limit is None else (
            "PASS" if value <= limit else "FAIL")
        shown = "-" if value is None else f"{value:.3f} s"
        rows.append((what, shown, text, verdict))

    if not any(case in results for case in ("1b", "7b")):
        return rows  # --only torch1b: no emsa case, no bars
    a, b = results.get("1b", {}), results.get("7b", {})
    if a.get("ok"):
        row("1b probe", a["probe_s"], a["torch_step_s"] + 1.0,
            f"<= torch step + 1 s = {a['torch_step_s'] + 1.0:.3f} s")
        row("1b constructor (tier=host)", a["ctor_s"], 2.0, "<= 2 s")
        row("1b first step", a["first_step_s"], 2 * a["steady_step_s"],
            f"<= 2x steady = {2 * a['steady_step_s']:.3f} s")
        row("1b steady step", a["steady_step_s"], None, "(torch step "
            f"{a['torch_step_s']:.3f} s)")
    else:
        rows.append(("1b", "-", a.get("error", "not run"), "FAIL"))
    if b.get("ok"):
        row("7b constructor to end of first step", b["ctor_to_first_end_s"], 15.0, "<= 15 s")
        row("7b steady step", b["steady_step_s"], TODAY_7B_STEP_S,
            f"<= {TODAY_7B_STEP_S} s (today's)")
    else:
        rows.append(("7b", "-", b.get("error", "not run"), "FAIL"))
    return rows


def phases(times: dict) -> str:
    """Each top-level phase with its parts: "host_arena 3.2 (fill 1.1, pin 2.0), bind ..."."""
    parts: dict[str, list[str]] = {}
    for k, v in times.items():
        top, _, part = k.partition(".")
        parts.setdefault(top, [])
        if part:
            parts[top].append(f"{part} {v:.3f}")
    out = []
    for top, sub in parts.items():
        shown = f"{top} {times[top]:.3f}" if top in times else top
        out.append(shown + (f" ({', '.join(sub)})" if sub else ""))
    return ", ".join(out)


def print_table(results: dict, dry: bool) -> None:
    for case in ("1b", "7b"):
        r = results.get(case, {})
        if r.get("ok"):
            print(f"{case} opt setup times (s): {phases(r.get('setup_times', {})) or '-'}")
            mem = r.get("host_memory") or {}
            arenas = mem.get("arenas") or [{}]
            print(f"{case} host memory: {mem.get('locked_bytes', 0) / 2**30:.2f} GiB locked, "
                  f"{mem.get('pageable_bytes', 0) / 2**30:.2f} GiB pageable, arena: "
                  f"{arenas[0].get('pin', '-')}, huge pages {arenas[0].get('huge_pages', '-')}"
                  + (f" ({arenas[0]['fallback_reason']})"
                     if arenas[0].get("fallback_reason") else ""))
            first = r["steps"][0]
            engine = r.get("engine_steps") or []
            if engine and "cpu_s" in engine[0]:
                keys = ("time_s", "d2h_s", "cpu_s", "h2d_s", "wait_s", "grad_wait_s")
                for row in engine[:3]:
                    print(f"{case} engine step {row['step']}: " + ", ".join(
                        f"{k} {row[k]:.3f}" for k in keys if row.get(k) is not None))
            print(f"{case} first step: forward {first['forward_s']:.3f} s, backward (with the "
                  f"update) {first['backward_s']:.3f} s, total {first['step_s']:.3f} s; steps: "
                  + " ".join(f"{s['step_s']:.3f}" for s in r["steps"]))
    t = results.get("torch1b", {})
    if t.get("ok"):
        first = t["steps"][0]
        print(f"torch1b (torch alone, its process's first GPU work): first step "
              f"{first['step_s']:.3f} s (forward {first['forward_s']:.3f}, backward "
              f"{first['backward_s']:.3f}), steady {t['steady_step_s']:.3f} s")
    rows = bars(results)
    if not rows:
        return
    if dry:
        rows = [(w, m, b, "n/a (dry run)") for w, m, b, _ in rows]
    widths = [max(len(r[i]) for r in rows + [("what", "measured", "bar", "verdict")])
              for i in range(4)]
    for r in [("what", "measured", "bar", "verdict")] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny models on the CPU")
    ap.add_argument("--only", choices=["1b", "7b", "torch1b"], help="one case")
    ap.add_argument("--out", default="", help="JSON path (default bench/results/first_step-"
                    "<date>.json; a dry run's goes to the temporary folder)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        child(args)
        return
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("first_step: needs a CUDA GPU (or --dry-run)")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    results = dict(provenance("first_step", device), dry_run=args.dry_run)
    for case in [args.only] if args.only else ["1b", "7b"]:
        print(f"running {case} ...", file=sys.stderr, flush=True)
        results[case] = run_case(case, args.dry_run)
    results["bars"] = [dict(zip(("what", "measured", "bar", "verdict"), r))
                       for r in bars(results)]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    # A dry run's figures are no result: its JSON goes to the temporary folder.
    folder = Path(tempfile.gettempdir()) if args.dry_run else REPO / "bench" / "results"
    path = Path(args.out) if args.out else folder / f"first_step-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")
    print_table(results, args.dry_run)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
