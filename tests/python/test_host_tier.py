"""The host tier on CUDA parameters against torch.optim.AdamW (issue 5, part 6).

The models are built to provoke races: a few 4096x4096 Linear layers and a batch of 2, so the
compute is tiny and the copies are large. A copy nobody waited for (a gradient copied before
backward wrote it, or freed while the copy still reads it; a parameter read by the next forward
before its update came back; a staging buffer reused too early) leaves a parameter that differs
from what the same steps give with all state on the device (emsa's device and host kernels are
bitwise equal); each model runs its own forward and backward, because the race that matters
most is emsa's own next forward reading its parameters. Against torch.optim.AdamW the
optimizer is compared on shared gradients (see test_matches_torch_every_step).

Parameters are read outside a module's forward only after opt.synchronize(), as the CUDA
engine's docstring asks for host-tier parameters.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import emsa
from conftest import requires_cuda
from models import warmup_cosine
from test_cuda import assert_params_close, saved

pytestmark = requires_cuda
DEVICE = "cuda"
STEPS = 20
WIDTH = 4096
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
TIERS = ["host", "split"]
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def race_model(layers=4, dtype=torch.float32):
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(WIDTH, WIDTH))
        if i < layers - 1:
            mods.append(nn.Tanh())
    return nn.Sequential(*mods).to(DEVICE, dtype)


def batches(steps):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    return [(torch.randn(2, WIDTH, device=DEVICE, generator=g),
             torch.randn(2, WIDTH, device=DEVICE, generator=g)) for _ in range(steps)]


def loss_of(model, batch):
    x, y = batch
    dtype = next(model.parameters()).dtype
    return F.mse_loss(model(x.to(dtype)).float(), y)


@pytest.fixture(scope="module")
def profile():
    """Measured once: every probe and plan here plans against the same machine."""
    return emsa.measure_profile()


def split_budget(model, batch, profile, in_backward, args=None, loss_fn=None):
    """A probe of the model and the budget halfway between its all-device and all-host plans'
    device peaks: some state must go to the host, not all. args, loss_fn: the probe's inputs
    and loss (default: batch's input in the model's dtype, and the mean squared error)."""
    if args is None:
        args = (batch[0].to(next(model.parameters()).dtype),)
    if loss_fn is None:
        def loss_fn(out):
            return F.mse_loss(out.float(), batch[1])
    record = emsa.probe(model, *args, loss_fn=loss_fn, profile=profile)
    kw = dict(release_grads=in_backward)
    device_peak = emsa.make_plan(record, allow_host_tier=False, **kw).json["prediction"][
        "peak_device_bytes"]
    host_peak = emsa.make_plan(record, force_all_host=True, **kw).json["prediction"][
        "peak_device_bytes"]
    assert host_peak < device_peak, "the all-host plan should need less device memory"
    return record, (device_peak + host_peak) // 2


def host_optimizer(model, tier, profile, batch, step_in_backward=False, **extra):
    """emsa.AdamW with all state on the host (tier="host", unprobed: it plans at the first
    step, or at construction with step_in_backward) or split by a budget (probed)."""
    if tier == "host":
        return emsa.AdamW(model.parameters(), **HYPER, tier="host",
                          step_in_backward=step_in_backward, **extra)
    record, budget = split_budget(model, batch, profile, step_in_backward)
    return emsa.AdamW(model.parameters(), **HYPER, probe=record, budget=budget,
                      step_in_backward=step_in_backward, **extra)


def assert_tiers(opt, tier):
    """The plan put the state where the test asked (call after the first step)."""
    want = {"L2"} if tier == "host" else {"L1", "L2"}
    assert opt.plan is not None, "the optimizer has not planned after its first step"
    tiers = {p["tier"] for p in opt.plan.json["params"] if p["trainable"]}
    assert tiers == want, f"tier={tier}: the plan put state on {sorted(tiers)}"


def train_step(model, opt, batch, set_to_none=True):
    loss = loss_of(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return loss


def shared_step(model, opts, others, batch):
    """A step of `model` and of each (other model, its optimizer) on model's gradients: the
    optimizers compared, not a second forward and backward (see
    test_matches_torch_every_step)."""
    loss_of(model, batch).backward()
    for other, other_opt in others:
        for p, q in zip(model.parameters(), other.parameters()):
            q.grad = p.grad.clone()
        other_opt.step()
        other_opt.zero_grad()
    for o in opts:
        o.step()
        o.zero_grad()


# ---- numerics under race-provoking timing ------------------------------------------------------

VARIANTS = ["step", "step_in_backward", "scheduler", "zero_grad_keep", "free_running",
            "clipped", "clipped_in_backward"]
MAX_NORM = 0.5
# Gated steps: the updates wait for the verdict of every gradient (clipping, the non-finite
# check); in backward the host tier's copies then go down whole and its CPU waits for the release.
GATED = dict(max_grad_norm=MAX_NORM, skip_nonfinite=True)


def twin_optimizer(model, step_in_backward, **extra):
    """The same optimizer with every state on the device: emsa's CUDA and CPU kernels give the
    same bits, so the host tier must match it bitwise whenever nothing raced."""
    return emsa.AdamW(model.parameters(), **HYPER, tier="device",
                      step_in_backward=step_in_backward, **extra)


def assert_params_equal(ours, twin, what):
    for (name, p), q in zip(ours.named_parameters(), twin.parameters()):
        if not torch.equal(p, q):
            d = (p - q).abs().max().item()
            raise AssertionError(f"{what}{name} differs from the device-tier twin (max |diff| "
                                 f"{d:.3g}): an update or a wait was missed")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tier", TIERS)
def test_matches_torch_every_step(tier, variant, profile):
    """Every step, two checks. (1) Bitwise against a twin model trained by emsa with all state on
    the device, each running its own forward and backward: a forward that read a parameter
    before its upload, a gradient copied before backward wrote it or freed while copied, a
    staging buffer reused early, all change bits. (2) Against torch.optim.AdamW fed the same
    gradients (ours, copied before the step), at rtol 1e-5: the optimizer's numerics. Separate
    forward/backward runs cannot be compared with torch at that tolerance: in a deep network a
    one-ulp difference in the weights already moves some gradient elements (sums that nearly
    cancel) by percent after one step, for torch against itself with another kernel as well.
    step: compared after every step; step_in_backward: buckets updated from the gradient hooks
    (torch gets no gradients there: check (1) only); scheduler: lr changes every step;
    zero_grad_keep: zero_grad(set_to_none=False), the gradients stay at one address;
    free_running: all steps back to back, nothing waits in between, compared at the end;
    clipped, clipped_in_backward: gated steps (max_grad_norm and the non-finite check), in
    step() and in backward: the host tier's updates wait for the release of the device's
    verdict, whose clip coefficient (computed from bitwise equal gradients) the twin shares."""
    in_backward = variant in ("step_in_backward", "clipped_in_backward")
    set_to_none = variant != "zero_grad_keep"
    extra = GATED if variant.startswith("clipped") else {}
    ref = race_model()
    ours = copy.deepcopy(ref)
    twin = copy.deepcopy(ref)
    data = batches(STEPS)
    opt = host_optimizer(ours, tier, profile, data[0], step_in_backward=in_backward, **extra)
    twin_opt = twin_optimizer(twin, in_backward, **extra)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    scheds = ([torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine(5, STEPS))
               for o in (opt, twin_opt, ref_opt)] if variant == "scheduler" else [])
    if variant == "free_running":
        ours_losses = [train_step(ours, opt, b) for b in data]
        twin_losses = [train_step(twin, twin_opt, b) for b in data]
        assert_tiers(opt, tier)
        opt.synchronize()
        assert_params_equal(ours, twin, f"after {STEPS} steps run back to back: ")
        assert torch.equal(torch.stack(ours_losses), torch.stack(twin_losses)), \
            "the losses (each read by a forward of the model as it then was) differ"
        return
    for k, batch in enumerate(data):
        loss = loss_of(ours, batch)
        loss.backward()
        if in_backward:  # released during backward, once copied to the host
            held = [n for n, p in ours.named_parameters() if p.grad is not None]
            assert not held, f"step {k + 1}: gradients still held after backward: {held}"
        else:
            for p, q in zip(ours.parameters(), ref.parameters()):
                q.grad = p.grad.clone()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if k == 0:
            assert_tiers(opt, tier)
        twin_loss = train_step(twin, twin_opt, batch, set_to_none)
        assert torch.equal(loss, twin_loss), f"step {k + 1}: loss {loss} != twin's {twin_loss}"
        if not in_backward:
            if extra:
                torch.nn.utils.clip_grad_norm_(list(ref.parameters()), MAX_NORM)
            ref_opt.step()
            ref_opt.zero_grad()
        for s in scheds:
            s.step()
        opt.synchronize()
        assert_params_equal(ours, twin, f"step {k + 1}: ")
        if not in_backward:
            assert_params_close(ours, ref, what=f"step {k + 1} against torch: ")
    if scheds:
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    steps = {st["step"].item() for st in opt.state_dict()["state"].values()}
    assert steps == {STEPS}, f"step counts: {steps}"


@pytest.mark.filterwarnings("ignore:Using `torch.compile.module.` when there are global hooks")
@pytest.mark.parametrize("compiled", ["wrapper", "in_place"])
def test_compiled_model_reads_its_uploaded_parameters(compiled, profile):
    """The model under torch.compile: torch.compile(model) (its wrapper's hooks run eagerly) or
    model.compile() (the tracer runs the host tier's forward hook). Its forward must read each
    parameter only after its upload. The host tier runs in backward, steps back to back, and
    must be bitwise equal to the device-tier twin compiled alike. Where the tracer runs the
    hook (torch versions differ: some run global module hooks eagerly, at a graph break), the
    slower wait is reported, once."""
    ref = race_model()
    ours, twin = copy.deepcopy(ref), copy.deepcopy(ref)

    def compile_(model):
        if compiled == "wrapper":
            return torch.compile(model, backend="aot_eager")
        model.compile(backend="aot_eager")
        return model

    opt = emsa.AdamW(ours.parameters(), **HYPER, tier="host", step_in_backward=True)
    twin_opt = twin_optimizer(twin, True)
    run_ours, run_twin = compile_(ours), compile_(twin)
    data = batches(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours_losses = [train_step(run_ours, opt, b) for b in data]
    said = [w for w in caught if "emsa: the model's forward runs under torch.compile"
            in str(w.message)]
    assert len(said) == int(opt._bound.engine.host._compiled_warned) <= 1, \
        f"the compiled forward's slower wait is reported once, when taken: {said}"
    twin_losses = [train_step(run_twin, twin_opt, b) for b in data]
    opt.synchronize()
    assert_tiers(opt, "host")
    assert_params_equal(ours, twin, f"compiled ({compiled}), {len(data)} steps back to back: ")
    assert torch.equal(torch.stack(ours_losses), torch.stack(twin_losses)), \
        "the losses (each read by a compiled forward of the model as it then was) differ"


@pytest.mark.parametrize("tier", TIERS)
def test_bf16_parameters_with_an_fp32_master(tier, profile):
    """bf16 parameters on the GPU, their fp32 master (and state) on the host for the host-tier
    ones: the master follows torch.optim.AdamW on fp32 weights fed the same gradients, and the
    parameter is the master rounded to nearest."""
    master = race_model().to(torch.bfloat16).float()  # starts where the bf16 weights do
    model = copy.deepcopy(master).to(torch.bfloat16)
    data = batches(STEPS)
    opt = host_optimizer(model, tier, profile, data[0])
    ref_opt = torch.optim.AdamW(master.parameters(), **HYPER)
    for k, batch in enumerate(data):
        loss_of(model, batch).backward()
        for p, q in zip(model.parameters(), master.parameters()):
            q.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        if k == 0:
            assert_tiers(opt, tier)
        opt.synchronize()
        for (name, p), q in zip(model.named_parameters(), master.parameters()):
            assert p.dtype == torch.bfloat16
            mine = opt.state[p]["master"]
            assert_close(mine.cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-7,
                         msg=lambda m, n=name, k=k: f"step {k + 1}: {n}.master: {m}")
            assert torch.equal(p.cpu(), mine.cpu().to(torch.bfloat16)), \
                f"step {k + 1}: {name} is not its master rounded to nearest"


# ---- state_dict --------------------------------------------------------------------------------

# shared_step runs no forward of the emsa model, so no module hook waits for its uploads and the
# next step says so (the warning test below covers that); the parameters are read here only
# after opt.synchronize().
@pytest.mark.filterwarnings("ignore:emsa. the host-tier parameters:RuntimeWarning")
@pytest.mark.parametrize("tier", TIERS)
def test_state_dict_equals_torch_and_round_trips(tier, profile):
    """After 5 steps the host-tier optimizer's state_dict equals torch's (fp32 parameters keep
    their master internal: torch's keys only); each checkpoint then continues 5 more steps in
    the other optimizer exactly as the original would have."""
    ref = race_model()
    ours = copy.deepcopy(ref)
    data = batches(10)
    opt = host_optimizer(ours, tier, profile, data[0])
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    for batch in data[:5]:
        shared_step(ours, [opt], [(ref, ref_opt)], batch)
    assert_tiers(opt, tier)
    sd, ref_sd = saved(opt.state_dict()), saved(ref_opt.state_dict())
    names = [n for n, _ in ref.named_parameters()]
    for i, st in ref_sd["state"].items():
        mine = sd["state"][i]
        assert set(mine) == {"step", *STATE_KEYS}, f"{names[i]}: keys {sorted(mine)}"
        assert mine["step"].item() == st["step"].item() == 5, names[i]
        for key in STATE_KEYS:
            want = st[key].cpu()
            assert_close(mine[key].cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                         msg=lambda m, n=names[i], k=key: f"{n}.{k}: {m}")

    opt.synchronize()
    to_torch = copy.deepcopy(ours)  # emsa's checkpoint, continued by torch
    torch_opt = torch.optim.AdamW(to_torch.parameters(), **HYPER)
    torch_opt.load_state_dict(sd)
    to_emsa = copy.deepcopy(ref)  # torch's checkpoint, continued by emsa on the host tier
    emsa_opt = host_optimizer(to_emsa, tier, profile, data[5])
    emsa_opt.load_state_dict(ref_sd)  # an unprobed one plans here, before the first step
    assert_tiers(emsa_opt, tier)
    for batch in data[5:]:
        shared_step(ref, [ref_opt], [(to_torch, torch_opt), (to_emsa, emsa_opt)], batch)
    emsa_opt.synchronize()
    assert_params_close(to_torch, ref, what="emsa's checkpoint continued by torch: ")
    assert_params_close(to_emsa, ref, what="torch's checkpoint continued by emsa: ")
    steps = {st["step"].item() for st in emsa_opt.state_dict()["state"].values()}
    assert steps == {10}, f"step counts after loading 5 and taking 5: {steps}"


class _FunctionalUse(nn.Module):
    """b's parameters are read by F.linear in the parent's forward: b's own forward never runs,
    so no module pre-hook waits for their upload."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return F.linear(torch.tanh(self.a(x)), self.b.weight, self.b.bias)


def test_reads_outside_a_module_forward_warn_once_unless_synchronized():
    torch.manual_seed(0)
    model = _FunctionalUse().to(DEVICE)
    data = batches(4)
    opt = emsa.AdamW(model.named_parameters(), **HYPER, tier="host")  # named: the warning says
    with pytest.warns(RuntimeWarning, match=r"b\.(weight|bias).*opt\.synchronize\(\)"):
        for batch in data[:3]:
            train_step(model, opt, batch)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once is enough; and synchronize() before reads is quiet
        train_step(model, opt, data[3])
        opt.synchronize()
        train_step(model, opt, data[0])
