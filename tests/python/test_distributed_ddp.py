"""emsa under torch.distributed, compared with torch.optim.AdamW in the same setup: DDP with
step(), DDP with updates in backward (emsa's communication hook), ZeroRedundancyOptimizer, each
with and without max_grad_norm=1.0 (emsa's, against torch's clip_grad_norm_ on the full model);
the refusals; plan agreement between replicas.

Each test runs its body in every rank of a fresh group (dist_util.run): gloo with 2 CPU ranks;
where there is a GPU, NCCL at world size 1 on cuda:0 and gloo with 2 ranks sharing cuda:0 (the
CUDA engine with two ranks whose batches differ: the averaged gradients, the norm summed over
ZeRO's partitions, on one GPU). Inside a rank the emsa setup and the
torch setup train side by side from the same initial weights and the same per-rank batches, for
STEPS steps in fp32, and the rank compares them (so a rank's failure names its step)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

import dist_util

# The three *_matches_torch tests are numerics (against torch.optim); the refusals are not.
pytestmark = dist_util.needs_distributed

STEPS = 20
LR = 1e-2
MAX_NORM = 1.0
# Tighter than one update (lr 1e-2): float32 rounding of a few ops per step, over 20 steps.
RTOL, ATOL = 1e-6, 1e-7

configs = pytest.mark.parametrize("backend,world,device", dist_util.DEVICE_CONFIGS,
                                  ids=dist_util.device_config_ids)


class Net(torch.nn.Module):
    """An MLP; with extra, a second head that only rank 0 uses, and only on some steps (for
    DDP's find_unused_parameters)."""

    def __init__(self, width: int = 16, extra: bool = False):
        super().__init__()
        self.inner = torch.nn.Linear(8, width)
        self.outer = torch.nn.Linear(width, 4)
        self.extra = torch.nn.Linear(width, 4) if extra else None

    def forward(self, x, use_extra: bool = False):
        h = torch.tanh(self.inner(x))
        y = self.outer(h)
        return y + self.extra(h) if use_extra else y


def _pair(device, width: int = 16, extra: bool = False):
    torch.manual_seed(0)
    a = Net(width, extra).to(device)
    b = Net(width, extra).to(device)
    b.load_state_dict(a.state_dict())
    return a, b


def _batch(ctx, step: int):
    g = torch.Generator().manual_seed(1000 * ctx.rank + step)
    x = torch.randn(16, 8, generator=g)
    y = 2.0 * torch.randn(16, 4, generator=g)  # gradient norms around 1: clipping fires sometimes
    return x.to(ctx.device), y.to(ctx.device)


def _uses_extra(ctx, step: int, unused: bool) -> bool:
    return unused and ctx.rank == 0 and step % 3 == 0


def _loss(model, ctx, step, unused=False):
    x, y = _batch(ctx, step)
    return torch.nn.functional.mse_loss(model(x, _uses_extra(ctx, step, unused)), y)


def _compare(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: "
                     f"{name}: {m}")


def _torch_clip(model, max_norm) -> bool:
    if max_norm is None:
        return False
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return bool(norm > max_norm)


def _check_clipping(rows) -> None:
    """rows: (torch's, emsa's) clipped-step counts with MAX_NORM, and both without clipping."""
    for clipped, unclipped in rows:
        clips, emsa_clips = clipped
        assert 0 < clips < STEPS, f"clipping fired on {clips} of {STEPS} steps: not a test of it"
        assert emsa_clips == clips  # every rank clipped by the global norm on the same steps
        assert unclipped == (0, 0)


def _ddp_pair(ctx, width: int = 16, extra: bool = False, **kw):
    """Two equal models on the rank's device, each with its DDP wrapper: ((a, ea), (b, eb))."""
    a, b = _pair(ctx.device, width, extra)
    return (a, DDP(a, **kw)), (b, DDP(b, **kw))


def _train(ctx, pair, optimizers, max_norm, steps, what: str, unused: bool = False,
           in_backward: bool = False) -> int:
    """emsa (first of each pair) and torch (second, clipped by clip_grad_norm_) over the same
    batches, compared after every step; returns how often torch clipped. in_backward: emsa's
    optimizer updates in backward (no zero_grad; no gradient may be left after backward, and its
    step() does nothing)."""
    (a, ea), (b, eb) = pair
    opt, ref = optimizers
    clips = 0
    for step in steps:
        if not in_backward:
            opt.zero_grad(set_to_none=True)
        _loss(ea, ctx, step, unused).backward()
        if in_backward:
            assert all(p.grad is None for p in a.parameters()), "gradients left after backward"
        ref.zero_grad(set_to_none=True)
        _loss(eb, ctx, step, unused).backward()
        clips += _torch_clip(eb, max_norm)
        opt.step()  # in backward: nothing, the updates were made in backward
        ref.step()
        _compare(a, b, f"{what} max_grad_norm={max_norm} step {step}")
    return clips


# ---- DDP, step() ------------------------------------------------------------------------------
def _ddp_step_body(ctx):
    import emsa

    out = {}
    for max_norm in (None, MAX_NORM):
        pair = _ddp_pair(ctx)
        (_, ea), (_, eb) = pair
        opt = emsa.AdamW(ea.parameters(), lr=LR, max_grad_norm=max_norm)
        ref = torch.optim.AdamW(eb.parameters(), lr=LR)
        clips = _train(ctx, pair, (opt, ref), max_norm, range(STEPS), "DDP step()")
        out[max_norm] = (clips, opt.clip_count)
    return out


@pytest.mark.numerics
@configs
def test_ddp_step_matches_torch(backend, world, device):
    results = dist_util.run(_ddp_step_body, world, backend, device=device)
    _check_clipping((r[MAX_NORM], r[None]) for r in results)


# ---- DDP, updates in backward (the communication hook) ---------------------------------------
def _ddp_in_backward_body(ctx):
    out = {}
    # find_unused_parameters with a head some steps use on one rank only, and DDP's gradients
    # as views of its buckets; then neither.
    for unused, bucket_view in ((False, False), (True, True)):
        for max_norm in (None, MAX_NORM):
            out[unused, max_norm] = _ddp_in_backward_run(ctx, unused, bucket_view, max_norm)
    return out


def _ddp_in_backward_run(ctx, unused: bool, bucket_view: bool, max_norm):
    import emsa

    pair = _ddp_pair(ctx, extra=unused, find_unused_parameters=unused,
                     gradient_as_bucket_view=bucket_view,
                     bucket_cap_mb=0.0005)  # several buckets, so updates run while backward does
    (a, ea), (b, eb) = pair
    opt = emsa.AdamW(ea.parameters(), lr=LR, max_grad_norm=max_norm, step_in_backward=True,
                     ddp=ea)
    ref = torch.optim.AdamW(eb.parameters(), lr=LR)
    clips = _train(ctx, pair, (opt, ref), max_norm, range(STEPS),
                   f"DDP in backward find_unused={unused}", unused=unused, in_backward=True)
    if unused:  # skipped where no rank used it, as torch skips a None gradient
        assert_close(opt.state[a.extra.weight]["step"], ref.state[b.extra.weight]["step"])
    if ctx.backend == "nccl":  # NCCL's futures complete at once: buckets update in backward
        assert opt._ddp_updates.early > 0, ("no bucket was updated before the end of backward: NCCL's "
                                    "future was not complete when the hook looked")
    return clips, opt.clip_count


@pytest.mark.numerics
@configs
def test_ddp_in_backward_matches_torch(backend, world, device):
    results = dist_util.run(_ddp_in_backward_body, world, backend, device=device)
    _check_clipping((r[unused, MAX_NORM], r[unused, None]) for r in results
                    for unused in (False, True))
    print("clipped steps (torch, emsa) per rank:", [r[False, MAX_NORM] for r in results])


# ---- ZeroRedundancyOptimizer ------------------------------------------------------------------
def _zero_body(ctx):
    import emsa
    from torch.distributed.optim import ZeroRedundancyOptimizer as ZeRO

    out = {}
    for max_norm in (None, MAX_NORM):
        pair = _ddp_pair(ctx, width=24)
        (a, ea), (_, eb) = pair
        kw = {} if max_norm is None else {"max_grad_norm": max_norm}
        opt = ZeRO(ea.parameters(), optimizer_class=emsa.AdamW, lr=LR, **kw)
        ref = ZeRO(eb.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        held = sum(p.numel() for g in opt.optim.param_groups for p in g["params"])
        assert held < sum(p.numel() for p in a.parameters()) or ctx.world_size == 1
        assert opt.optim._dist.norm_group is opt.process_group  # the partition's norm is not global
        clips = _train(ctx, pair, (opt, ref), max_norm, range(STEPS), "ZeRO-1")
        out[max_norm] = (clips, opt.optim.clip_count)
        # The whole state on rank 0, then loaded into a fresh ZeRO + emsa on every rank.
        opt.consolidate_state_dict(to=0)
        ref.consolidate_state_dict(to=0)
        objects = [opt.state_dict(), ref.state_dict()] if ctx.rank == 0 else [None, None]
        dist.broadcast_object_list(objects, src=0)
        mine, theirs = objects
        for k, st in theirs["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert_close(mine["state"][k][key], st[key], rtol=1e-5, atol=1e-8)
            assert float(mine["state"][k]["step"]) == float(st["step"]) == STEPS
        c, d = _pair(ctx.device, width=24)
        c.load_state_dict(a.state_dict())
        d.load_state_dict(a.state_dict())
        ec, ed = DDP(c), DDP(d)
        again = ZeRO(ec.parameters(), optimizer_class=emsa.AdamW, lr=LR, **kw)
        again.load_state_dict(mine)
        ref2 = torch.optim.AdamW(ed.parameters(), lr=LR)
        ref2.load_state_dict(theirs)
        _train(ctx, ((c, ec), (d, ed)), (again, ref2), max_norm, range(STEPS, STEPS + 3),
               "ZeRO-1 after load")
    # An inf in a gradient of rank 0's partition only: every rank skips (the non-finite counts
    # are summed), so no rank updates its partition while another does not.
    again.zero_grad(set_to_none=True)
    _loss(ec, ctx, 99).backward()
    owned = next(p for p in c.parameters() if again._param_to_rank[p] == 0)
    owned.grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in c.parameters()]
    with pytest.warns(RuntimeWarning, match="step skipped"):
        again.step()
        assert again.optim.last_step_skipped
    for p, q in zip(c.parameters(), before):
        assert torch.equal(p.detach(), q), "a rank updated while another skipped"
    return out


@pytest.mark.numerics
@configs
def test_zero1_matches_torch(backend, world, device):
    results = dist_util.run(_zero_body, world, backend, device=device)
    _check_clipping((r[MAX_NORM], r[None]) for r in results)


# ---- refusals and plan agreement --------------------------------------------------------------
def _refusal_body(ctx):
    import emsa

    model = Net().to(ctx.device)
    messages = []
    try:
        emsa.AdamW(model.parameters(), step_in_backward=True)
    except RuntimeError as e:
        messages.append(str(e))
    ddp = DDP(model)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        emsa.AdamW(model.parameters(), step_in_backward=True, ddp=model)
    with pytest.raises(ValueError, match="no_sync"):
        emsa.AdamW(ddp.parameters(), step_in_backward=True, ddp=ddp, accumulate=2)
    with pytest.raises(ValueError, match="drop process_group"):
        emsa.AdamW(ddp.parameters(), ddp=ddp, process_group=dist.group.WORLD)
    other = torch.nn.Linear(3, 3).to(ctx.device)
    with pytest.raises(ValueError, match="not among the DDP model"):
        emsa.AdamW(list(ddp.parameters()) + list(other.parameters()), step_in_backward=True,
                   ddp=ddp)
    emsa.AdamW(other.parameters(), step_in_backward=True, ddp=False)  # rank-local: allowed
    return messages, {what: _disagree(ctx, what) for what in ("shape", "layout")}


def _disagree(ctx, what: str) -> str:
    """Replicas (no ddp=False, no partition) whose plans differ: rank 1's parameters are wider,
    or its state is all on the host tier."""
    import emsa

    width = 16 + (ctx.rank if what == "shape" else 0)
    model = Net(width).to(ctx.device)
    tier = ("host" if ctx.rank else "device") if what == "layout" else None
    opt = emsa.AdamW(model.parameters(), lr=LR, tier=tier)
    _loss(model, ctx, 0).backward()
    try:
        opt.step()  # plans now: the replicas compare their plans
    except RuntimeError as e:
        return str(e)
    return ""


@configs
def test_refusals_and_plan_agreement(backend, world, device):
    for messages, disagree in dist_util.run(_refusal_body, world, backend, device=device):
        if world > 1:
            assert len(messages) == 1 and "ddp=ddp_model" in messages[0], messages
            assert "plans disagree" in disagree["shape"], disagree
            assert "same parameters" in disagree["shape"], disagree
            assert "another state layout" in disagree["layout"], disagree
        else:  # one rank: nothing reduces its gradients and no replica differs from it
            assert messages == [] and disagree == {"shape": "", "layout": ""}


def test_in_backward_refused_at_first_backward_when_the_group_came_later(monkeypatch):
    """The optimizer was built before init_process_group: its first backward refuses, before
    any parameter changes. (One process: the group of 2 is simulated.)"""
    import emsa
    from emsa._distributed import groups as _distributed

    torch.manual_seed(0)
    model = Net()
    opt = emsa.AdamW(model.parameters(), lr=LR, step_in_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    monkeypatch.setattr(_distributed, "initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="ddp=ddp_model"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach(), q)
    assert opt._passes.hooks == []  # removed: later backwards update nothing
