"""Training recipes on CUDA in every mode (issue 19), against torch.optim.AdamW (+
torch.nn.utils.clip_grad_norm_, GradScaler) fed the same gradients.

Modes: step() with all state on the device; step_in_backward on the device; tier="host" in
step() and in backward; a half budget (some state on the device, some on the host) in step()
and in backward. The model is a fine-tune's shape: a frozen embedding, a trunk, a branch that
some steps do not use (its parameters then get no gradient) and a head.

Same gradients: a "tap" (post-accumulate-grad hooks registered on the emsa model before the
optimizer's own, so they run first) copies each gradient, once final, into the reference
models, and may poison it first (an injected inf): emsa in backward consumes its gradients, so
they cannot be copied afterwards. The reference optimizers then step on exactly what emsa
updated from, and the parameters are compared after every step where it matters. Tolerances
are far below one update (lr 1e-3): rtol 1e-6, atol 1e-7.
"""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import emsa
from conftest import requires_cuda
from test_cuda import saved
from test_host_tier import split_budget

pytestmark = requires_cuda
DEVICE = "cuda"
WIDTH = 2048  # 16 MiB per trunk layer: several plan buckets, so a budget can split them
VOCAB = 64
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
MODES = ["step", "in_backward", "host_step", "host_in_backward", "split_step",
         "split_in_backward"]
TOL = dict(rtol=1e-6, atol=1e-7)


class Recipe(nn.Module):
    """A frozen embedding, a trunk, a branch used only when asked, a head."""

    def __init__(self, d=WIDTH):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.embed.weight.requires_grad_(False)
        self.trunk = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(d, d), nn.Tanh())])
        self.branch = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx, use_branch=True):
        x = self.trunk(self.embed(idx))
        if use_branch:
            x = x + torch.tanh(self.branch(x))
        return self.head(x)


def batches(steps):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    return [(torch.randint(0, VOCAB, (4, 8), device=DEVICE, generator=g),
             torch.randint(0, VOCAB, (4, 8), device=DEVICE, generator=g)) for _ in range(steps)]


def loss_of(model, batch, use_branch=True):
    idx, targets = batch
    return F.cross_entropy(model(idx, use_branch).float().flatten(0, 1), targets.flatten())


class Tap:
    """Copies each gradient of `model`, once final, into the same parameter of every follower
    (registered before the optimizer, so its hooks run first); poison = a parameter index whose
    gradient gets an inf first."""

    def __init__(self, model):
        self.followers: list[nn.Module] = []
        self.poison: int | None = None
        self.handles = []
        for k, p in enumerate(model.parameters()):
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, k=k: self._final(k, p)))

    def _final(self, k, p):
        if self.poison == k:
            p.grad.view(-1)[0] = float("inf")
        for f in self.followers:
            list(f.parameters())[k].grad = p.grad.detach().clone()

    def clear_followers(self):
        for f in self.followers:
            for q in f.parameters():
                q.grad = None


@pytest.fixture(scope="module")
def profile():
    """Measured once: every probe and plan here plans against the same machine."""
    return emsa.measure_profile()


def make_opt(mode, model, profile, **kw):
    in_backward = mode.endswith("in_backward")
    if mode.startswith("host"):
        kw["tier"] = "host"
    elif mode.startswith("split"):
        batch = batches(1)[0]
        kw["probe"], kw["budget"] = split_budget(
            model, batch, profile, in_backward, args=(batch[0],),
            loss_fn=lambda out: F.cross_entropy(out.float().flatten(0, 1), batch[1].flatten()))
    else:
        kw["tier"] = "device"
    return emsa.AdamW(model.parameters(), **HYPER, step_in_backward=in_backward, **kw)


def assert_tiers(opt, mode):
    want = {"step": {"L1"}, "in": {"L1"}, "host": {"L2"}, "split": {"L1", "L2"}}[
        mode.split("_")[0]]
    tiers = {p["tier"] for p in opt.plan.json["params"] if p["trainable"]}
    assert tiers == want, f"{mode}: the plan put state on {sorted(tiers)}"


def setup(mode, profile, followers=1, **kw):
    torch.manual_seed(0)
    ours = Recipe().to(DEVICE)
    refs = [copy.deepcopy(ours) for _ in range(followers)]
    tap = Tap(ours)
    tap.followers.extend(refs)
    opt = make_opt(mode, ours, profile, **kw)
    return ours, refs, tap, opt


def emsa_step(ours, opt, tap, batch, use_branch=True, poison=None, scaler=None):
    """One training step of the emsa model; the tap hands its gradients to the followers."""
    tap.clear_followers()
    tap.poison = poison
    opt.zero_grad()
    if scaler is None:
        loss_of(ours, batch, use_branch).backward()
        opt.step()
    else:
        with torch.autocast(DEVICE, dtype=torch.float16):
            loss = loss_of(ours, batch, use_branch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    tap.poison = None


def assert_params_close(ours, ref, opt, what):
    opt.synchronize()  # host-tier parameters are read outside a module's forward
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert_close(p, q, **TOL, msg=lambda m, n=name: f"{what}{n}: {m}")


def param_index(model, name):
    """The parameter's index in the optimizer's (one) param group, as state_dict numbers it."""
    return [n for n, _ in model.named_parameters()].index(name)


def drive(model, opt, grads):
    """A step of `model` whose backward gives exactly `grads` (None: no gradient), so that an
    optimizer updating in backward can be fed given gradients: d/dp sum(p * g) = g, bitwise."""
    opt.zero_grad()
    pairs = [(p, g) for p, g in zip(model.parameters(), grads) if g is not None]
    sum((p * g).sum() for p, g in pairs).backward()
    opt.step()


# ---- clipping ------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_norm", [0.05, 1e4], ids=["firing", "never"])
@pytest.mark.parametrize("mode", MODES)
def test_max_grad_norm_is_clip_grad_norm(mode, max_norm, profile):
    """The global norm of this step's gradients, as clip_grad_norm_ computes it, applied
    inside the update; the norm and how often clipping fired are reported."""
    ours, (ref,), tap, opt = setup(mode, profile, max_grad_norm=max_norm)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    fired, norm = 0, None
    for k, batch in enumerate(batches(8)):
        emsa_step(ours, opt, tap, batch)
        norm = float(torch.nn.utils.clip_grad_norm_(
            [q for q in ref.parameters() if q.grad is not None], max_norm))
        fired += max_norm / (norm + 1e-6) < 1.0
        ref_opt.step()
        if k == 0:
            assert_tiers(opt, mode)
        assert_params_close(ours, ref, opt, f"step {k + 1}: ")
    assert fired == (8 if max_norm < 1 else 0), f"the test's premise: clipping fired {fired}x"
    assert opt.clip_count == fired
    assert math.isclose(opt.last_grad_norm, norm, rel_tol=1e-5), (opt.last_grad_norm, norm)


# ---- the non-finite skip -------------------------------------------------------------------------

def snapshot(model, opt):
    opt.synchronize()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items()}
             for n, p in model.named_parameters() if p in opt.state}
    steps = {k: st["step"].item() for k, st in opt.state_dict()["state"].items()}
    return params, state, steps


def assert_bitwise_unchanged(model, opt, before, what):
    params, state, steps = before
    opt.synchronize()
    # First: state_dict() makes the "step" counts in opt.state exact (a skip found late).
    now = {k: st["step"].item() for k, st in opt.state_dict()["state"].items()}
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), f"{what}: {n} changed"
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            assert torch.equal(v, state[n][k]), f"{what}: {n}.{k} changed"
    assert now == steps, f"{what}: step counts {now}, before {steps}"


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_step_changes_nothing(mode, profile):
    ours, (ref,), tap, opt = setup(mode, profile, skip_nonfinite=True, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    target = param_index(ours, "trunk.2.weight")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, batch in enumerate(batches(6)):
            before = snapshot(ours, opt) if k == 3 else None
            emsa_step(ours, opt, tap, batch, poison=target if k == 3 else None)
            if k == 3:
                assert opt.last_step_skipped, "a step with an inf gradient was not skipped"
                assert_bitwise_unchanged(ours, opt, before, "the skipped step")
                continue
            torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
            ref_opt.step()
            assert not opt.last_step_skipped
        assert_params_close(ours, ref, opt, "after 6 steps, one skipped: ")
        steps = {st["step"].item() for st in opt.state_dict()["state"].values()}
    assert steps == {5.0}, steps
    found = [str(w.message) for w in caught if "step skipped" in str(w.message)]
    assert len(found) == 1, found


# ---- frozen and absent gradients, per-parameter steps, state_dict both ways ---------------------

def branch_step(k):
    return k % 2 == 0


@pytest.mark.parametrize("skip_nonfinite", [False, True], ids=["ungated", "gated"])
@pytest.mark.parametrize("mode", MODES)
def test_frozen_and_absent_parameters_as_torch(mode, skip_nonfinite, profile):
    """A frozen embedding (no state, no state_dict entry) and a branch used on even steps only
    (its parameters skipped on odd steps: no update, their own step count stays): parameters
    equal torch's within 1e-6 relative after every step, step counts per parameter equal
    torch's; the checkpoint then moves into torch.optim and torch's into emsa, each continuing
    as the original."""
    ours, (ref,), tap, opt = setup(mode, profile, skip_nonfinite=skip_nonfinite)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    data = batches(14)
    frozen = [n for n, _ in ours.named_parameters()].index("embed.weight")
    embed = ours.embed.weight.detach().clone()
    for k, batch in enumerate(data[:10]):
        emsa_step(ours, opt, tap, batch, use_branch=branch_step(k))
        assert (ref.branch.weight.grad is None) != branch_step(k)
        ref_opt.step()
        assert_params_close(ours, ref, opt, f"step {k + 1}: ")
    assert torch.equal(ours.embed.weight, embed), "the frozen embedding changed"
    assert ours.embed.weight not in opt.state, "a frozen parameter has state"
    sd, ref_sd = saved(opt.state_dict()), saved(ref_opt.state_dict())
    assert frozen not in sd["state"], "a frozen parameter is in the state_dict"
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, st in ref_sd["state"].items():
        assert sd["state"][i]["step"].item() == st["step"].item(), f"param {i}: step"
        for key in ("exp_avg", "exp_avg_sq"):
            want = st[key].cpu()  # host-tier state is on the host
            assert_close(sd["state"][i][key].cpu(), want, rtol=1e-5,
                         atol=1e-5 * want.abs().max().item(),
                         msg=lambda m, i=i, k=key: f"param {i}.{k}: {m}")
    assert sd["state"][param_index(ours, "branch.weight")]["step"].item() == 5
    assert sd["state"][param_index(ours, "head.weight")]["step"].item() == 10

    # emsa's checkpoint continued by torch, torch's by emsa (same mode), the original emsa on:
    # all fed the original's gradients.
    opt.synchronize()
    to_torch = copy.deepcopy(ours)
    torch_opt = torch.optim.AdamW(to_torch.parameters(), **HYPER)
    torch_opt.load_state_dict(sd)
    to_emsa = copy.deepcopy(ref)
    emsa_opt = make_opt(mode, to_emsa, profile, skip_nonfinite=skip_nonfinite)
    emsa_opt.load_state_dict(ref_sd)
    tap.followers[:] = [ref, to_torch]
    for k, batch in enumerate(data[10:], start=10):
        emsa_step(ours, opt, tap, batch, use_branch=branch_step(k))
        drive(to_emsa, emsa_opt, [None if q.grad is None else q.grad.clone()
                                  for q in ref.parameters()])
        ref_opt.step()
        torch_opt.step()
    assert_params_close(ours, ref, opt, "the original after 14 steps: ")
    assert_params_close(to_torch, ref, opt, "emsa's checkpoint continued by torch: ")
    assert_params_close(to_emsa, ref, emsa_opt, "torch's checkpoint continued by emsa: ")
    steps = {k: st["step"].item() for k, st in emsa_opt.state_dict()["state"].items()}
    assert steps == {k: st["step"].item() for k, st in ref_opt.state_dict()["state"].items()}


# ---- GradScaler ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_grad_scaler_fp16_with_an_injected_inf(mode, profile):
    """fp16 autocast under a GradScaler: emsa unscales inside the update and skips the steps
    whose gradients overflow (an inf injected at step 4), and the scaler backs off as torch's
    does. With step_in_backward the scaler is passed as grad_scaler=."""
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**14, growth_interval=3)
    ref_scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**14, growth_interval=3)
    kw = {"grad_scaler": scaler} if mode.endswith("in_backward") else {}
    ours, (ref,), tap, opt = setup(mode, profile, **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    target = param_index(ours, "head.weight")
    skipped_at = None
    for k, batch in enumerate(batches(8)):
        before = snapshot(ours, opt) if k == 4 else None
        emsa_step(ours, opt, tap, batch, poison=target if k == 4 else None, scaler=scaler)
        ref_scaler.scale(torch.zeros((), device=DEVICE))  # its scale, lazily made, is used
        scale = ref_scaler.get_scale()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        if ref_scaler.get_scale() < scale:
            skipped_at = k if skipped_at is None else skipped_at
        assert scaler.get_scale() == ref_scaler.get_scale(), f"step {k + 1}: scales differ"
        if k == 4:
            assert_bitwise_unchanged(ours, opt, before, "the step with an inf")
        assert_params_close(ours, ref, opt, f"step {k + 1}: ")
    assert skipped_at is not None, "the injected inf did not make the scaler back off"


# ---- statistics from backward must be the step's ------------------------------------------------

@pytest.mark.parametrize("mode", ["step", "host_step", "split_step"])
def test_gradients_changed_after_backward_are_what_step_uses(mode, profile):
    """step() mode gathers the norm and the non-finite count during backward; gradients changed
    after it (scaled in place, replaced, poisoned) must be seen: the result is torch's on the
    changed gradients."""
    ours, (ref,), tap, opt = setup(mode, profile, max_grad_norm=0.5)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    head = ours.head.weight
    for k, batch in enumerate(batches(6)):
        tap.clear_followers()
        opt.zero_grad()
        loss_of(ours, batch).backward()
        if k == 1:  # in place: its _version moves
            head.grad.mul_(3.0)
        elif k == 2:  # a new tensor: its address moves
            head.grad = head.grad * 0.25
        elif k == 3:
            head.grad[0, 0] = float("nan")
        ref.head.weight.grad = head.grad.clone()
        opt.step()
        if k == 3:
            assert opt.last_step_skipped, "a nan written after backward was not seen"
            continue
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
        ref_opt.step()
        assert not opt.last_step_skipped
        assert_params_close(ours, ref, opt, f"step {k + 1}: ")
