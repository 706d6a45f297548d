#!/usr/bin/env python3
"""FSDP2 with the Adam state on the host: emsa's host tier against FSDP2's CPUOffloadPolicy
(issue 23, item 2), one GPU, world size 1, NCCL.

Model: the 0.95 B Llama of bench/offload_e2e.py (transformers LlamaConfig, hidden 2048, 16
layers, intermediate 5632, 16 heads, vocab 32000, untied, random init with a fixed seed), fp32
parameters, bf16 autocast; random token batches, B x T per --shapes (default 4x512 and 16x1024),
the same for every configuration. Both FSDP configurations shard the model the same way, over a
one-rank mesh (the process group comes from MASTER_ADDR / MASTER_PORT set here, rank 0 of 1, no
torchrun), by --units:

  ends     fully_shard on embed_tokens, on each decoder layer, on the final norm and on
           lm_head, then on the root (which holds no parameter), as torchtitan shards a Llama
           (the default)
  layers   fully_shard on each decoder layer, then on the root (which then holds embed_tokens,
           the final norm and lm_head)
A root unit's gradients are reduced, and so handed to the optimizer, only when the whole
backward ends, and its parameters are read by the first forward before anything else: with the
host tier, lm_head's update (the first gradient backward computes) then waits for the end of
backward, and the next forward waits for the last update of the step.

The configurations (--configs):
  offload  fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=True)): parameters,
           gradients and Adam state on the host, torch.optim.AdamW stepping there (fused where
           this torch has it for DTensor parameters, else foreach) - bench/offload_e2e.py's (b)
  emsa     fully_shard without offloading, emsa.AdamW(tier="host"): all Adam state and the
           fp32 master in emsa's pinned host arena, each rank's shards updated by the CPU while
           the GPU runs; updates in backward (FSDP2 runs the sharded parameters' gradient hooks
           after its reduce-scatter; --no-step-in-backward: step() after backward); planned
           from emsa.probe on the sharded model (--no-probe: from the first backward alone)
  plain    emsa as above on the same model without FSDP (offload_e2e.py's (e)): what FSDP2's
           wrapping costs emsa; not part of the bar
  device   fully_shard without offloading, torch.optim.AdamW(fused=True) with its state on the
           device: FSDP2 at world size 1 with nothing offloaded; not part of the bar
  floor    fully_shard without offloading and no optimizer (step() does nothing, zero_grad()
           drops the gradients): FSDP2's own forward and backward, the least any optimizer
           under it can take; not part of the bar

Each (configuration, shape) runs in its own subprocess (a fresh CUDA context, process group and
pinned memory). Per run: --warmup untimed steps, then --steps timed ones; a step is forward +
backward + step + zero_grad, timed by CUDA events, which also split it into forward, backward
and step() (with updates in backward, the host tier's work shows as the forward waiting for
uploads and the backward for copies); then, with nothing pending, one forward under no_grad
("quiet forward": the forward's own time, so forward - quiet forward is about what the forward
waited). Reported: the median ms/step and of each part, the peak device memory (torch's peak,
plus emsa's device arena, which torch's allocator does not see), the final loss; for emsa the
host tier's own medians (d2h, cpu, h2d busy; wait: host time a forward blocked for an upload
not yet enqueued; grad_wait, worker), the last step's host timeline (first and last bucket
submitted, CPU updates' first start and last end, seconds from the step's start on the host),
the share of the host tier the GPU updated, the plan's predicted step. The bar: offload / emsa
>= 2.5 at every shape. JSON: bench/results/fsdp_offload-<date>.json (--out FILE elsewhere);
the tables are printed last.

--dry-run: a tiny Llama on the CPU over gloo, a 2x16 shape, 2+2 steps: checks this script, its
subprocesses, tables and JSON, not the speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
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
           "emsa": "FSDP2 + emsa.AdamW(tier='host')",
           "plain": "emsa.AdamW(tier='host'), no FSDP",
           "device": "FSDP2 + torch AdamW fused, on device",
           "floor": "FSDP2 forward+backward, no optimizer"}
UNITS = ("ends", "layers")
PARTS = ("forward_s", "backward_s", "opt_step_s")


# ---- one configuration (a child process) -----------------------------------------------------
def shard(model, device, units: str, policy=None):
    """fully_shard per --units (module docstring) over a one-rank mesh on `device`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    kw = dict(mesh=init_device_mesh(device.type, (1,)))
    if policy is not None:
        kw["offload_policy"] = policy
    parts = list(model.model.layers)
    if units == "ends":
        parts = [model.model.embed_tokens, *parts, model.model.norm, model.lm_head]
    for part in parts:
        fully_shard(part, **kw)
    fully_shard(model, **kw)
    e2e.settle(device)  # the unsharded originals are gone; the peak starts here
    return model


def train(model, opt, batches, device, warmup: int, autocast: bool) -> dict:
    """e2e.train's steps with the forward, backward and step() parts timed apart, then the quiet
    forward (module docstring)."""
    clock = e2e.Clock(device)
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if autocast
           else contextlib.nullcontext())
    marks, losses = [], []
    e2e.sync(device)
    for ids in batches:
        start = clock.mark()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        forward = clock.mark()
        loss.backward()
        backward = clock.mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append((start, forward, backward, clock.mark()))
        losses.append(loss.detach())
    getattr(opt, "synchronize", lambda: None)()
    e2e.sync(device)
    with torch.no_grad(), ctx:
        start = clock.mark()
        model(input_ids=batches[-1], labels=batches[-1])
        end = clock.mark()
    e2e.sync(device)  # both events complete before elapsed_time reads them
    quiet = clock.seconds(start, end)
    timed = marks[warmup:]
    step = [clock.seconds(m[0], m[3]) for m in timed]
    out = dict(step_s=statistics.median(step), step_times_s=step, quiet_forward_s=quiet,
               final_loss=losses[-1].item())
    for k, name in enumerate(PARTS):
        out[name] = statistics.median(clock.seconds(m[k], m[k + 1]) for m in timed)
    return out


def run_offload(args, shape, batches, device) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy

    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    with e2e.one_rank_group(device):
        impl, out = "fused", None
        model = shard(e2e.make_llama(shape, device), device, args.units, policy)
        try:  # torch's fastest CPU AdamW, where this torch has it for DTensor parameters
            opt = torch.optim.AdamW(model.parameters(), **e2e.HYPER, fused=True)
            out = train(model, opt, batches, device, args.warmup, args.autocast)
        except RuntimeError as e:
            impl = f"foreach (fused failed: {str(e).splitlines()[0][:160]})"
        if out is None:  # afresh, outside the except block (its traceback holds the old model)
            model = opt = None
            model = shard(e2e.make_llama(shape, device), device, args.units, policy)
            opt = torch.optim.AdamW(model.parameters(), **e2e.HYPER, foreach=True)
            out = train(model, opt, batches, device, args.warmup, args.autocast)
        out.update(e2e.peak_bytes(device), params=e2e.numel(model), optimizer_impl=impl)
        out["peak_device_bytes"] = out["torch_peak_bytes"]
        del model, opt
        return out


def run_emsa(args, shape, batches, device, fsdp: bool = True) -> dict:
    with e2e.one_rank_group(device) if fsdp else contextlib.nullcontext():
        return _run_emsa(args, shape, batches, device, fsdp)


def _run_emsa(args, shape, batches, device, fsdp: bool) -> dict:
    import emsa

    if args.wait_all:  # A/B: every module finds no per-unit buckets, so the first waits for all
        import emsa._distributed.dtensor

        emsa._distributed.dtensor._UploadWaits._buckets = lambda self, module: None
    out: dict = dict(step_in_backward=args.step_in_backward, wait_all=args.wait_all)
    model = e2e.make_llama(shape, device)
    if fsdp:
        model = shard(model, device, args.units)
    record = None
    if args.probe:
        ids = batches[0]
        ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast
               else contextlib.nullcontext())
        try:
            with ctx:
                record = emsa.probe(model, input_ids=ids, labels=ids, trace=False)
            model.zero_grad(set_to_none=True)
        except Exception as e:  # noqa: BLE001 - planned unprobed instead, and said so
            out["probe_error"] = f"{type(e).__name__}: {e}"[:300]
    opt = e2e.emsa_adamw(model.parameters(), "host", probe=record,
                         step_in_backward=args.step_in_backward, _dry_run=args.dry_run)
    plan = opt.plan
    e2e.settle(device)
    out.update(train(model, opt, batches, device, args.warmup, args.autocast))
    out.update(e2e.peak_bytes(device), params=e2e.numel(model), probed=record is not None)
    pred = plan.json["prediction"]
    out.update(device_arena_bytes=plan.device_arena_bytes, host_arena_bytes=plan.host_arena_bytes,
               device_update_share=pred.get("device_update_share", 0.0),
               predicted_step_s=pred.get("step_time"), predicted_stall_s=pred.get("stall_time"),
               host_params=sum(p["tier"] == "L2" for p in plan.json["params"] if p["trainable"]),
               trainable_params=sum(1 for p in plan.json["params"] if p["trainable"]),
               buckets=len(plan.json.get("buckets", [])))
    out.update(e2e.emsa_peak(opt, out["torch_peak_bytes"]))
    out["measured"] = e2e.engine_stats(opt, args.steps)
    out["host_trace"] = e2e.host_trace(opt)
    del model, opt, record, plan
    return out


class _NoStep:
    """The floor configuration's optimizer: no update; zero_grad drops the gradients."""

    def __init__(self, model):
        self.model = model

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=True)


def run_fsdp_on_device(args, shape, batches, device, update: bool = True) -> dict:
    with e2e.one_rank_group(device):
        model = shard(e2e.make_llama(shape, device), device, args.units)
        opt = (torch.optim.AdamW(model.parameters(), **e2e.HYPER, fused=True) if update
               else _NoStep(model))
        out = train(model, opt, batches, device, args.warmup, args.autocast)
        out.update(e2e.peak_bytes(device), params=e2e.numel(model))
        out["peak_device_bytes"] = out["torch_peak_bytes"]
        del model, opt
        return out


RUNS = {"offload": run_offload, "emsa": run_emsa,
        "plain": lambda *a: run_emsa(*a, fsdp=False),
        "device": run_fsdp_on_device,
        "floor": lambda *a: run_fsdp_on_device(*a, update=False)}


def child(spec: dict) -> None:
    args = argparse.Namespace(**spec["args"])
    device = torch.device("cuda" if not args.dry_run else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    shape = e2e.LLAMA_TINY if args.dry_run else e2e.LLAMA_1B
    batch, seq = spec["shape"]
    batches = e2e.token_batches(shape["vocab_size"], batch, seq, args.warmup + args.steps,
                                device)
    try:
        out = RUNS[spec["config"]](args, shape, batches, device)
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
             f"commit {result['commit']}, {result['date']}, units {result['units']}"
             f"{', forward waits for all (A/B)' if result.get('wait_all') else ''}",
             f"{'shape':>8}  {'configuration':<38} {'ms/step':>9} {'peak GiB':>9} {'loss':>8}"]
    for key, runs in result["shapes"].items():
        for config, label in CONFIGS.items():
            r = runs.get(config)
            if r is None:
                continue
            if not r.get("ok"):
                lines.append(f"{key:>8}  {label:<38} failed: {r.get('error', '')[:120]}")
                continue
            lines.append(f"{key:>8}  {label:<38} {r['step_s'] * 1e3:9.1f} "
                         f"{r['peak_device_bytes'] / gib:9.2f} {r['final_loss']:8.4f}")
        speedup = runs.get("speedup")
        if speedup is not None:
            verdict = "meets" if speedup >= BAR else "misses"
            lines.append(f"{key:>8}  offload / emsa = {speedup:.2f}x ({verdict} the {BAR}x bar)")
    return "\n".join(lines + ["", breakdown(result)])


def breakdown(result: dict) -> str:
    """Where each step goes (module docstring), ms: medians of the timed steps."""
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    lines = ["Breakdown, ms (fwd - quiet: what the forward waited; host tier: busy medians; "
             "the last step from its start on the host: first and last bucket submitted, "
             "the CPU's last update done)",
             f"{'shape':>8} {'config':<8} {'step':>7} {'fwd':>6} {'quiet':>6} {'bwd':>6} "
             f"{'step()':>6} | {'d2h':>6} {'cpu':>6} {'h2d':>6} {'wait':>6} {'worker':>6} "
             f"| {'first':>6} {'last':>6} {'cpu end':>7} | gpu share, predicted"]
    for key, runs in result["shapes"].items():
        for config in CONFIGS:
            r = runs.get(config)
            if not r or not r.get("ok"):
                continue
            m, t = r.get("measured") or {}, r.get("host_trace") or {}
            host = " ".join(f"{ms(m.get(k)):>6}" for k in ("d2h_s", "cpu_s", "h2d_s", "wait_s",
                                                           "worker_s"))
            first = min((row[0] for row in t.get("rows", []) if row[0] >= 0), default=None)
            trace = (f"{ms(first):>6} {ms(t.get('last_submit_s')):>6} "
                     f"{ms(t.get('last_cpu_end_s')):>7}")
            plan = ""
            if "device_update_share" in r:
                plan = (f"{r['device_update_share']:.0%}, {ms(r.get('predicted_step_s'))} ms"
                        f"{'' if r.get('probed') else ' (unprobed)'}")
            lines.append(f"{key:>8} {config:<8} {ms(r['step_s']):>7} {ms(r['forward_s']):>6} "
                         f"{ms(r['quiet_forward_s']):>6} {ms(r['backward_s']):>6} "
                         f"{ms(r['opt_step_s']):>6} | {host} | {trace} | {plan}")
            if r.get("probe_error"):
                lines.append(f"{'':>8} {config:<8} probe failed: {r['probe_error'][:140]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4x512,16x1024", help="BxT,BxT,...")
    ap.add_argument("--configs", default="offload,emsa,plain",
                    help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--units", choices=UNITS, default="ends", help="how FSDP2 shards the model")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-step-in-backward", dest="step_in_backward", action="store_false")
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="emsa plans from its first backward instead of emsa.probe")
    ap.add_argument("--wait-all", action="store_true",
                    help="A/B: under FSDP the first forward waits for every pending upload "
                         "(the rule before per-unit waits) instead of each unit for its own")
    ap.add_argument("--no-autocast", dest="autocast", action="store_false")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per subprocess")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    configs = [c for c in args.configs.split(",") if c]
    if not configs or set(configs) - set(CONFIGS):
        sys.exit(f"--configs {args.configs!r}: choose from {', '.join(CONFIGS)}")
    if args.dry_run:
        args.shapes, args.warmup, args.steps = "2x16", 2, 2
    elif not torch.cuda.is_available():
        sys.exit("fsdp_offload.py measures on a CUDA GPU; --dry-run checks it on the CPU")
    device = torch.device("cuda" if not args.dry_run else "cpu")
    result = e2e.provenance("fsdp_offload", device)
    result.update(model="tiny Llama (dry run)" if args.dry_run else "Llama 0.95 B",
                  warmup=args.warmup, steps=args.steps, autocast_bf16=args.autocast,
                  step_in_backward=args.step_in_backward, probe=args.probe, units=args.units,
                  wait_all=args.wait_all, bar=BAR, shapes={})
    for batch, seq in e2e.parse_shapes(args.shapes):
        runs = {config: launch(args, config, (batch, seq)) for config in configs}
        if runs.get("offload", {}).get("ok") and runs.get("emsa", {}).get("ok"):
            runs["speedup"] = runs["offload"]["step_s"] / runs["emsa"]["step_s"]
        result["shapes"][f"{batch}x{seq}"] = runs
    e2e.write_result(result, args, table(result))


if __name__ == "__main__":
    main()
