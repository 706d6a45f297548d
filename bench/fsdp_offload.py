#!/usr/bin/env python3
"""FSDP2 with the Adam state on the host: emsa's host tier against FSDP2's CPUOffloadPolicy
(issue 23, item 2), one GPU, world size 1, NCCL.

Model: the 0.95 B Llama of bench/offload_e2e.py (transformers LlamaConfig, hidden 2048, 16
layers, intermediate 5632, 16 heads, vocab 32000, untied, random init with a fixed seed), fp32
parameters, bf16 autocast; random token batches, B x T per --shapes (default 4x512 and 16x1024),
the same for both configurations. Both shard the model the same way (fully_shard on each decoder
layer, then on the root, over a one-rank mesh; the process group comes from MASTER_ADDR /
MASTER_PORT set here, rank 0 of 1, no torchrun):

  offload  fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=True)): parameters,
           gradients and Adam state on the host, torch.optim.AdamW stepping there (fused where
           this torch has it for DTensor parameters, else foreach) - bench/offload_e2e.py's (b)
  emsa     fully_shard without offloading, emsa.AdamW(tier="host"): all Adam state and the
           fp32 master in emsa's pinned host arena, each rank's shards updated by the CPU while
           the GPU runs; updates in backward (FSDP2 runs the sharded parameters' gradient hooks
           after its reduce-scatter; --no-step-in-backward: step() after backward)

Each (configuration, shape) runs in its own subprocess (a fresh CUDA context, process group and
pinned memory). Per run: --warmup untimed steps, then --steps timed ones; a step is forward +
backward + step + zero_grad, timed by CUDA events; reported: the median ms/step, the peak device
memory (torch's peak, plus emsa's device arena, which torch's allocator does not see), the final
loss. The bar: offload / emsa >= 2.5 at every shape. JSON: bench/results/fsdp_offload-<date>.json
(--out FILE elsewhere); the table is printed last.

--dry-run: a tiny Llama on the CPU over gloo, a 2x16 shape, 2+2 steps: checks this script, its
subprocesses, table and JSON, not the speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import offload_e2e as e2e  # noqa: E402  (the model, batches, timing and FSDP baseline)

BAR = 2.5
CONFIGS = {"offload": "FSDP2 CPUOffloadPolicy + torch AdamW",
           "emsa": "FSDP2 + emsa.AdamW(tier='host')"}


# ---- one configuration (a child process) -----------------------------------------------------
def run_emsa(args, shape, batches, device) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import emsa

    with e2e.one_rank_group(device):
        model = e2e.make_llama(shape, device)
        mesh = init_device_mesh(device.type, (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        e2e.settle(device)  # the unsharded originals are gone; the peak starts here
        opt = emsa.AdamW(model.parameters(), **e2e.HYPER, tier="host",
                         step_in_backward=args.step_in_backward)
        out = e2e.train(model, opt, batches, device, args.warmup, autocast=args.autocast)
        opt.synchronize()
        plan = opt.plan
        out.update(e2e.peak_bytes(device), params=e2e.numel(model),
                   step_in_backward=args.step_in_backward,
                   device_arena_bytes=plan.device_arena_bytes,
                   host_arena_bytes=plan.host_arena_bytes,
                   host_params=sum(p["tier"] == "L2" for p in plan.json["params"]
                                   if p["trainable"]),
                   trainable_params=sum(1 for p in plan.json["params"] if p["trainable"]))
        out["peak_device_bytes"] = out["torch_peak_bytes"] + plan.device_arena_bytes
        del model, opt
        return out


def child(spec: dict) -> None:
    args = argparse.Namespace(**spec["args"])
    device = torch.device("cuda" if not args.dry_run else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    shape = e2e.LLAMA_TINY if args.dry_run else e2e.LLAMA_1B
    batch, seq = spec["shape"]
    batches = e2e.token_batches(shape["vocab_size"], batch, seq, args.warmup + args.steps,
                                device)
    run = run_emsa if spec["config"] == "emsa" else e2e.run_fsdp
    try:
        out = run(args, shape, batches, device)
        out.pop("losses", None)
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported in the table, the other runs go on
        out = dict(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    Path(spec["result"]).write_text(json.dumps(out))


# ---- the driver -----------------------------------------------------------------------------
def launch(args, config: str, shape: tuple[int, int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        spec = dict(config=config, shape=list(shape), result=str(result), args=vars(args))
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                                  timeout=args.timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return dict(ok=False, error=f"timed out after {args.timeout} s")
        if not result.is_file():
            return dict(ok=False, error=f"exited {proc.returncode}: {proc.stderr[-2000:]}")
        out = json.loads(result.read_text())
        out["wall_s"] = time.perf_counter() - start
        return out


def table(result: dict) -> str:
    gib = e2e.GIB
    lines = [f"FSDP2, Adam state on the host: {result['device']}, torch {result['torch']}, "
             f"commit {result['commit']}, {result['date']}",
             f"{'shape':>8}  {'configuration':<38} {'ms/step':>9} {'peak GiB':>9} {'loss':>8}"]
    for key, runs in result["shapes"].items():
        for config, label in CONFIGS.items():
            r = runs[config]
            if not r.get("ok"):
                lines.append(f"{key:>8}  {label:<38} failed: {r.get('error', '')[:120]}")
                continue
            lines.append(f"{key:>8}  {label:<38} {r['step_s'] * 1e3:9.1f} "
                         f"{r['peak_device_bytes'] / gib:9.2f} {r['final_loss']:8.4f}")
        speedup = runs.get("speedup")
        if speedup is not None:
            verdict = "meets" if speedup >= BAR else "misses"
            lines.append(f"{key:>8}  offload / emsa = {speedup:.2f}x ({verdict} the {BAR}x bar)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4x512,16x1024", help="BxT,BxT,...")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-step-in-backward", dest="step_in_backward", action="store_false")
    ap.add_argument("--no-autocast", dest="autocast", action="store_false")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per subprocess")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.dry_run:
        args.shapes, args.warmup, args.steps = "2x16", 2, 2
    elif not torch.cuda.is_available():
        sys.exit("fsdp_offload.py measures on a CUDA GPU; --dry-run checks it on the CPU")
    device = torch.device("cuda" if not args.dry_run else "cpu")
    result = e2e.provenance("fsdp_offload", device)
    result.update(model="tiny Llama (dry run)" if args.dry_run else "Llama 0.95 B",
                  warmup=args.warmup, steps=args.steps, autocast_bf16=args.autocast,
                  step_in_backward=args.step_in_backward, bar=BAR, shapes={})
    for batch, seq in e2e.parse_shapes(args.shapes):
        runs = {config: launch(args, config, (batch, seq)) for config in CONFIGS}
        if runs["offload"].get("ok") and runs["emsa"].get("ok"):
            runs["speedup"] = runs["offload"]["step_s"] / runs["emsa"]["step_s"]
        result["shapes"][f"{batch}x{seq}"] = runs
    e2e.write_result(result, args, table(result))


if __name__ == "__main__":
    main()
