#!/usr/bin/env python3
"""How often clipping at max_grad_norm=1.0 fires in a real training run (issue 38, item 5): what a
predictor of "this step will clip" meets in practice.

A GPT-2-small-shaped model (transformers' GPT2LMHeadModel from a config, random init: 12 layers,
d 768, 12 heads, block 512) with a byte-level vocabulary (256: each byte is a token) trains on
real text available offline, the Python standard library's own source files on the machine
(sorted, concatenated; random windows from a seeded generator), bf16 autocast, batch 8 x 512,
emsa.AdamW(max_grad_norm=1.0) on the device in step() mode. Two schedules: Hugging Face
Trainer's defaults (lr 5e-5, linear decay to 0, no warm-up) and a from-scratch one (lr 3e-4, 30
warm-up steps, cosine). Per step: emsa's grad_norm and clipped (step_stats), checked against
torch.nn.utils.get_total_norm of the same gradients. Reported: the fraction of steps that
clipped per 100-step window, the first and last clipped step, and the norm's quartiles.

  python3 bench/clip_rate.py --steps 600 --out clip-rate.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
import emsa  # noqa: E402

BLOCK, BATCH, VOCAB = 512, 8, 256


def corpus() -> tuple[torch.Tensor, dict]:
    """The standard library's .py files as one byte tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    data = b"".join(p.read_bytes() for p in files)
    return (torch.frombuffer(bytearray(data), dtype=torch.uint8).long(),
            {"root": str(root), "files": len(files), "bytes": len(data)})


def model_of(seed: int, layers: int, device: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=768, n_layer=layers, n_head=12,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg).to(device)


def schedule(name: str, steps: int):
    if name == "hf-default":
        return 5e-5, lambda k: max(0.0, 1.0 - k / steps)
    warm = 30
    return 3e-4, lambda k: (k + 1) / warm if k < warm else 0.5 * (
        1 + math.cos(math.pi * (k - warm) / max(1, steps - warm)))


def run(name: str, data: torch.Tensor, steps: int, seed: int, layers: int, device: str,
        batch: int) -> dict:
    model = model_of(seed, layers, device)
    lr, factor = schedule(name, steps)
    opt = emsa.AdamW(model.parameters(), lr=lr, weight_decay=0.0, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    g = torch.Generator().manual_seed(seed)
    data = data.to(device)
    params = [p for p in model.parameters()]
    losses, torch_norms, rows = [], [], []
    for k in range(steps):
        starts = torch.randint(0, data.numel() - BLOCK - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + BLOCK + 1] for s in starts.tolist()])
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        torch_norms.append(torch.nn.utils.get_total_norm([p.grad for p in params]))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if k % 50 == 49:
            rows = opt.step_stats()  # merged across calls; read often, a ring may be short
    rows = opt.step_stats()
    assert [r["step"] for r in rows][-steps:] == list(range(rows[-steps]["step"],
                                                             rows[-steps]["step"] + steps))
    rows = rows[-steps:]
    norms = [float(r["grad_norm"]) for r in rows]
    clipped = [bool(r["clipped"]) for r in rows]
    ref = [float(t) for t in torch_norms]
    worst = max(abs(a - b) / b for a, b in zip(norms, ref))
    windows = [sum(clipped[k:k + 100]) / len(clipped[k:k + 100])
               for k in range(0, len(clipped), 100)]
    hits = [k for k, c in enumerate(clipped) if c]
    q = torch.tensor(norms).quantile(torch.tensor([0.25, 0.5, 0.75])).tolist()
    return {"schedule": name, "lr": lr, "steps": steps, "clip_fraction": sum(clipped) / steps,
            "clip_fraction_per_100": windows, "first_clipped": hits[0] if hits else None,
            "last_clipped": hits[-1] if hits else None, "norm_quartiles": q,
            "max_rel_norm_diff_vs_torch": worst, "clip_count": opt.clip_count,
            "losses": [float(v) for v in losses], "grad_norms": norms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="clip-rate.json")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script only")
    args = ap.parse_args()
    data, source = corpus()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    out = {"benchmark": "clip_rate", "date": datetime.date.today().isoformat(),
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "layers": args.layers, "commit": commit, "torch": torch.__version__,
           "command": " ".join(["python3", "bench/clip_rate.py", *sys.argv[1:]]),
           "corpus": source, "block": BLOCK, "batch": args.batch, "runs": []}
    for name in ("hf-default", "from-scratch"):
        r = run(name, data, args.steps, args.seed, args.layers, args.device, args.batch)
        out["runs"].append(r)
        print(f"{name}: lr {r['lr']}, clipped {r['clip_fraction']:.1%} of {r['steps']} steps; "
              "per 100: " + " ".join(f"{w:.0%}" for w in r["clip_fraction_per_100"])
              + f"; first {r['first_clipped']} last {r['last_clipped']}; norm quartiles "
              + " ".join(f"{v:.3g}" for v in r["norm_quartiles"])
              + f"; loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}; emsa vs torch norm "
              f"{r['max_rel_norm_diff_vs_torch']:.1e}", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
