"""`emsa demo`: train a small GPT twice from the same seed, with emsa.AdamW and with
torch.optim.AdamW, and show that they agree.

The two copies see the same batches in lockstep, with the same hyperparameters, param groups
(weight decay on matrices only) and warmup+cosine LambdaLR. Their step times are measured the
same way: in this process, interleaved step by step (which goes first alternates), with the
same number of CPU threads, and compared as medians. emsa plans from a probe of its copy
and prints the plan after the first step. On a GPU, emsa gets a budget halfway between the
smallest that works and what keeping all state on the device would take, so part of its state
goes to the host tier. The run directory (--out) gets the files emsa.report reads, and the
report itself.

Exit status: 0 when every step's losses agree within 1e-4 and every parameter within rtol 1e-4;
1 when they differ (the message says where) or the run failed; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import _demo_model as corpus
from . import report
from ._native import tuning as _tuning
from ._native.library import EmsaError, EmsaLibraryError
from ._demo_model import GPT, GPTConfig
from ._progress import Progress

__all__ = ["main", "LOSS_ATOL", "PARAM_RTOL"]

LOSS_ATOL = 1e-4
# Element-wise: |emsa - torch| <= PARAM_RTOL * (|torch| + max |torch| over the tensor). An element
# passing near zero has no meaningful relative error of its own; the tensor's scale stands in.
PARAM_RTOL = 1e-4
CORPUS_CHARS = 400_000


@dataclass
class Hyper:
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_frac: float = 0.1
    min_lr_frac: float = 0.1  # the cosine ends at this fraction of lr


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emsa demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                   help="auto: cuda when torch sees a GPU, else cpu")
    p.add_argument("--out", default="emsa-demo-run", help="run directory (default ./%(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no plan table, no progress bar")
    size = p.add_argument_group("model and data size")
    size.add_argument("--layers", type=int, default=2)
    size.add_argument("--d-model", type=int, default=96)
    size.add_argument("--heads", type=int, default=4)
    size.add_argument("--block-size", type=int, default=64, help="tokens per sequence")
    size.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    size.add_argument("--lr", type=float, default=Hyper.lr)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for flag in ("steps", "layers", "d_model", "heads", "block_size", "batch_size"):
        if getattr(args, flag) < 1:
            return _usage(f"--{flag.replace('_', '-')} is {getattr(args, flag)}; it must be >= 1")
    if args.d_model % args.heads:
        return _usage(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        return _usage("--device cuda, but torch sees no CUDA device; use --device cpu")
    device = torch.device("cuda" if args.device == "cuda" or (
        args.device == "auto" and torch.cuda.is_available()) else "cpu")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return _usage(f"--out {out} exists and is not a directory; name a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with _deterministic(device):
            return _run(args, device, out)
    except (EmsaLibraryError, EmsaError, OSError, ImportError) as e:  # ImportError: matplotlib
        print(f"emsa demo: {e}", file=sys.stderr)
        return 1


def _usage(message: str) -> int:
    print(f"emsa demo: {message}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def _deterministic(device: torch.device):
    """On CUDA, deterministic kernels for forward and backward (some, such as the embedding's
    backward, add with atomics in any order otherwise), so the two copies' gradients differ
    only through their parameters and any difference comes from the optimizers."""
    if device.type != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    was, warn = (torch.are_deterministic_algorithms_enabled(),
                 torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings), none on biases and norms."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def _schedule(steps: int, hyper: Hyper):
    warmup = max(int(steps * hyper.warmup_frac), 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min((step - warmup) / max(steps - warmup, 1), 1.0)
        return hyper.min_lr_frac + (1 - hyper.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))

    return factor


def _peer_optimizer(groups: list[dict], hyper: Hyper) -> torch.optim.Optimizer:
    """The reference: torch's AdamW with the same hyperparameters (a seam for tests)."""
    return torch.optim.AdamW(groups, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps,
                             weight_decay=hyper.weight_decay)


def _budget(record, device: torch.device) -> int | None:
    """On CUDA: the smallest budget that works plus half the gap to the all-device peak, so the
    plan must send some state to the host tier. None elsewhere (no device limit)."""
    if device.type != "cuda":
        return None
    from ._native.planner import make_plan

    tiered = make_plan(record, optimizer="adamw").json
    on_device = make_plan(record, optimizer="adamw", allow_host_tier=False).json
    low = tiered["min_budget_bytes"]
    high = on_device["prediction"]["peak_device_bytes"]
    return low + max(high - low, 0) // 2


class _Side:
    """One of the two trainings: model, optimizer, scheduler, and what was measured."""

    def __init__(self, model, opt, factor, *, arena_bytes: int | None = None):
        self.model, self.opt = model, opt
        # emsa's state lives in arenas allocated outside torch (arena_bytes of them on the
        # device), which torch's memory counters do not see; None: the state is torch's.
        self.arena_bytes = arena_bytes
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        self.peak = self.last_peak = 0  # device bytes: most of any step, of the last (CUDA)

    def resident_torch_bytes(self) -> int:
        """Device memory this side holds through torch's allocator between steps."""
        total = sum(p.nbytes for p in self.model.parameters() if p.is_cuda)
        if self.arena_bytes is not None:
            return total
        for st in self.opt.state.values():
            total += sum(t.nbytes for t in st.values()
                         if isinstance(t, torch.Tensor) and t.is_cuda)
        return total

    def iterate(self, x, y, sync) -> tuple[float, float, float]:
        """One step; returns (loss, iteration seconds, optimizer.step seconds)."""
        cuda = x.is_cuda
        if cuda:
            others = torch.cuda.memory_allocated(x.device) - self.resident_torch_bytes()
            torch.cuda.reset_peak_memory_stats(x.device)
        t0 = time.perf_counter()
        loss = self.model(x, y)
        loss.backward()
        sync()
        t1 = time.perf_counter()
        self.opt.step()
        sync()
        t2 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        if cuda:
            self.last_peak = (torch.cuda.max_memory_allocated(x.device) - others
                              + (self.arena_bytes or 0))
            self.peak = max(self.peak, self.last_peak)
        return loss.item(), t2 - t0, t2 - t1


def _run(args, device: torch.device, out: Path) -> int:
    import emsa

    hyper = Hyper(lr=args.lr)
    cfg = GPTConfig(vocab_size=len(corpus.ALPHABET), block_size=args.block_size,
                    n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    peer_model = copy.deepcopy(model)
    tokens = corpus.encode(corpus.make_text(CORPUS_CHARS, seed=1234 + args.seed))
    batches = corpus.Batches(tokens, args.batch_size, cfg.block_size, seed=args.seed)
    probe_x, probe_y = corpus.Batches(tokens, args.batch_size, cfg.block_size,
                                       seed=args.seed + 1).next()

    # The peer goes to the device after the probe, so the probe sees one model's memory.
    model.to(device)
    record = emsa.probe(model, probe_x.to(device), probe_y.to(device))
    peer_model.to(device)
    budget = _budget(record, device)
    factor = _schedule(args.steps, hyper)
    opt = emsa.AdamW(_param_groups(model, hyper.weight_decay), lr=hyper.lr, betas=hyper.betas,
                     eps=hyper.eps, weight_decay=hyper.weight_decay, probe=record,
                     budget=budget)
    mine = _Side(model, opt, factor, arena_bytes=opt.plan.device_arena_bytes)
    peer = _Side(peer_model, _peer_optimizer(_param_groups(peer_model, hyper.weight_decay),
                                             hyper), factor)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    n_params = sum(p.numel() for p in model.parameters())
    threads = _same_threads(device)
    if not args.quiet:
        print(f"emsa demo: GPT with {n_params:,} parameters ({cfg.n_layer} blocks, d_model "
              f"{cfg.d_model}), {args.steps} steps on {device}, batch {args.batch_size}x"
              f"{cfg.block_size} characters" + (f", budget {budget:,} B" if budget else ""))
    progress = Progress(args.steps, label="training", quiet=args.quiet)
    steps = []
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in batches.next())
        lr = opt.param_groups[0]["lr"]
        # Interleaved, and which goes first alternates: neither side always gets the warm
        # caches (or the cold ones) the other leaves.
        if step % 2:
            loss, it_s, opt_s = mine.iterate(x, y, sync)
            loss_p, it_p, opt_p = peer.iterate(x, y, sync)
        else:
            loss_p, it_p, opt_p = peer.iterate(x, y, sync)
            loss, it_s, opt_s = mine.iterate(x, y, sync)
        row = {"step": step, "time_s": it_s, "loss": loss, "loss_peer": loss_p,
               "time_peer_s": it_p, "opt_s": opt_s, "opt_peer_s": opt_p, "lr": lr}
        if device.type == "cuda":
            row["peak_device_bytes"] = mine.last_peak
        steps.append(row)
        if step == 1 and not args.quiet:
            progress.close()
            print(_short_plan(opt), flush=True)
        progress.update(step, loss=loss, peer=loss_p)
    progress.close()

    verdict = _compare(steps, mine, peer)
    summary = _summary(steps, mine, peer, device)
    summary["timing"] = _timing_note(device, threads, summary["timed_steps"])
    print(_table(summary, verdict))
    path = _write_run(out, opt, record, steps, cfg, hyper, args, device, n_params, summary,
                      verdict)
    print(f"report: {path}")
    if not verdict["ok"]:
        print(f"emsa demo: emsa.AdamW and torch.optim.AdamW differ: {verdict['why']}",
              file=sys.stderr)
        return 1
    return 0


def _same_threads(device: torch.device) -> int:
    """The CPU threads both sides use. On the CPU emsa's engine runs on every CPU this process
    may use (emsa's CpuUpdater with threads 0); torch's intra-op pool gets the same count, so
    that neither optimizer's time is the other's thread count. Returns that count."""
    if device.type != "cpu":
        return torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(cpus or 1, 1))
    return torch.get_num_threads()


def _timing_note(device: torch.device, threads: int, timed: int) -> str:
    sync = ", after torch.cuda.synchronize()" if device.type == "cuda" else ""
    return (f"times: wall clock{sync}, both in this process on {threads} CPU threads, "
            f"interleaved step by step (alternating which goes first) on the same batches; "
            f"medians of the last {timed} steps")


def _short_plan(opt) -> str:
    """The plan's verdict lines, as `emsa plan` opens with, rather than its whole table."""
    return "emsa's plan (print(opt.plan) has one row per parameter):\n" + opt.plan.verdict()


def _compare(steps, mine: _Side, peer: _Side) -> dict:
    """Losses step by step (absolute), parameters element-wise (rtol with a small atol)."""
    loss_diffs = [abs(r["loss"] - r["loss_peer"]) for r in steps]
    worst = max(range(len(steps)), key=lambda i: loss_diffs[i])
    max_abs, max_rel, worst_ratio, bad_param = 0.0, 0.0, 0.0, None
    with torch.no_grad():
        for (name, a), (_, b) in zip(mine.model.named_parameters(),
                                     peer.model.named_parameters()):
            a, b = a.double(), b.double()
            diff = (a - b).abs()
            max_abs = max(max_abs, diff.max().item())
            max_rel = max(max_rel, diff.max().item() / max(b.abs().max().item(), 1e-30))
            # How much of its tolerance the worst element uses: above 1 it fails.
            allowance = PARAM_RTOL * (b.abs() + b.abs().max()).clamp_min(1e-30)
            ratio = (diff / allowance).max().item()
            worst_ratio = max(worst_ratio, ratio)
            if bad_param is None and not ratio <= 1.0:
                bad_param = name
    finite = all(math.isfinite(r["loss"]) and math.isfinite(r["loss_peer"]) for r in steps)
    why = []
    if not finite:
        why.append("a loss is not finite")
    if loss_diffs[worst] > LOSS_ATOL or not math.isfinite(loss_diffs[worst]):
        why.append(f"losses differ by {loss_diffs[worst]:.3g} at step {steps[worst]['step']} "
                   f"(bar {LOSS_ATOL:g})")
    if bad_param is not None:
        why.append(f"parameter {bad_param} differs beyond rtol {PARAM_RTOL:g} "
                   f"(worst element at {worst_ratio:.3g}x its allowance; max |diff| "
                   f"{max_abs:.3g} over all parameters)")
    return {"ok": not why, "why": "; ".join(why), "max_loss_diff": loss_diffs[worst],
            "worst_step": steps[worst]["step"], "max_param_diff": max_abs,
            "max_param_rel_diff": max_rel, "tolerance_used": worst_ratio}


def _state_bytes(opt) -> int:
    return sum(t.nbytes for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


def _summary(steps, mine: _Side, peer: _Side, device) -> dict:
    timed = steps[1:] or steps  # the first step plans and warms up: not typical

    def median_ms(key):  # a median: one step slowed by another process does not move it
        values = sorted(r[key] for r in timed)
        mid = len(values) // 2
        return 1e3 * (values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2)

    if device.type == "cuda":
        memory = {"what": "peak device memory", "emsa": mine.peak, "peer": peer.peak}
    else:
        memory = {"what": "optimizer state", "emsa": _state_bytes(mine.opt),
                  "peer": _state_bytes(peer.opt)}
    return {"final_loss": [steps[-1]["loss"], steps[-1]["loss_peer"]],
            "step_ms": [median_ms("time_s"), median_ms("time_peer_s")],
            "opt_ms": [median_ms("opt_s"), median_ms("opt_peer_s")],
            "timed_steps": len(timed), "memory": memory}


def _table(summary: dict, verdict: dict) -> str:
    mem = summary["memory"]
    rows = [("", "emsa.AdamW", "torch.optim.AdamW"),
            ("final loss", *(f"{v:.6f}" for v in summary["final_loss"])),
            (f"median step (of last {summary['timed_steps']})",
             *(f"{v:.2f} ms" for v in summary["step_ms"])),
            ("  of which optimizer.step()", *(f"{v:.2f} ms" for v in summary["opt_ms"])),
            (mem["what"], report.fmt_bytes(mem["emsa"]), report.fmt_bytes(mem["peer"]))]
    lines = [f"{a:<32}{b:>20}{c:>20}" for a, b, c in rows]
    mark = "equal within tolerance" if verdict["ok"] else "DIFFERENT"
    lines += [summary["timing"], "",
              f"max |loss diff|     {verdict['max_loss_diff']:.3g} at step "
              f"{verdict['worst_step']} (bar {LOSS_ATOL:g})",
              f"max |param diff|    {verdict['max_param_diff']:.3g}, relative to its tensor's "
              f"largest |value| {verdict['max_param_rel_diff']:.3g}",
              f"element-wise check  |emsa - torch| <= {PARAM_RTOL:g} (|torch| + max |torch| of the "
              f"tensor): the worst element uses {100 * verdict['tolerance_used']:.3g}% of its "
              "allowance",
              f"verdict             {mark}"]
    return "\n".join(lines)


def _commit() -> str:
    """EMSA_COMMIT when set (a copied tree's .git may not be the code that runs), else git's."""
    named = _tuning.commit()
    if named:
        return named
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                           capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def _write_run(out: Path, opt, record, steps, cfg, hyper, args, device, n_params, summary,
               verdict) -> Path:
    """The run directory (emsa.report's format) and its report; returns report.md's path."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    mem = summary["memory"]
    meta = {"title": "emsa demo: emsa.AdamW vs torch.optim.AdamW on a small GPT",
            "device": f"{name} (torch {torch.__version__}, {torch.get_num_threads()} threads)",
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "commit": _commit(), "peer": "torch.optim.AdamW",
            "result": "equal within tolerance" if verdict["ok"] else f"DIFFERENT: "
                                                                     f"{verdict['why']}",
            "comparison": {k: v for k, v in verdict.items() if k not in ("ok", "why")},
            mem["what"]: f"emsa {report.fmt_bytes(mem['emsa'])}, torch.optim.AdamW "
                         f"{report.fmt_bytes(mem['peer'])}",
            "model": f"GPT, {n_params:,} parameters, {cfg.n_layer} layers, d_model "
                     f"{cfg.d_model}, {cfg.n_head} heads, {cfg.block_size}-token context, "
                     f"{'tied' if cfg.tie_head else 'untied'} head, vocabulary {cfg.vocab_size}",
            "data": f"{CORPUS_CHARS:,} characters of generated sentences, batch "
                    f"{args.batch_size}x{cfg.block_size}, seed {args.seed}",
            "hyperparameters": asdict(hyper), "steps": args.steps, "timing": summary["timing"]}
    return report.write_run(out, plan=opt.plan, record=record, steps=steps, meta=meta)


if __name__ == "__main__":
    sys.exit(main())
