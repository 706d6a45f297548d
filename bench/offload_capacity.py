#!/usr/bin/env python3
"""Capacity on a 24 GiB GPU: the largest Llama that trains, torch AdamW vs emsa (issue 5, part 5).

The GPU is capped at --gpu-mem (default 24 GiB): torch.cuda.set_per_process_memory_fraction for
torch's allocator, and the same figure as emsa's budget (emsa's own device arena is outside
torch's allocator; the budget covers it). Batch 1 x 1024 tokens, activation checkpointing on
every decoder layer, random init directly on the device in the training dtype.
  torch: fp32 parameters, bf16 autocast, torch.optim.AdamW(fused=True): 16 B/param on the GPU
         (parameter, gradient, two moments) before activations.
  emsa:  bf16 parameters on the GPU; emsa.AdamW(tier="host", budget=--gpu-mem) keeps the fp32
         master and both moments in pinned host memory, and with step_in_backward (default on)
         each gradient is copied out and released during backward, so the GPU holds 2 B/param
         plus activations and transient gradients.
A size passes when 3 training steps complete. Each (optimizer, size) runs in its own process,
so an OOM cannot poison the next; sizes go up until one fails, larger ones are then skipped.
Reported per run: parameters, peak device memory (torch's peak + emsa's device arena), reserved
memory, tokens/s (median of steps 2..3), or where it failed. Then emsa's measured peak on
llama-2-7b against `python -m emsa plan --model llama-2-7b ... --json -`, the planner's
prediction for the same setup without a probe.

Host memory: emsa with fp32 state pins about 16 B/param (7 B: ~108 GB); a size whose pinned
arena would not fit in the host's available memory is skipped with a message rather than
starting a run that would swap the machine. The whole run takes under ~8 minutes on an H200.
--dry-run runs tiny models on the CPU with an emulated memory cap, to check the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offload_e2e import (GIB, REPO, emsa_adamw, make_llama, provenance,  # noqa: E402
                         write_result)

TOKENS = 1024
STEPS = 3

# Llama-architecture shapes (vocab 32000 unless the original has another): TinyLlama 1.1B,
# a 1.5B between it and the 3B, OpenLLaMA 3B, llama-2-7b, llama-3-8b, llama-2-13b.
SIZES = {
    "1.1b": dict(hidden_size=2048, num_hidden_layers=22, intermediate_size=5632,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
    "1.5b": dict(hidden_size=2048, num_hidden_layers=26, intermediate_size=5632,
                 num_attention_heads=16, num_key_value_heads=16, vocab_size=32000),
    "3b": dict(hidden_size=3200, num_hidden_layers=26, intermediate_size=8640,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "7b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "13b": dict(hidden_size=5120, num_hidden_layers=40, intermediate_size=13824,
                num_attention_heads=40, num_key_value_heads=40, vocab_size=32000),
}
DRY_SIZES = {
    "tiny1": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256),
    "tiny2": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=512),
    "tiny3": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=1024),
}
DRY_CAP_BYTES = 8 << 20  # the dry run's emulated device memory
PLAN_MODEL = "7b"  # the size compared with `python -m emsa plan --model llama-2-7b`


def llama_params(s: dict) -> int:
    h, i, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; mlp; two norms
    return 2 * v * h + s["num_hidden_layers"] * layer + h  # embedding, head, final norm


def device_bytes_per_param(opt: str) -> int:
    """What must sit on the device per parameter before activations (for the dry run's cap)."""
    return 16 if opt == "torch" else 2


def host_bytes_per_param(state_dtype: str) -> int:
    """emsa's pinned host arena per bf16 parameter: gradient in, fp32 master, two moments,
    the bf16 parameter out (the planner's TierViews for L2)."""
    return 2 + 4 + 2 * (4 if state_dtype == "fp32" else 2) + 2


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ---- one run, in its own process ---------------------------------------------------------------

def enable_checkpointing(model) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def worker(args) -> dict:
    import torch

    opt_name, size = args.worker
    shape = (DRY_SIZES if args.dry_run else SIZES)[size]
    out = dict(optimizer=opt_name, size=size, params=llama_params(shape), ok=False,
               phase="start")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    cap = DRY_CAP_BYTES if args.dry_run else args.gpu_mem
    if device.type == "cuda":
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        out.update(device=torch.cuda.get_device_name(device), device_total_bytes=total)
    emsa_run = opt_name == "emsa"
    try:
        if args.dry_run and out["params"] * device_bytes_per_param(opt_name) > cap:
            raise torch.OutOfMemoryError(f"dry run: {out['params']} params need more than the "
                                         f"emulated {cap} B device")
        out["phase"] = "model init"
        model = make_llama(shape, device, torch.bfloat16 if emsa_run else torch.float32)
        enable_checkpointing(model)
        out["phase"] = "optimizer"
        if emsa_run:
            record = model_record(shape, args) if args.emsa_plan == "model" else None
            # Named: the analytic record's order is not the model's, its names are.
            params = (list(model.named_parameters()) if record is not None
                      else list(model.parameters()))
            opt = emsa_adamw(params,
                             "host" if args.emsa_plan == "host" else None, budget=cap,
                             probe=record, step_in_backward=args.step_in_backward,
                             state_dtype=torch.bfloat16 if args.state_dtype == "bf16"
                             else torch.float32, _dry_run=args.dry_run)
            out.update(device_arena_bytes=opt.plan.device_arena_bytes,
                       host_arena_bytes=opt.plan.host_arena_bytes,
                       predicted_peak_bytes=opt.plan.json["prediction"]["peak_device_bytes"])
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        g = torch.Generator(device=device).manual_seed(0)
        ids = torch.randint(0, shape["vocab_size"], (1, args.tokens if not args.dry_run else 64),
                            generator=g, device=device)
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                    if not emsa_run and device.type == "cuda" else contextlib.nullcontext())
        times, losses = [], []
        for i in range(STEPS):
            out["phase"] = f"step {i + 1}"
            _sync(device)
            t0 = time.perf_counter()
            with autocast:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        step_s = statistics.median(times[1:])
        out.update(ok=True, phase="done", step_times_s=times, losses=losses,
                   tokens_per_s=ids.numel() / step_s)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            out.update(torch_peak_bytes=torch.cuda.max_memory_allocated(device),
                       torch_reserved_peak_bytes=torch.cuda.max_memory_reserved(device),
                       device_used_after_bytes=total - free)
            out["peak_device_bytes"] = out["torch_peak_bytes"] + out.get("device_arena_bytes", 0)
    except torch.OutOfMemoryError as e:
        out.update(error="out of memory", detail=str(e).splitlines()[0][:300])
    except Exception as e:  # noqa: BLE001 - the parent reports it; an InfeasibleBudgetError too
        out.update(error=type(e).__name__, detail=traceback.format_exc(limit=4)[-1500:])
    return out


def model_record(shape: dict, args):
    """The analytic probe `emsa plan --model` makes for this shape (a Hugging Face config built
    from it), so the run uses the planner's own split of the state under the budget: the
    configuration whose predicted peak `emsa plan --model ... --gpu-mem` prints."""
    import emsa
    from emsa._native.models import model_probe

    config = json.dumps({"model_type": "llama", "tie_word_embeddings": False,
                         "max_position_embeddings": 4096, **shape})
    text, _ = model_probe(config, seq_len=args.tokens if not args.dry_run else 64,
                          checkpointing=True, param_dtype="bf16")
    return emsa.ProbeRecord.from_json(text)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the sweep ---------------------------------------------------------------------------------

def run_one(args, opt: str, size: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", opt, size, "--worker-out", str(path),
               "--gpu-mem", str(args.gpu_mem), "--state-dtype", args.state_dtype,
               "--tokens", str(args.tokens), "--emsa-plan", args.emsa_plan]
        cmd += [] if args.step_in_backward else ["--no-step-in-backward"]
        cmd += ["--dry-run"] if args.dry_run else []
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = "timeout", (e.stderr or b"").decode(errors="replace")[-800:]
        wall = time.perf_counter() - t0
        if path.exists():
            result = json.loads(path.read_text())
        else:
            result = dict(optimizer=opt, size=size, ok=False,
                          error=f"worker ended without a result (rc {rc})",
                          detail=err.strip()[-800:])
    result.update(wall_s=wall, rc=rc)
    return result


def sweep(args) -> dict:
    sizes = DRY_SIZES if args.dry_run else SIZES
    names = [s for s in args.sizes.split(",") if s] if args.sizes else list(sizes)
    unknown = [s for s in names if s not in sizes]
    if unknown:
        raise SystemExit(f"--sizes: unknown {unknown}; choose from {list(sizes)}")
    deadline = time.perf_counter() + args.time_limit
    runs = []
    for opt in [o for o in args.optimizers.split(",") if o]:
        failed = None
        for size in names:
            n = llama_params(sizes[size])
            base = dict(optimizer=opt, size=size, params=n, ok=False)
            left = deadline - time.perf_counter()
            need = n * host_bytes_per_param(args.state_dtype)
            avail = mem_available()
            if failed:
                runs.append({**base, "skipped": f"{failed} failed already"})
            elif left < 30:
                runs.append({**base, "skipped": f"--time-limit {args.time_limit:.0f} s reached"})
            elif opt == "emsa" and not args.dry_run and avail and need > 0.95 * avail:
                runs.append({**base, "skipped": f"its pinned host arena (~{need / GIB:.0f} GiB) "
                             f"exceeds 95% of the host's available {avail / GIB:.0f} GiB: "
                             "run on a host with more memory or pass --state-dtype bf16"})
            else:
                print(f"{opt} {size} ({params_text(n)} params) ...", flush=True)
                r = run_one(args, opt, size, min(args.run_timeout, left))
                print(f"  {'ok' if r['ok'] else 'failed: ' + r.get('error', '?')} "
                      f"({r['wall_s']:.0f} s)", flush=True)
                runs.append(r)
                if not r["ok"]:
                    failed = size
    return dict(runs=runs)


def planner_prediction(args) -> dict:
    """What `python -m emsa plan --model llama-2-7b ...` predicts: the command as issue 5 gives
    it, and with the flags that match the measured emsa runs (all state on the host, updates in
    backward or not), where this CLI has them."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))

    def emsa_cli(cmd: list[str]):
        return subprocess.run([sys.executable, "-m", "emsa", *cmd], capture_output=True,
                              text=True, timeout=120, env=env, cwd=REPO)

    base = ["plan", "--model", "llama-2-7b", "--gpu-mem", size_text(args.gpu_mem), "--batch",
            "1", "--seq", str(args.tokens), "--checkpointing", "--param-dtype", "bf16", "--json",
            "-"]
    try:
        usage = emsa_cli(["plan", "--help"]).stdout
    except subprocess.TimeoutExpired:
        usage = ""
    matching = ["--all-host"] if args.emsa_plan == "host" else []
    matching += ["--step-in-backward"] if args.step_in_backward else ["--keep-grads"]
    matching += ["--state-dtype", "bf16"] if args.state_dtype == "bf16" else []
    out = {}
    for key, extra in (("as_given", []),
                       ("matching_runs", [f for f in matching if f in usage or f == "bf16"])):
        cmd = base + extra
        entry: dict = dict(command="python -m emsa " + " ".join(cmd))
        try:
            proc = emsa_cli(cmd)
        except subprocess.TimeoutExpired:
            out[key] = dict(entry, error="timed out after 120 s")
            continue
        entry["rc"] = proc.returncode
        if proc.returncode == 0:
            plan = json.loads(proc.stdout)
            entry.update(prediction=plan["prediction"], budget_bytes=plan.get("budget_bytes"),
                         l2_params=sum(p["tier"] == "L2" for p in plan["params"]))
        else:
            msg = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
            absent = "--model" not in usage
            entry["error"] = ("`python -m emsa plan --model` is not available in this build "
                              f"(it needs the model-preset planner CLI): {msg}" if absent
                              else f"failed: {msg}")
        out[key] = entry
    return out


def largest(runs: list[dict], opt: str) -> dict | None:
    ok = [r for r in runs if r["optimizer"] == opt and r["ok"]]
    return max(ok, key=lambda r: r["params"]) if ok else None


def table(result: dict) -> str:
    lines = [f"\ncapacity under {result['gpu_mem_bytes'] / GIB:.3g} GiB ({result['device']}), "
             f"batch 1x{result['tokens']}, checkpointing, emsa plan: {result['emsa_plan']}"]
    lines.append(f"  {'size':6} {'params':>8}  {'optimizer':9} {'result':>10} {'peak GiB':>9} "
                 f"{'rsvd GiB':>9} {'tokens/s':>9}")
    for r in result["runs"]:
        if r["ok"]:
            peak = f"{r.get('peak_device_bytes', 0) / GIB:9.2f}"
            rsvd = f"{r.get('torch_reserved_peak_bytes', 0) / GIB:9.2f}"
            status = f"{'fits':>10} {peak} {rsvd} {r['tokens_per_s']:9.0f}"
        else:
            status = f"  {r.get('skipped') or r.get('error', '?')} {r.get('phase', '')}".rstrip()
        lines.append(f"  {r['size']:6} {params_text(r['params']):>8}  {r['optimizer']:9} {status}")
    for opt in ("torch", "emsa"):
        best = result["largest"].get(opt)
        lines.append(f"  largest that fits, {opt}: "
                     + (f"{best['size']} ({params_text(best['params'])} params)" if best
                        else "none"))
    for key, text in result.get("plan_vs_measured", {}).items():
        lines.append(f"  {PLAN_MODEL} vs `emsa plan --model` ({key}): {text}")
    return "\n".join(lines)


def compare_with_plan(runs: list[dict], planned: dict) -> dict:
    measured = next((r for r in runs if r["optimizer"] == "emsa" and r["size"] == PLAN_MODEL
                     and r["ok"]), None)
    out = {}
    for key, entry in planned.items():
        if "prediction" not in entry:
            out[key] = entry.get("error", "no prediction")
            continue
        pred = entry["prediction"]["peak_device_bytes"]
        if measured:
            out[key] = (f"predicted peak {pred / GIB:.2f} GiB, measured "
                        f"{measured['peak_device_bytes'] / GIB:.2f} GiB "
                        f"(ratio {pred / measured['peak_device_bytes']:.2f})")
        else:
            out[key] = f"predicted peak {pred / GIB:.2f} GiB; no measured {PLAN_MODEL} run"
    return out


def size_text(nbytes: int) -> str:
    return f"{nbytes >> 30}GiB" if nbytes % (1 << 30) == 0 else str(nbytes)


def params_text(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def parse_bytes(text: str) -> int:
    units = {"gib": 1 << 30, "mib": 1 << 20, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for u, mult in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * mult)
    return int(t)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gpu-mem", type=parse_bytes, default=24 << 30, help="e.g. 24GiB")
    ap.add_argument("--sizes", default="", help="comma-separated subset of the sizes")
    ap.add_argument("--optimizers", default="torch,emsa", help="torch, emsa or both")
    ap.add_argument("--tokens", type=int, default=TOKENS, help="sequence length (batch 1)")
    ap.add_argument("--emsa-plan", choices=["host", "model"], default="host",
                    help="host: all state on the host; model: the split `emsa plan --model` "
                         "chooses under the budget (its analytic probe as probe=)")
    ap.add_argument("--state-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="emsa's Adam state precision (bf16: 12 instead of 16 B/param pinned)")
    ap.add_argument("--no-step-in-backward", dest="step_in_backward", action="store_false",
                    help="emsa updates in step(): every gradient is held until then")
    ap.add_argument("--time-limit", type=float, default=450.0, help="seconds for the sweep")
    ap.add_argument("--run-timeout", type=float, default=240.0, help="seconds per run")
    ap.add_argument("--out", default="")
    ap.add_argument("--dry-run", action="store_true", help="tiny models on the CPU")
    ap.add_argument("--worker", nargs=2, metavar=("OPTIMIZER", "SIZE"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(worker(args)))
        return
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("offload_capacity: needs a CUDA GPU (scripts/gpu-check capacity); --dry-run "
                 "runs tiny models on the CPU")
    # No CUDA in this process: each worker gets the whole device.
    result = provenance("offload-capacity", torch.device("cpu"))
    result.update(gpu_mem_bytes=DRY_CAP_BYTES if args.dry_run else args.gpu_mem,
                  tokens=args.tokens, emsa_plan=args.emsa_plan, steps=STEPS,
                  emsa_state_dtype=args.state_dtype, emsa_step_in_backward=args.step_in_backward,
                  host_mem_available_bytes=mem_available())
    result.update(sweep(args))
    result["device"] = next((r["device"] for r in result["runs"] if "device" in r),
                            "cpu (dry run)" if args.dry_run else "unknown")
    result["largest"] = {opt: largest(result["runs"], opt) for opt in ("torch", "emsa")}
    result["planner"] = planner_prediction(args)
    result["plan_vs_measured"] = compare_with_plan(result["runs"], result["planner"])
    write_result(result, args, table(result))


if __name__ == "__main__":
    main()
