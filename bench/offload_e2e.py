#!/usr/bin/env python3
"""Host tier end to end: a 1.26 B-parameter Llama trained with the Adam state on the GPU, split,
or on the host, side by side with torch's own answers (issue 5, part 4).

Model: transformers LlamaConfig, hidden 2048, 16 layers, intermediate 5632, 16 heads, vocab
32000, untied; random init with a fixed seed; fp32 parameters; bf16 autocast. Batches: random
tokens from a fixed generator, B x T per --shapes (default 4x512 and 16x1024), identical for
every configuration. Each configuration gets a fresh model (same seed) and runs --warmup steps,
then --steps timed steps; a step is forward + backward + step + zero_grad, timed whole by CUDA
events (host work such as a CPU optimizer step is inside: the end event is enqueued after it).

  (a) torch.optim.AdamW(fused=True), all on the GPU
  (b) FSDP2 fully_shard with CPUOffloadPolicy on one GPU (world size 1, nccl): parameters,
      gradients and Adam state on the host, torch.optim.AdamW there (fused, else foreach)
  (c) emsa.AdamW, no budget (the planner keeps what fits on the GPU), updates in step()
  (d) emsa.AdamW with the budget halfway between the all-device and all-host plans' peaks
  (e) emsa.AdamW(tier="host"): all Adam state and the fp32 master on the host
  (f), (g) (e) and (d) with the host tier's tuning knobs set from --ab-knobs (environment
      variables, e.g. EMSA_HOST_THREADS=16 or EMSA_HOST_PACE=0): A/B runs, only
      when asked for in --configs
  (i) (c) with step_in_backward=True: each bucket's update on the current stream between
      backward's kernels as its gradients become final; only when asked for in --configs
  (j), (k), (s) issue 19's speed bar, each (e) with one exact recipe (only when asked for):
      (j) max_grad_norm=--clip-fires (1e-3: clipping fires every step), (k)
      max_grad_norm=--clip-never (1e9: the norm is computed, clipping never fires), (s)
      skip_nonfinite=True; ratios j_over_e, k_over_e, s_over_e, and the clip counts seen.
      --interleave-recipes times (e), (j), (k), (s) again side by side, one step of each in
      turn (all four models and their host tiers resident at once: about 12 B/param of pinned
      host memory each), as run_interleaved_ac does for (a) and (c).
  (d) and (e) update in backward (step_in_backward=True, as emsa advises for the host tier: the
  copies hide under backward, each gradient is freed once copied); --no-step-in-backward: step().

Per configuration: ms/step (median), peak device GiB (torch's peak plus emsa's device arena,
which torch's allocator does not see), final loss; for emsa also the plan's predicted step time
and peak, the fraction of parameters on the host tier (L2), and the engine's own step_stats().
The bound for a host-tier step is the slowest of the three engines that must each do its part:
  max(fwd+bwd of (a), host-tier update bytes / measured host update bandwidth,
      host-tier copy bytes / measured PCIe bandwidth (each direction on its own copy engine)).
The host update's bytes are those of a CPU AdamW over the host tier's state (28 B/param for fp32).
Ratios: (c)/(a), (h)/(a), (i)/(a), (h)/(i), (d)/bound, (e)/bound, (b)/(e), predicted/measured; each bound also with the
DMA's own host-memory traffic counted (8 B/param for fp32: gradient in, parameter out), and
"as built" with the bytes emsa's host tier moves instead (fp32 under device_delta: the CPU's 24 B
plus the DMA's 8).
Numerics: 20 steps of (e) and (a) on a smaller Llama, fp32 without autocast, eager attention,
identical batches; parameters compared element-wise, with (a) against a second run of (a) as
the noise floor of the forward and backward themselves.

--dry-run builds a tiny Llama on the CPU (FSDP2 over gloo) and exercises everything but the
GPU, to check this script, its table and its JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))

GIB = float(1 << 30)
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=5632,
                num_attention_heads=16, num_key_value_heads=16, vocab_size=32000)
LLAMA_CHECK = dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1408,
                   num_attention_heads=8, num_key_value_heads=8, vocab_size=8000)
LLAMA_TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LEAK_WARN_BYTES = 256 << 20


# ---- provenance and the model ----------------------------------------------------------------

def commit() -> str:
    """EMSA_COMMIT, else the stamp scripts/stage-prebuilt leaves beside the library in use
    (what actually ran), else the checkout's HEAD."""
    if os.environ.get("EMSA_COMMIT"):
        return os.environ["EMSA_COMMIT"]
    stamp = Path(os.environ.get("EMSA_LIBRARY", "")).parent / "stamp"
    if os.environ.get("EMSA_LIBRARY") and stamp.is_file():
        words = stamp.read_text().split()
        if len(words) >= 2 and words[0] == "commit":
            return words[1].rstrip(",")
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = ""
    return head or "unknown"


def provenance(benchmark: str, device: torch.device) -> dict:
    import transformers

    now = datetime.datetime.now(datetime.timezone.utc)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    return dict(benchmark=benchmark, date=now.strftime("%Y-%m-%d"), time_utc=now.isoformat(),
                device=name, torch=torch.__version__, transformers=transformers.__version__,
                commit=commit(), command=" ".join([sys.executable] + sys.argv))


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters are created in `dtype` directly: a 7 B model built in fp32 and cast would
    need twice its memory for a moment."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def make_llama(shape: dict, device, dtype=torch.float32, seed=0, attn: str | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    extra = {"attn_implementation": attn} if attn else {}
    config = LlamaConfig(**shape, tie_word_embeddings=False, max_position_embeddings=4096,
                         use_cache=False, **extra)
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(config)
    model.train()
    return model


def token_batches(vocab: int, batch: int, seq: int, count: int, device, seed=1234):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g, device=device)
            for _ in range(count)]


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- timing and memory -------------------------------------------------------------------------

class Clock:
    """Marks as CUDA events on the current stream (no waiting until resolve), or host time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> int:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self, a: int, b: int) -> float:
        if self.cuda:
            return self.marks[a].elapsed_time(self.marks[b]) / 1e3
        return self.marks[b] - self.marks[a]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def settle(device: torch.device) -> dict:
    """Collects garbage and empties torch's cache; returns what is still held, so a
    configuration that leaks into the next one shows."""
    gc.collect()
    if device.type != "cuda":
        return dict(allocated=0, device_used=0)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = dict(allocated=torch.cuda.memory_allocated(device), device_used=total - free)
    torch.cuda.reset_peak_memory_stats(device)
    return used


def one_step(model, opt, ids, ctx):
    """Forward (under ctx), backward, step, zero_grad; returns the loss."""
    with ctx:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def train(model, opt, batches, device, warmup: int, autocast: bool, on_step=None) -> dict:
    """Runs len(batches) steps; the first `warmup` are not timed. Returns medians and losses."""
    clock = Clock(device)
    spans, losses = [], []
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if autocast
           else contextlib.nullcontext())
    sync(device)
    wall0 = 0.0
    for i, ids in enumerate(batches):
        if i == warmup:
            sync(device)
            wall0 = time.perf_counter()
        start = clock.mark()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        mid = clock.mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end = clock.mark()
        if on_step is not None:
            on_step(i)
        losses.append(loss.detach())
        spans.append((start, mid, end))
    sync(device)
    timed = spans[warmup:]
    wall = (time.perf_counter() - wall0) / max(1, len(timed))
    step = [clock.seconds(s, e) for s, _, e in timed]
    fwd_bwd = [clock.seconds(s, m) for s, m, _ in timed]
    opt_step = [clock.seconds(m, e) for _, m, e in timed]
    return dict(step_s=statistics.median(step), step_times_s=step, wall_step_s=wall,
                fwd_bwd_s=statistics.median(fwd_bwd), opt_step_s=statistics.median(opt_step),
                final_loss=losses[-1].item(), losses=[x.item() for x in losses])


def peak_bytes(device: torch.device) -> dict:
    if device.type != "cuda":
        return dict(torch_peak_bytes=0, torch_reserved_peak_bytes=0)
    return dict(torch_peak_bytes=torch.cuda.max_memory_allocated(device),
                torch_reserved_peak_bytes=torch.cuda.max_memory_reserved(device))


# ---- the configurations ------------------------------------------------------------------------

def run_torch(args, shape, batches, device) -> dict:
    model = make_llama(shape, device)
    opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
    out = train(model, opt, batches, device, args.warmup, autocast=args.autocast)
    out.update(peak_bytes(device), params=numel(model))
    out["peak_device_bytes"] = out["torch_peak_bytes"]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_fsdp(args, shape, batches, device) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    def sharded():
        model = make_llama(shape, device)  # built where (a) builds it: the same initial values
        mesh = init_device_mesh(device.type, (1,))
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        settle(device)  # the unsharded originals are gone; the peak starts here
        return model

    with one_rank_group(device):
        impl, out = "fused", None
        model = sharded()
        try:  # torch's fastest CPU AdamW, where this torch has it for DTensor parameters
            opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
            out = train(model, opt, batches, device, args.warmup, autocast=args.autocast)
        except RuntimeError as e:
            impl = f"foreach (fused failed: {str(e).splitlines()[0][:160]})"
        if out is None:  # afresh, outside the except block (its traceback holds the old model)
            model = opt = None
            model = sharded()
            opt = torch.optim.AdamW(model.parameters(), **HYPER, foreach=True)
            out = train(model, opt, batches, device, args.warmup, autocast=args.autocast)
        out.update(peak_bytes(device), params=numel(model), optimizer_impl=impl)
        out["peak_device_bytes"] = out["torch_peak_bytes"]
        del model, opt
        return out


def emsa_adamw(params, tier, **kw):
    """emsa.AdamW with tier= when given. In a dry run on the CPU, a build whose AdamW has no
    tier= yet plans without it (noted in the result); on the GPU that is an error."""
    import emsa

    if tier is not None:
        if "tier" in inspect.signature(emsa.AdamW.__init__).parameters:
            kw["tier"] = tier
        elif not kw.pop("_dry_run", False):
            raise RuntimeError("this emsa.AdamW has no tier= argument: the host tier for CUDA "
                               "parameters (issue 5) is not in this build")
    kw.pop("_dry_run", None)
    return emsa.AdamW(params, **HYPER, **kw)


def l2_split(plan) -> dict:
    """How much sits on the host tier, and what moving it costs per step in bytes."""
    trainable = [p for p in plan.json["params"] if p["trainable"]]
    host = [p for p in trainable if p["tier"] == "L2"]
    size = {"float32": 4, "bfloat16": 2, "float16": 2}
    total = sum(p["numel"] for p in trainable) or 1
    import ctypes

    from emsa._native import structs as _capi
    from emsa._native import tuning as _tuning
    from emsa._native.library import lib

    delta = _tuning.host_delta()
    if delta is None:  # libemsa's default (HostTierOptions::device_delta)
        defaults = _capi.HostTierOptions()
        lib.emsa_host_tier_options_init(ctypes.byref(defaults))
        delta = defaults.device_delta == 1
    update_bytes = built_bytes = copy_bytes = gpu_numel = 0
    for p in host:
        n, ps, ss = p["numel"], size[p["param_dtype"]], size[p["state_dtype"]]
        # A CPU AdamW update of the host tier's state: grad in, fp32 master and both moments
        # read and written, a low-precision parameter written out (the bound's bytes).
        update_bytes += n * (ps + 8 + 4 * ss + (ps if ps != 4 else 0))
        if p.get("device_update"):
            # Updated by the GPU, its moments streamed through: no CPU bytes; the DMA moves the
            # moments each way (counted twice in host memory by the bound below).
            copy_bytes += n * 2 * ss
            gpu_numel += n
            continue
        # What emsa's host update moves (src/plan/costs.cc HostUpdateTraffic): an fp32
        # parameter's update is applied on the device from a delta written over the gradient,
        # so the CPU neither reads nor writes the parameter.
        built_bytes += n * (8 + 4 * ss) if delta and ps == 4 else n * (ps + 8 + 4 * ss +
                                                                        (ps if ps != 4 else 0))
        copy_bytes += n * ps  # the gradient one way, the parameter (or its delta) the other
    return dict(l2_fraction=sum(p["numel"] for p in host) / total, l2_params=len(host),
                l2_numel=sum(p["numel"] for p in host), host_update_bytes=update_bytes,
                host_update_bytes_as_built=built_bytes, device_delta=delta,
                host_copy_bytes_each_way=copy_bytes, device_update_numel=gpu_numel,
                device_update_share=plan.json["prediction"].get("device_update_share", 0.0))


def half_budget(record, in_backward: bool) -> dict:
    """The budget halfway between the all-device and the all-host plans' device peaks."""
    import emsa

    kw = dict(release_grads=in_backward)
    device_peak = emsa.make_plan(record, allow_host_tier=False, **kw).json["prediction"][
        "peak_device_bytes"]
    host_peak = emsa.make_plan(record, force_all_host=True, **kw).json["prediction"][
        "peak_device_bytes"]
    return dict(all_device_peak_bytes=device_peak, all_host_peak_bytes=host_peak,
                budget_bytes=(device_peak + host_peak) // 2)


@contextlib.contextmanager
def environ(**values: str):
    """Environment variables set for the block (the host tier reads its tuning knobs at
    creation)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fresh_profile(args, profile: dict) -> dict:
    """The profile an emsa configuration plans with: measured again right before it (what a
    user's optimizer does when built; the shared host's memory bandwidth moves within minutes),
    unless --no-profile-each, then the run's first."""
    if not args.profile_each or args.dry_run:
        return profile
    import emsa

    return emsa.measure_profile(measure_bandwidth=True)


def recipe_options(args) -> dict[str, dict]:
    """(j), (k), (s): the optimizer options each adds to (e)."""
    return dict(j=dict(max_grad_norm=args.clip_fires), k=dict(max_grad_norm=args.clip_never),
                s=dict(skip_nonfinite=True))


def recipe_counters(opt) -> dict:
    """What the exact recipes did (issue 19's counters, where this emsa has them)."""
    out = {}
    for name in ("clip_count", "last_grad_norm", "last_step_skipped"):
        try:
            out[name] = getattr(opt, name)
        except AttributeError:
            pass
    return out


def run_emsa(args, shape, batches, device, profile, mode: str, knobs: dict | None = None,
             opt_kw: dict | None = None) -> dict:
    with environ(**(knobs or {})):
        out = _run_emsa(args, shape, batches, device, profile, mode, opt_kw or {})
    if knobs:
        out["knobs"] = knobs
    if opt_kw:
        out["optimizer_options"] = opt_kw
    return out


def _run_emsa(args, shape, batches, device, profile, mode: str, opt_kw: dict) -> dict:
    import emsa

    profile = fresh_profile(args, profile)
    model = make_llama(shape, device)
    ids = batches[0]
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast
           else contextlib.nullcontext())
    with ctx:
        record = emsa.probe(model, input_ids=ids, labels=ids, profile=profile, trace=False)
    # The host-tier configurations update in backward, as emsa advises for them: the copies
    # hide under backward and each gradient is freed once copied.
    # (i): all state on the device, updated in backward on the current stream.
    in_backward = mode == "device-in-backward" or (args.step_in_backward and mode != "device")
    out: dict = dict(params=numel(model), step_in_backward=in_backward)
    tier, budget = {"device": (None, None), "host": ("host", None)}.get(mode, (None, None))
    if mode == "half":
        out.update(half_budget(record, in_backward))
        budget = out["budget_bytes"]
    opt = emsa_adamw(model.parameters(), tier, probe=record, budget=budget,
                     step_in_backward=in_backward, _dry_run=args.dry_run, **opt_kw)
    if tier is not None and "tier" not in inspect.signature(emsa.AdamW.__init__).parameters:
        out["note"] = "dry run: this emsa.AdamW has no tier= yet; planned without it"
    plan = opt.plan
    settle(device)  # the probe's gradients are gone; the arena stays (emsa holds it)
    out.update(train(model, opt, batches, device, args.warmup, autocast=args.autocast))
    out.update(peak_bytes(device))
    out.update(l2_split(plan))
    out["profile"] = profile_summary(profile)
    pred = plan.json["prediction"]
    out.update(device_arena_bytes=plan.device_arena_bytes, host_arena_bytes=plan.host_arena_bytes,
               predicted={k: pred.get(k) for k in ("step_time", "peak_device_bytes", "stall_time",
                                                  "cpu_time", "d2h_time", "h2d_time", "hbm_time",
                                                  "period", "load_slowdown")},
               probe_period_s=record.forward_time + record.backward_time,
               probe_period_under_load_s=record.period_under_load,
               plan_budget_bytes=plan.json.get("budget_bytes"),
               min_budget_bytes=plan.json.get("min_budget_bytes"),
               plan_table=str(plan).splitlines()[-14:])
    out.update(emsa_peak(opt, out["torch_peak_bytes"]))
    out["measured"] = engine_stats(opt, args.steps)
    out["host_trace"] = host_trace(opt)
    out.update(recipe_counters(opt))
    del model, opt, record, plan
    return out


def emsa_peak(opt, torch_peak: int) -> dict:
    """The peak with emsa's device memory beside torch's allocator: the plan's arena and the
    host tier's staging for its GPU-updated buckets (their slots)."""
    host = getattr(getattr(getattr(opt, "_bound", None), "engine", None), "host", None)
    staging = getattr(host, "staging_bytes", 0)
    return dict(host_tier_staging_bytes=staging,
                peak_device_bytes=torch_peak + opt.plan.device_arena_bytes + staging)


def host_bandwidth(summary: dict) -> float:
    """The host update bandwidth of a profile_summary (the plain stream's if not measured)."""
    return summary.get("host_update_bandwidth") or summary.get("host_mem_bandwidth") or 0.0


def profile_summary(profile: dict) -> dict:
    cpu, gpu = profile.get("cpu") or {}, profile.get("gpu") or {}
    return dict(host_update_bandwidth=cpu.get("host_update_bandwidth"),
                host_mem_bandwidth=cpu.get("host_mem_bandwidth"),
                d2h_bandwidth=gpu.get("d2h_bandwidth"), h2d_bandwidth=gpu.get("h2d_bandwidth"),
                duplex_bandwidth=gpu.get("duplex_bandwidth"),
                host_update_duplex_bandwidth=gpu.get("host_update_duplex_bandwidth"),
                duplex_under_update_bandwidth=gpu.get("duplex_under_update_bandwidth"))


def host_trace(opt) -> dict | None:
    """The last step's host-tier timeline (seconds since the step began on the host): when the
    last bucket was submitted (about the end of backward), how much CPU update ran before
    that, and when the CPU first and last worked."""
    from emsa._distributed import dtensor as _dtensor

    host = getattr(getattr(getattr(opt, "_bound", None), "engine", None), "host", None)
    if host is None:
        return None
    opt.synchronize()
    rows = host.trace()
    submitted = [s for s, _, _ in rows if s >= 0]
    spans = [(a, b) for _, a, b in rows if a >= 0 and b >= 0]
    if not submitted or not spans:
        return None
    last = max(submitted)
    before = sum(max(0.0, min(b, last) - a) for a, b in spans)
    # Each bucket's parameter count, so its CPU time reads as a rate (rows: submit, start, end):
    # the tier holds this rank's shards, so a DTensor parameter (FSDP2) counts its local piece.
    numel = [0] * len(rows)
    for group in opt.param_groups:
        for p in group["params"]:
            shard = _dtensor.local(p)
            k = host._bucket_of.get(id(shard))
            if k is not None:
                numel[k] += shard.numel()
    return dict(buckets=len(rows), last_submit_s=last, first_cpu_start_s=min(a for a, _ in spans),
                last_cpu_end_s=max(b for _, b in spans), cpu_busy_s=sum(b - a for a, b in spans),
                cpu_busy_before_last_submit_s=before, bucket_numel=numel,
                rows=[[round(x, 6) for x in r] for r in rows])


def engine_stats(opt, timed: int) -> dict | None:
    """Medians of emsa's own per-step measurements over the timed steps (None: not built)."""
    stats = getattr(opt, "step_stats", None)
    if stats is None:
        return None
    rows = stats()[-timed:]
    out = {}
    for key in sorted({k for r in rows for k in r if k.endswith("_s")}):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    peaks = [r["peak_device_bytes"] for r in rows if r.get("peak_device_bytes") is not None]
    if peaks:
        out["peak_device_bytes"] = max(peaks)
    return out


# ---- numerics: emsa host tier vs torch, same batches -------------------------------------------

def max_differences(ours, ref) -> dict:
    worst = abs_diff = rel = 0.0
    where = ""
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        a, b = a.detach().double(), b.detach().double()
        d = (a - b).abs()
        # assert_close's measure at rtol 1e-5, atol 1e-7: <= 1 passes.
        w = (d / (1e-7 + 1e-5 * b.abs())).max().item()
        big = b.abs() > 1e-3 * b.abs().max()  # relative error where it means something
        r = (d[big] / b.abs()[big]).max().item() if big.any() else 0.0
        if w > worst:
            worst, where = w, name
        abs_diff, rel = max(abs_diff, d.max().item()), max(rel, r)
    return dict(max_rel_diff=rel, max_abs_diff=abs_diff, worst_vs_rtol_1e5=worst,
                worst_param=where)


def numerics_check(args, device) -> dict:
    """Parameters after check_steps fp32 steps, three ways.

    shared: emsa tier="host" and torch fused AdamW fed the same gradients (emsa's model runs
    forward and backward; its gradients are copied to torch's model before both step): the
    optimizers compared, the issue's bar (rtol 1e-5). independent: each model runs its own
    forward and backward; printed with its control, torch fused against torch foreach (the same
    math in other kernels): in a deep network a one-ulp difference in the weights moves some
    gradient elements (sums that nearly cancel) by percent within a step, so independent runs of
    two correct optimizers drift apart, and emsa's drift is judged against torch's own.
    twin: emsa host tier against emsa with all state on the device, independent runs: bitwise
    equal when nothing raced (the CPU and GPU kernels give the same bits)."""
    shape = LLAMA_TINY if args.dry_run else LLAMA_CHECK
    batches = token_batches(shape["vocab_size"], 2, 64 if args.dry_run else 256,
                            args.check_steps, device, seed=99)
    in_backward = args.step_in_backward

    def make(which, params):
        if which == "emsa-host":
            return emsa_adamw(params, "host", step_in_backward=in_backward,
                              _dry_run=args.dry_run)
        if which == "emsa-device":
            return emsa_adamw(params, "device", step_in_backward=in_backward,
                              _dry_run=args.dry_run)
        return torch.optim.AdamW(params, **HYPER, fused=which == "torch-fused",
                                 foreach=which == "torch-foreach" or None)

    def run(which):
        model = make_llama(shape, device, attn="eager")
        opt = make(which, model.parameters())
        out = train(model, opt, batches, device, 0, autocast=False)
        getattr(opt, "synchronize", lambda: None)()  # host-tier parameters read outside forward
        del opt
        return model.cpu(), out["losses"]

    def run_shared():
        model = make_llama(shape, device, attn="eager")
        ref = make_llama(shape, device, attn="eager")
        opt = emsa_adamw(model.parameters(), "host", _dry_run=args.dry_run)
        ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = p.grad.clone()
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
        opt.synchronize()
        del opt, ref_opt
        return model.cpu(), ref.cpu()

    ref, ref_losses = run("torch-fused")
    control, _ = run("torch-foreach")
    ours, losses = run("emsa-host")
    twin, _ = run("emsa-device")
    shared_ours, shared_ref = run_shared()
    twin_equal = all(torch.equal(a, b) for a, b in zip(ours.parameters(), twin.parameters()))
    return dict(steps=args.check_steps, model=shape,
                shared_emsa_host_vs_torch=max_differences(shared_ours, shared_ref),
                independent_emsa_host_vs_torch=max_differences(ours, ref),
                independent_torch_foreach_vs_fused=max_differences(control, ref),
                emsa_host_equals_emsa_device_bitwise=twin_equal,
                max_loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)))


# ---- one shape, all configurations -------------------------------------------------------------

CONFIGS = [("a", "torch AdamW fused"), ("b", "FSDP2 CPUOffloadPolicy"), ("c", "emsa no budget"),
           ("d", "emsa half budget"), ("e", "emsa tier=host"),
           ("f", "(e) with --ab-knobs"), ("g", "(d) with --ab-knobs"),
           ("i", "(c) in bwd, current stream"), ("j", "(e) clipping every step"),
           ("k", "(e) clipping never fires"), ("s", "(e) skip_nonfinite=True")]


def run_shape(args, shape, batch, seq, device, profile) -> dict:
    batches = token_batches(shape["vocab_size"], batch, seq, args.warmup + args.steps, device)
    runners = {
        "a": lambda: run_torch(args, shape, batches, device),
        "b": lambda: run_fsdp(args, shape, batches, device),
        "c": lambda: run_emsa(args, shape, batches, device, profile, "device"),
        "d": lambda: run_emsa(args, shape, batches, device, profile, "half"),
        "e": lambda: run_emsa(args, shape, batches, device, profile, "host"),
        "f": lambda: run_emsa(args, shape, batches, device, profile, "host", args.ab_knobs),
        "g": lambda: run_emsa(args, shape, batches, device, profile, "half", args.ab_knobs),
        "i": lambda: run_emsa(args, shape, batches, device, profile, "device-in-backward"),
        **{key: (lambda kw=kw: run_emsa(args, shape, batches, device, profile, "host",
                                        opt_kw=kw))
           for key, kw in recipe_options(args).items()},
    }
    results = {}
    for key, label in CONFIGS:
        if key not in args.configs:
            continue
        before = settle(device)
        print(f"[{batch}x{seq}] ({key}) {label} ...", flush=True)
        t0 = time.perf_counter()
        try:
            r = runners[key]()
        except Exception:  # noqa: BLE001 - one configuration failing must not hide the others
            r = dict(error=traceback.format_exc(limit=6))
            print(r["error"], file=sys.stderr)
        after = settle(device)
        r.update(label=label, wall_s=time.perf_counter() - t0,
                 left_allocated_bytes=after["allocated"] - before["allocated"],
                 left_device_used_bytes=after["device_used"] - before["device_used"])
        if max(r["left_allocated_bytes"], r["left_device_used_bytes"]) > LEAK_WARN_BYTES:
            print(f"  warning: ({key}) left {r['left_allocated_bytes'] / GIB:.2f} GiB allocated, "
                  f"{r['left_device_used_bytes'] / GIB:.2f} GiB of device memory in use",
                  file=sys.stderr)
        results[key] = r
    out = dict(batch=batch, seq=seq, configs=results, **ratios(results, profile))
    if args.interleave and "a" in results and "c" in results:
        settle(device)
        print(f"[{batch}x{seq}] (a) and (c) interleaved ...", flush=True)
        try:
            out["interleaved_ac"] = run_interleaved_ac(args, shape, batches, device, profile)
            out["ratios"]["c_over_a_interleaved"] = out["interleaved_ac"]["c_over_a"]
            out["ratios"]["c0_over_a_interleaved"] = out["interleaved_ac"]["c0_over_a"]
        except Exception:  # noqa: BLE001 - reported; the sequential figures stand
            out["interleaved_ac"] = dict(error=traceback.format_exc(limit=6))
            print(out["interleaved_ac"]["error"], file=sys.stderr)
        settle(device)
    if args.interleave_recipes:
        settle(device)
        print(f"[{batch}x{seq}] (e), (j), (k), (s) interleaved in blocks ...", flush=True)
        try:
            out["interleaved_recipes"] = run_interleaved_recipes(args, shape, batches, device,
                                                                 profile)
            for k, v in out["interleaved_recipes"]["ratios"].items():
                out["ratios"][f"{k}_interleaved"] = v
        except Exception:  # noqa: BLE001 - reported; the sequential figures stand
            out["interleaved_recipes"] = dict(error=traceback.format_exc(limit=6))
            print(out["interleaved_recipes"]["error"], file=sys.stderr)
        settle(device)
    return out


def run_interleaved_ac(args, shape, batches, device, profile) -> dict:
    """(a) and (c) timed again side by side: the models live at once and each round runs one
    step of each, the order rotating, so that drift in the shared host's load (which moves a
    launch-bound 4 x 512 step by 10% within a minute) falls on all alike. A third, (c0), is (c)
    with skip_nonfinite=False: torch's AdamW does not look for inf/nan gradients, emsa's does by
    default (one more read of every gradient before the update), so (c0) is the like-for-like
    step and (c) the default. Peaks are the sequential runs' (all models are resident here)."""
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast
           else contextlib.nullcontext())
    import emsa

    def emsa_no_budget(**kw):
        model = make_llama(shape, device)
        with ctx:
            record = emsa.probe(model, input_ids=batches[0], labels=batches[0],
                                profile=fresh_profile(args, profile), trace=False)
        return model, emsa_adamw(model.parameters(), None, probe=record, budget=None,
                                 step_in_backward=False, _dry_run=args.dry_run, **kw)

    model_a = make_llama(shape, device)
    runners = dict(a=(model_a, torch.optim.AdamW(model_a.parameters(), **HYPER, fused=True)),
                   c=emsa_no_budget(), c0=emsa_no_budget(skip_nonfinite=False))
    del model_a
    keys = list(runners)
    clock = Clock(device)
    spans: dict = {k: [] for k in keys}
    sync(device)
    for i, ids in enumerate(batches):
        for key in keys[i % 3:] + keys[:i % 3]:
            start = clock.mark()
            one_step(*runners[key], ids, ctx)
            end = clock.mark()
            if i >= args.warmup:
                spans[key].append((start, end))
    sync(device)
    times = {k: [clock.seconds(s, e) for s, e in v] for k, v in spans.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    del runners
    return dict(a_step_s=med["a"], c_step_s=med["c"], c0_step_s=med["c0"],
                c_over_a=med["c"] / med["a"], c0_over_a=med["c0"] / med["a"],
                a_step_times_s=times["a"], c_step_times_s=times["c"],
                c0_step_times_s=times["c0"],
                c_over_a_per_round_median=statistics.median(
                    c / a for a, c in zip(times["a"], times["c"])),
                c0_over_a_per_round_median=statistics.median(
                    c / a for a, c in zip(times["a"], times["c0"])))


def recipe_ratios(ok: dict) -> dict:
    """Issue 19's speed bar: each exact recipe's step over the unclipped host-tier step (e)."""
    if "e" not in ok:
        return {}
    return {f"{k}_over_e": ok[k]["step_s"] / ok["e"]["step_s"] for k in RECIPES if k in ok}


RECIPES = ("j", "k", "s")


def run_interleaved_recipes(args, shape, batches, device, profile) -> dict:
    """(e), (j), (k), (s) timed again in turn, all resident at once: --recipe-rounds rounds,
    each running a block of steps of every configuration (the order rotating), so that drift in
    the shared host's load falls on all alike. Blocks, not single steps: a host-tier step's CPU
    update overlaps the next forward of the same model, which one step of another model in
    between would change; each block starts after the previous one's work is done
    (synchronize), and its first step is not counted. Returns medians over the counted steps
    and each recipe's ratio to (e)."""
    import emsa

    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast
           else contextlib.nullcontext())
    runners = {}
    for key, kw in dict(e={}, **recipe_options(args)).items():
        model = make_llama(shape, device)
        with ctx:
            record = emsa.probe(model, input_ids=batches[0], labels=batches[0],
                                profile=fresh_profile(args, profile), trace=False)
        runners[key] = (model, emsa_adamw(model.parameters(), "host", probe=record,
                                          step_in_backward=args.step_in_backward,
                                          _dry_run=args.dry_run, **kw))
        del record
        settle(device)
    keys = list(runners)
    clock = Clock(device)
    spans: dict = {k: [] for k in keys}
    block = batches[:max(2, args.steps)]
    for r in range(args.recipe_rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            model, opt = runners[key]
            for i, ids in enumerate(block):
                start = clock.mark()
                one_step(model, opt, ids, ctx)
                end = clock.mark()
                if i > 0:
                    spans[key].append((start, end))
            opt.synchronize()
            sync(device)
    times = {k: [clock.seconds(s, e) for s, e in v] for k, v in spans.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    out = dict(rounds=args.recipe_rounds, block_steps=len(block),
               step_s={k: med[k] for k in keys},
               ratios={f"{k}_over_e": med[k] / med["e"] for k in keys if k != "e"},
               step_times_s=times,
               counters={k: recipe_counters(runners[k][1]) for k in keys})
    del runners
    return out


def ratios(results: dict, profile: dict) -> dict:
    ok = {k: r for k, r in results.items() if "error" not in r}
    bounds, main, predicted = {}, {}, {}
    if "a" not in ok:
        return dict(bounds=bounds, ratios=recipe_ratios(ok))
    fwd_bwd = ok["a"]["fwd_bwd_s"]
    start = profile_summary(profile)  # measured at the run's start
    for k in ("c", "d", "e", "f", "g"):
        if k not in ok:
            continue
        r = ok[k]
        # The bound at probe time: the bandwidths measured right before this configuration
        # (fresh_profile), else the run's first.
        own = r.get("profile") or start
        host_bw, start_bw = host_bandwidth(own), host_bandwidth(start)
        d2h, h2d = own.get("d2h_bandwidth") or 0.0, own.get("h2d_bandwidth") or 0.0
        duplex = own.get("duplex_bandwidth") or 0.0  # each way with both at once
        host_s = r["host_update_bytes"] / host_bw if host_bw else 0.0
        # The same with the DMA's own trips through host memory counted (gradient written in,
        # parameter read out): not a floor (a DMA may hit the CPU's cache), the traffic as built.
        host_dma_s = ((r["host_update_bytes"] + 2 * r["host_copy_bytes_each_way"]) / host_bw
                      if host_bw else 0.0)
        # emsa's own host-memory traffic: its CPU update's bytes (24 B/param for fp32 under
        # device_delta) plus the DMA's.
        built = r.get("host_update_bytes_as_built", r["host_update_bytes"])
        built_s = (built + 2 * r["host_copy_bytes_each_way"]) / host_bw if host_bw else 0.0
        # The copies run both ways at once: at the duplex rate where the profile measured it.
        pcie_s = max(r["host_copy_bytes_each_way"] / bw if bw else 0.0
                     for bw in (d2h, h2d, duplex))
        bounds[k] = dict(bound_s=max(fwd_bwd, host_s, pcie_s), fwd_bwd_s=fwd_bwd,
                         host_update_s=host_s, pcie_s=pcie_s,
                         bound_with_dma_s=max(fwd_bwd, host_dma_s, pcie_s),
                         bound_as_built_s=max(fwd_bwd, built_s, pcie_s),
                         host_update_bandwidth=host_bw,
                         # the same bound with the host bandwidth measured at the run's start
                         bound_run_start_s=max(fwd_bwd, r["host_update_bytes"] / start_bw
                                               if start_bw else 0.0, pcie_s))
        pred = r["predicted"]
        if pred.get("step_time"):
            predicted[f"{k}_predicted_over_measured_time"] = pred["step_time"] / r["step_s"]
        if pred.get("peak_device_bytes") and r["peak_device_bytes"]:
            predicted[f"{k}_predicted_over_measured_peak"] = (pred["peak_device_bytes"]
                                                              / r["peak_device_bytes"])
    for k in ("c", "i"):
        if k in ok:
            main[f"{k}_over_a"] = ok[k]["step_s"] / ok["a"]["step_s"]
    for k in ("d", "e", "f", "g"):
        if k in bounds:
            main[f"{k}_over_bound"] = ok[k]["step_s"] / bounds[k]["bound_s"]
            main[f"{k}_over_bound_with_dma"] = ok[k]["step_s"] / bounds[k]["bound_with_dma_s"]
            main[f"{k}_over_bound_as_built"] = ok[k]["step_s"] / bounds[k]["bound_as_built_s"]
            main[f"{k}_over_bound_run_start"] = ok[k]["step_s"] / bounds[k]["bound_run_start_s"]
    for k in ("e", "f"):
        if k in ok:
            main[f"{k}_over_a"] = ok[k]["step_s"] / ok["a"]["step_s"]
    main.update(recipe_ratios(ok))
    if "b" in ok and "e" in ok:
        main["b_over_e"] = ok["b"]["step_s"] / ok["e"]["step_s"]
    return dict(bounds=bounds, ratios={**main, **predicted})


# ---- report ------------------------------------------------------------------------------------

def table(result: dict) -> str:
    lines = []
    for s in result["shapes"]:
        lines.append(f"\nbatch {s['batch']}x{s['seq']}  ({result['device']}, "
                     f"{result['params'] / 1e6:,.1f} M params)")
        lines.append(f"  {'config':28} {'ms/step':>9} {'peak GiB':>9} {'loss':>8} "
                     f"{'pred ms':>8} {'pred GiB':>9} {'on L2':>6}")
        for key, label in CONFIGS:
            r = s["configs"].get(key)
            if r is None:
                continue
            name = f"({key}) {label}"
            if "error" in r:
                lines.append(f"  {name:28} failed: {r['error'].strip().splitlines()[-1][:80]}")
                continue
            pred = r.get("predicted", {})
            pms = f"{pred['step_time'] * 1e3:8.1f}" if pred.get("step_time") else f"{'-':>8}"
            pgib = (f"{pred['peak_device_bytes'] / GIB:9.2f}" if pred.get("peak_device_bytes")
                    else f"{'-':>9}")
            l2 = f"{r['l2_fraction']:6.0%}" if "l2_fraction" in r else f"{'-':>6}"
            peak = r["peak_device_bytes"] / GIB
            lines.append(f"  {name:28} {r['step_s'] * 1e3:9.1f} {peak:9.2f} "
                         f"{r['final_loss']:8.4f} {pms} {pgib} {l2}")
            if r.get("probe_period_under_load_s"):
                lines.append(f"    probe: forward + backward {r['probe_period_s'] * 1e3:.1f} ms "
                             f"alone, {r['probe_period_under_load_s'] * 1e3:.1f} ms under the "
                             f"host tier's load; the plan's period "
                             f"{pred.get('period', 0) * 1e3:.1f} ms "
                             f"(x{pred.get('load_slowdown', 1):.2f})")
                prof = r.get("profile") or {}
                lines.append(f"    plan: GPU share {r.get('device_update_share', 0):.0%}; "
                             f"predicted CPU {pred.get('cpu_time', 0) * 1e3:.1f} ms, links "
                             f"{pred.get('h2d_time', 0) * 1e3:.1f} ms, stall "
                             f"{pred.get('stall_time', 0) * 1e3:.1f} ms; profile: both ways "
                             f"{(prof.get('duplex_bandwidth') or 0) / 1e9:.1f} GB/s, under the "
                             f"CPU update {(prof.get('duplex_under_update_bandwidth') or 0) / 1e9:.1f}"
                             f" GB/s")
        for k in RECIPES + ("e",):
            r = s["configs"].get(k)
            if r and "error" not in r and "clip_count" in r:
                lines.append(f"  ({k}) clipped {r['clip_count']} of {args_steps(result)} steps, "
                             f"last grad norm {r.get('last_grad_norm') or 0:.4g}")
        ir = s.get("interleaved_recipes")
        if ir and "error" not in ir:
            lines.append("  interleaved in blocks: " + ", ".join(
                f"({k}) {v * 1e3:.1f}" for k, v in ir["step_s"].items()) + " ms/step; " +
                ", ".join(f"{k} {v:.3f}" for k, v in ir["ratios"].items()) + "; clipped " +
                ", ".join(f"({k}) {c.get('clip_count')}" for k, c in ir["counters"].items()))
        elif ir:
            lines.append(f"  interleaved recipes failed: "
                         f"{ir['error'].strip().splitlines()[-1][:80]}")
        il = s.get("interleaved_ac")
        if il and "error" not in il:
            lines.append(f"  interleaved, one step of each in turn: (a) {il['a_step_s'] * 1e3:.1f}, "
                         f"(c) {il['c_step_s'] * 1e3:.1f}, (c0) {il['c0_step_s'] * 1e3:.1f} "
                         f"ms/step; (c)/(a) {il['c_over_a']:.3f} (per round "
                         f"{il['c_over_a_per_round_median']:.3f}), (c0)/(a) "
                         f"{il['c0_over_a']:.3f} (per round {il['c0_over_a_per_round_median']:.3f})"
                         "; (c0): skip_nonfinite=False, torch's semantics")
        rat = list(s["ratios"].items())
        for i in range(0, len(rat), 4):
            lines.append("  " + "   ".join(f"{k} {v:.2f}" for k, v in rat[i:i + 4]))
        for k, b in s["bounds"].items():
            lines.append(f"  bound ({k}): {b['bound_s'] * 1e3:.1f} ms = max(fwd+bwd "
                         f"{b['fwd_bwd_s'] * 1e3:.1f}, host update {b['host_update_s'] * 1e3:.1f}, "
                         f"PCIe {b['pcie_s'] * 1e3:.1f}); with the DMA's host-memory traffic "
                         f"{b['bound_with_dma_s'] * 1e3:.1f} ms; emsa's own host-memory traffic "
                         f"{b.get('bound_as_built_s', 0.0) * 1e3:.1f} ms; host update "
                         f"{b.get('host_update_bandwidth', 0.0) / 1e9:.1f} GB/s measured before "
                         f"it (at the run's start: bound {b.get('bound_run_start_s', 0.0) * 1e3:.1f}"
                         " ms)")
        for k in "defg":
            t = s["configs"].get(k, {}).get("host_trace")
            if t:
                lines.append(f"  trace ({k}): last submit {t['last_submit_s'] * 1e3:.1f} ms, CPU "
                             f"{t['first_cpu_start_s'] * 1e3:.1f}..{t['last_cpu_end_s'] * 1e3:.1f} "
                             f"ms, busy {t['cpu_busy_s'] * 1e3:.1f} ms of which "
                             f"{t['cpu_busy_before_last_submit_s'] * 1e3:.1f} before the last "
                             "submit")
            share = s["configs"].get(k, {}).get("device_update_share")
            if share:
                lines.append(f"    host tier updated by the GPU (moments streamed): "
                             f"{100 * share:.0f}% of its parameters")
            m = s["configs"].get(k, {}).get("measured") or {}
            if "worker_s" in m:
                lines.append(f"    worker per step (medians): {m['worker_s'] * 1e3:.1f} ms, of "
                             f"which CPU update {m['cpu_s'] * 1e3:.1f}, waiting for gradients "
                             f"{m['grad_wait_s'] * 1e3:.1f}"
                             + (f"; GPU path: moments up {m['stream_up_s'] * 1e3:.1f} ms"
                                if m.get("stream_up_s") else ""))
    n = result.get("numerics")
    if n:
        sh = n["shared_emsa_host_vs_torch"]
        ind, ctl = n["independent_emsa_host_vs_torch"], n["independent_torch_foreach_vs_fused"]
        lines.append(f"\nnumerics, {n['steps']} steps fp32: shared gradients: emsa host vs "
                     f"torch fused max rel diff {sh['max_rel_diff']:.2e} (worst/rtol-1e-5 "
                     f"{sh['worst_vs_rtol_1e5']:.2f}); independent runs: emsa host vs torch "
                     f"fused {ind['max_rel_diff']:.2e}, control torch foreach vs fused "
                     f"{ctl['max_rel_diff']:.2e}; emsa host == emsa device bitwise: "
                     f"{n['emsa_host_equals_emsa_device_bitwise']}")
    return "\n".join(lines)


def args_steps(result: dict) -> int:
    """Steps each configuration ran (warm-up included): clip_count counts them all."""
    return result["warmup"] + result["steps"]


def parse_knobs(text: str) -> dict:
    pairs = [p.split("=", 1) for p in text.split(",") if p]
    if any(len(p) != 2 or not p[0].startswith("EMSA_") for p in pairs):
        raise argparse.ArgumentTypeError(f"expected EMSA_NAME=VALUE,...: {text!r}")
    return dict(pairs)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(x) for x in item.lower().split("x")) for item in text.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes {text!r}: expected BxT[,BxT...], e.g. 4x512,16x1024")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="4x512,16x1024", help="batch x tokens, comma-separated")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--check-steps", type=int, default=20, help="numerics check (0: skip)")
    ap.add_argument("--configs", default="abcde", help="which of (a)..(i) to run")
    ap.add_argument("--ab-knobs", type=parse_knobs, default={},
                    help="(f), (g): NAME=VALUE,... environment for the host tier")
    ap.add_argument("--no-autocast", dest="autocast", action="store_false")
    ap.add_argument("--no-step-in-backward", dest="step_in_backward", action="store_false",
                    help="(d) and (e) update in step() instead of in backward")
    ap.add_argument("--no-profile-each", dest="profile_each", action="store_false",
                    help="plan every emsa configuration with the profile measured at the run's "
                         "start, instead of one measured right before it")
    ap.add_argument("--no-interleave", dest="interleave", action="store_false",
                    help="skip the second timing of (a) and (c), one step of each in turn")
    ap.add_argument("--clip-fires", type=float, default=1e-3,
                    help="(j): max_grad_norm small enough to clip every step")
    ap.add_argument("--clip-never", type=float, default=1e9,
                    help="(k): max_grad_norm large enough never to clip")
    ap.add_argument("--interleave-recipes", action="store_true",
                    help="time (e), (j), (k), (s) again in rotating blocks, all resident")
    ap.add_argument("--recipe-rounds", type=int, default=3,
                    help="--interleave-recipes: rounds of one block of each")
    ap.add_argument("--out", default="", help="JSON path (default bench/results/...-<date>.json)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny model on the CPU: checks the script, table and JSON")
    args = ap.parse_args()
    if args.dry_run:
        device, shape = torch.device("cpu"), LLAMA_TINY
        args.autocast = False
    else:
        if not torch.cuda.is_available():
            sys.exit("offload_e2e: needs a CUDA GPU (scripts/gpu-check offload); --dry-run runs "
                     "a tiny model on the CPU")
        device, shape = torch.device("cuda", 0), LLAMA_1B
        torch.cuda.set_device(device)
    import emsa

    profile = emsa.measure_profile(measure_bandwidth=not args.dry_run)
    result = provenance("offload-e2e", device)
    result.update(model=shape, params=numel(make_llama(shape, "meta")), hyper=HYPER,
                  warmup=args.warmup, steps=args.steps, autocast_bf16=args.autocast,
                  emsa_host_configs_step_in_backward=args.step_in_backward,
                  ab_knobs=args.ab_knobs,
                  profile=dict(cpu=profile.get("cpu"), gpu={k: v for k, v in
                                                           profile.get("gpu", {}).items()
                                                           if k != "free_memory"}),
                  shapes=[])
    for batch, seq in parse_shapes(args.shapes):
        result["shapes"].append(run_shape(args, shape, batch, seq, device, profile))
    try:
        if args.check_steps > 0:
            result["numerics"] = numerics_check(args, device)
    except Exception:  # noqa: BLE001 - reported, the timings above still stand
        result["numerics_error"] = traceback.format_exc(limit=6)
        print(result["numerics_error"], file=sys.stderr)
    write_result(result, args, table(result))


def write_json(result: dict, out: str, name: str) -> Path:
    """Writes a run's JSON to `out`, else bench/results/<name>-<date>.json; returns the path."""
    path = Path(out) if out else REPO / "bench" / "results" / f"{name}-{result['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def write_result(result: dict, args, text: str) -> None:
    """The run's JSON (--out, else bench/results/<benchmark>-<date>.json; /tmp for a dry run),
    then its table."""
    name = result["benchmark"]
    out = args.out or (f"/tmp/{name}-dry-run.json" if args.dry_run else "")
    path = write_json(result, out, name)
    print(text)
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
