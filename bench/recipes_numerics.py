#!/usr/bin/env python3
"""Issue 19's numerics bar on one device: clipped AdamW, emsa vs torch, every mode.

Small Hugging Face GPT-2 (tied), Llama (GQA), BERT and Qwen2 (tied) from configs
(tests/python/recipe_models.py; --size bench: hidden 256, 4 layers, 128 tokens, vocab 1024),
fp32, eager attention, dropout 0, torch.use_deterministic_algorithms(True); two param groups,
transformers' warmup+cosine schedule, 20 steps with max_grad_norm=1.0, in each mode (step();
step_in_backward; tier="host" in backward; a half budget in backward; the CPU: the first two).
Each run trains torch.optim.AdamW (foreach) + clip_grad_norm_ (the reference), torch's fused
AdamW + clip_grad_norm_(foreach=False), emsa.AdamW(max_grad_norm=1.0) and the reference in
float64, in lockstep for the models with zero-gradient key biases (recipe_models' docstring).
Reported per model and mode: d_emsa (emsa to the reference) and d_torch (fused to the
reference), each fp32 run's distance to float64 (e_*), the steps clipped, emsa's clip_count,
and whether the test's criteria hold (tests/python/test_recipes.py states them). Also the LoRA
model's optimizer state bytes, emsa vs torch.

    python3 bench/recipes_numerics.py [--device cuda] [--size bench] [--out FILE.json]

JSON under bench/results/ by default; a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tests" / "python"))
import emsa  # noqa: E402
import recipe_models as rm  # noqa: E402
import test_recipes as tr  # noqa: E402  (its modes and criteria, so bench and test agree)


def numerics_row(name, device, mode, size, steps):
    def make(model, groups, hyper):
        batch = rm.lm_batches(1, size, device=device)[0]
        kw = tr.mode_kwargs(device, mode, model, dict(input_ids=batch[0], labels=batch[0]),
                            lambda out: out.loss)
        return emsa.AdamW(groups, **hyper, **kw)

    t0 = time.perf_counter()
    r = rm.compare_clipped(name, make, device, steps=steps, size=size, sync=tr.sync)
    r.update(device=device, mode=mode, size=size, wall_s=round(time.perf_counter() - t0, 2))
    r["within_bar"] = tr.within_bar(r)
    r["clip_count_agrees"] = r["emsa_clip_count"] == r["torch_clipped"]
    r["pass"] = (r["within_bar"] and r["clip_count_agrees"] and r["grad_norm_gap"] <= tr.NORM_RTOL)
    return r


def lora_row(device):
    torch.manual_seed(0)
    ref = rm.LoRAModel().to(device)
    ours = rm.LoRAModel().to(device)
    ours.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    kw = {"profile": str(tr.CPU_PROFILE)} if device == "cpu" else {"tier": "device"}
    opt = emsa.AdamW(ours.parameters(), lr=1e-3, **kw)
    x = torch.randn(16, 1024, device=device)
    for m, o in ((ref, ref_opt), (ours, opt)):
        m(x).square().mean().backward()
        o.step()
    tr.sync(opt)
    want, got, arena = tr.state_bytes_torch(ref_opt), tr.state_bytes_emsa(opt), tr.arena_bytes_emsa(opt)
    return {"device": device, "emsa_state_bytes": got, "emsa_arena_bytes": arena,
            "torch_state_bytes": want, "ratio": got / want,
            "pass": abs(got - want) <= 0.01 * want and arena - got < 2 * tr.ARENA_UNIT}


def fmt(x) -> str:
    return f"{'-':>9}" if x is None else f"{x:9.2e}"


def git_rev():
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--models", default=",".join(sorted(rm.SPECS)))
    ap.add_argument("--modes", default=None, help="comma list; default: every mode of the "
                    "device (cpu: step,backward; cuda: step,backward,host,half)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    modes = (args.modes.split(",") if args.modes else
             ["step", "backward"] + (["host", "half"] if args.device == "cuda" else []))
    torch.use_deterministic_algorithms(True)
    rows = []
    for name in args.models.split(","):
        for mode in modes:
            try:
                rows.append(numerics_row(name, args.device, mode, args.size, args.steps))
            except Exception as e:  # one failing mode must not hide the others' numbers
                rows.append({"model": name, "device": args.device, "mode": mode,
                             "error": f"{type(e).__name__}: {e}", "pass": False})
            print(json.dumps(rows[-1]), flush=True)
    lora = lora_row(args.device)
    rev = git_rev()
    out = args.out or str(REPO / "bench" / "results" /
                          f"recipes-numerics-{datetime.date.today()}-{rev}-{args.device}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": str(datetime.date.today()), "git": rev, "torch": torch.__version__,
            "device": (torch.cuda.get_device_name() if args.device == "cuda" else "cpu"),
            "size": args.size, "steps": args.steps, "max_grad_norm": 1.0,
            "criteria": {"accuracy_factor": tr.ACCURACY_FACTOR,
                         "spread_factor": tr.SPREAD_FACTOR, "norm_rtol": tr.NORM_RTOL}}
    Path(out).write_text(json.dumps({"meta": meta, "rows": rows, "lora": lora}, indent=1))
    print(f"\nwrote {out}")
    print(f"{'model':7} {'mode':9} {'d_emsa':>9} {'d_torch':>9} {'e_emsa':>9} {'e_torch':>9} "
          f"{'clipped':>8} {'pass':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:7} {r['mode']:9} ERROR {r['error'][:60]}")
            continue
        print(f"{r['model']:7} {r['mode']:9} {r['d_emsa']:9.2e} {r['d_torch']:9.2e} "
              f"{fmt(r['e_emsa'])} {fmt(r['e_foreach'])} "
              f"{r['emsa_clip_count']:>3}/{r['torch_clipped']:<2}/{r['steps']:<2} "
              f"{'yes' if r['pass'] else 'NO':>5}")
    print(f"LoRA state bytes ({lora['device']}): emsa {lora['emsa_state_bytes']} torch "
          f"{lora['torch_state_bytes']} ratio {lora['ratio']:.4f} "
          f"{'yes' if lora['pass'] else 'NO'}")
    sys.exit(0 if all(r["pass"] for r in rows) and lora["pass"] else 1)


if __name__ == "__main__":
    main()
