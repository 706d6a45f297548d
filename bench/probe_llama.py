#!/usr/bin/env python3
"""Probe + plan cost on a ~1 B-parameter Llama (transformers LlamaConfig, random init, GPU).

Bar (issue 4): emsa.probe + emsa.make_plan <= one training step + 1 s, and the model's state
(parameters, gradients, buffers, RNG, train flag) after the probe is bitwise what it was before.
A training step here is forward + backward (bf16 autocast, fp32 params) + torch.optim.AdamW
(fused) step, batch 4 x 512 tokens; its time is the median of 3 after 2 warm-ups. The probe's
time includes everything a user pays: measuring the device profile and loading the library.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))


def snapshot(model):
    return dict(
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        grads={n: (None if p.grad is None else p.grad.detach().clone())
               for n, p in model.named_parameters()},
        buffers={n: b.detach().clone() for n, b in model.named_buffers()},
        rng_cpu=torch.get_rng_state().clone(), rng_cuda=torch.cuda.get_rng_state().clone(),
        training=model.training)


def same(a, b) -> list[str]:
    bad = []
    for kind in ("params", "buffers"):
        for n, t in a[kind].items():
            if not torch.equal(t, b[kind][n]):
                bad.append(f"{kind}:{n}")
    for n, g in a["grads"].items():
        h = b["grads"][n]
        if (g is None) != (h is None) or (g is not None and not torch.equal(g, h)):
            bad.append(f"grad:{n}")
    if not torch.equal(a["rng_cpu"], b["rng_cpu"]):
        bad.append("rng_cpu")
    if not torch.equal(a["rng_cuda"], b["rng_cuda"]):
        bad.append("rng_cuda")
    if a["training"] != b["training"]:
        bad.append("training flag")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_llama: needs a CUDA GPU (run it through scripts/gpu-check)")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, num_hidden_layers=args.layers, intermediate_size=5632,
                         num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                         tie_word_embeddings=False, max_position_embeddings=4096)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for i in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)

    before = snapshot(model)
    import emsa  # the library loads inside the timed region below, at first use

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        record = emsa.probe(model, input_ids=ids, labels=ids, trace=False)
    t_probe = time.perf_counter() - t0
    plan = emsa.make_plan(record)
    torch.cuda.synchronize()
    total_s = time.perf_counter() - t0
    after = snapshot(model)
    changed = same(before, after)

    bar_s = step_s + 1.0
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(
        benchmark="probe-llama", date=now.strftime("%Y-%m-%d"), time_utc=now.isoformat(),
        device=torch.cuda.get_device_name(), torch=torch.__version__,
        commit=os.environ.get("EMSA_COMMIT", "unknown"),
        command=" ".join([sys.executable] + sys.argv), params=n_params, layers=args.layers,
        batch=args.batch, seq=args.seq, train_step_s=step_s, train_step_times_s=times,
        probe_s=t_probe, probe_plus_plan_s=total_s, bar_s=bar_s, meets_bar=total_s <= bar_s,
        state_unchanged=not changed, changed=changed[:20],
        record_params=len(record.params), plan_summary=str(plan).splitlines()[-12:],
        probe_forward_s=record.forward_time, probe_backward_s=record.backward_time,
        probe_peak_device_bytes=record.peak_device_bytes)
    print(f"\nprobe on Llama {n_params / 1e9:.3f} B params ({args.layers} layers), batch "
          f"{args.batch}x{args.seq}, {torch.cuda.get_device_name()}")
    print(f"  training step (fwd+bwd+fused AdamW)  {step_s * 1e3:8.1f} ms")
    print(f"  probe                                {t_probe * 1e3:8.1f} ms "
          f"(its fwd {record.forward_time * 1e3:.1f} ms, bwd {record.backward_time * 1e3:.1f} ms)")
    print(f"  probe + plan                         {total_s * 1e3:8.1f} ms   bar {bar_s * 1e3:.1f} ms"
          f"  -> {'met' if total_s <= bar_s else 'NOT met'}")
    print(f"  state after probe bitwise unchanged: {not changed} {changed[:5]}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
