"""torch.amp.GradScaler with emsa (CPU engine): step() mode through GradScaler.step's
optimizer protocol (_step_supports_amp_scaling: emsa unscales inside its update), and
step_in_backward with grad_scaler= (emsa divides by the scale in backward and reports skipped
passes to scaler.update()). Infs are injected into the loss: fp16 is not needed for the
protocol. Held to torch's own flow: scaler.scale(loss).backward(); scaler.unscale_(opt);
clip_grad_norm_; scaler.step(opt); scaler.update()."""

import warnings

import pytest
import torch
from torch.testing import assert_close

import emsa
from conftest import CPU_PROFILE

STEPS = 9
BAD = {2, 6}  # steps whose loss is made inf
MAX_NORM = 1.0


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g) * (0.5 + k / 4))
            for k in range(STEPS)]


def scaler():
    # growth_interval 2 so the scale both grows and backs off within the run.
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def loss_of(model, x, y, k):
    loss = ((model(x) - y) ** 2).mean()
    return loss * float("inf") if k in BAD else loss


def snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()])


def assert_unchanged(before, model, opt):
    params, states = before
    for p, b, st in zip(model.parameters(), params, states):
        assert torch.equal(p, b), "a skipped step changed a parameter"
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v), f"a skipped step changed state {k}"


def torch_run(clip):
    model, s = mlp(), scaler()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scales = []
    for k, (x, y) in enumerate(batches()):
        s.scale(loss_of(model, x, y, k)).backward()
        if clip:
            s.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        s.step(opt)
        s.update()
        opt.zero_grad()
        scales.append(s.get_scale())
    return model, opt, scales


def emsa_run(clip, in_backward):
    model, s = mlp(), scaler()
    kw = dict(step_in_backward=True, grad_scaler=s) if in_backward else {}
    opt = emsa.AdamW(model.parameters(), lr=1e-2, profile=str(CPU_PROFILE),
                     max_grad_norm=MAX_NORM if clip else None, **kw)
    scales, skipped = [], []
    for k, (x, y) in enumerate(batches()):
        before = snapshot(model, opt) if k in BAD and k > 0 else None
        s.scale(loss_of(model, x, y, k)).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
        scales.append(s.get_scale())
        skipped.append(opt.last_step_skipped)
        if before is not None:
            assert_unchanged(before, model, opt)
    return model, opt, scales, skipped


@pytest.mark.numerics
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("in_backward", [False, True])
def test_grad_scaler_matches_torch(clip, in_backward):
    ref, ref_opt, ref_scales = torch_run(clip)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a scaler's skips are routine: no warning
        model, opt, scales, skipped = emsa_run(clip, in_backward)
    assert scales == ref_scales  # backoff on the bad steps, growth after two good ones
    steps = list(zip(scales, scales[1:]))
    assert any(b > a for a, b in steps) and any(b < a for a, b in steps)
    assert skipped == [k in BAD for k in range(STEPS)]
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
        assert int(opt.state[b]["step"]) == int(ref_opt.state[a]["step"]) == STEPS - len(BAD)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(opt.state[b][key], ref_opt.state[a][key], rtol=1e-5, atol=1e-7)


def test_in_backward_without_grad_scaler_raises():
    model, s = mlp(), scaler()
    opt = emsa.AdamW(model.parameters(), step_in_backward=True, profile=str(CPU_PROFILE))
    x, y = batches()[0]
    s.scale(loss_of(model, x, y, 0)).backward()
    with pytest.raises(RuntimeError, match="grad_scaler="):
        s.step(opt)


def test_grad_scaler_keyword_only_in_backward():
    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="step_in_backward"):
        emsa.AdamW([w], grad_scaler=scaler())


def test_unscale_after_backward_warns_once():
    """step_in_backward: scaler.unscale_ (to clip by hand) finds no gradients; emsa says so."""
    model, s = mlp(), scaler()
    opt = emsa.AdamW(model.parameters(), step_in_backward=True, grad_scaler=s,
                     profile=str(CPU_PROFILE))
    for k, (x, y) in enumerate(batches()[:3]):
        s.scale(loss_of(model, x, y, 0)).backward()
        s.unscale_(opt)
        if k == 0:
            with pytest.warns(RuntimeWarning, match="max_grad_norm"):
                s.step(opt)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                s.step(opt)
        s.update()


def test_disabled_scaler_is_plain():
    model, s = mlp(), torch.amp.GradScaler("cpu", enabled=False)
    opt = emsa.AdamW(model.parameters(), step_in_backward=True, grad_scaler=s,
                     profile=str(CPU_PROFILE))
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters())
    for k, (x, y) in enumerate(batches()[:3]):
        s.scale(loss_of(model, x, y, 0)).backward()
        s.step(opt)
        s.update()
        loss_of(ref, x, y, 0).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("in_backward", [False, True])
def test_own_nonfinite_skip_leaves_everything_unchanged(in_backward):
    """skip_nonfinite=True without a scaler, in both modes: the bad step warns and changes
    nothing, bit for bit."""
    model = mlp()
    opt = emsa.AdamW(model.parameters(), lr=1e-2, skip_nonfinite=True,
                     step_in_backward=in_backward, profile=str(CPU_PROFILE))
    data = batches()
    for k in range(3):
        x, y = data[k]
        before = snapshot(model, opt)
        loss = loss_of(model, x, y, 2 if k == 1 else 0)
        if k == 1:
            with pytest.warns(RuntimeWarning, match="step skipped"):
                loss.backward()
                opt.step()
            assert_unchanged(before, model, opt)
            assert opt.last_step_skipped
        else:
            loss.backward()
            opt.step()
            assert not opt.last_step_skipped
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())
