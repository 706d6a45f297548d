"""step_in_backward=True: updates made from gradient hooks equal the same optimizer's step()."""

import pytest
import torch
from torch.testing import assert_close

import emsa
from conftest import CPU_PROFILE, requires_cuda
from models import LionReference, TinyGPT, gpt_batches, gpt_loss, warmup_cosine

STEPS = 12
OPTS = {
    "adamw": lambda ps, **kw: emsa.AdamW(ps, lr=3e-3, weight_decay=0.1, **kw),
    "adam": lambda ps, **kw: emsa.Adam(ps, lr=3e-3, weight_decay=0.01, **kw),
    "lion": lambda ps, **kw: emsa.Lion(ps, lr=3e-4, weight_decay=0.1, **kw),
}
# The same updates in torch: the reference both emsa modes are held to.
REFERENCES = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=3e-3, weight_decay=0.01),
    "lion": lambda ps: LionReference(ps, lr=3e-4, weight_decay=0.1),
}


def make(kind, in_backward, device="cpu", accumulate=1, dtype=torch.float32):
    torch.manual_seed(0)
    model = TinyGPT().to(device=device, dtype=dtype)
    kw = dict(profile=str(CPU_PROFILE), skip_nonfinite=False, state_dtype=dtype)
    if in_backward:
        kw.update(step_in_backward=True, accumulate=accumulate)
    opt = OPTS[kind](model.parameters(), **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, STEPS))
    return model, opt, sched


def batches(device, n):
    return [tuple(t.to(device) for t in b) for b in gpt_batches(n, seed=1)]


def assert_same(model_a, opt_a, model_b, opt_b):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), f"{name} differs by {(a - b).abs().max().item()}"
        sa, sb = opt_a.state[a], opt_b.state[b]
        for key in ("step", "exp_avg", "exp_avg_sq", "master"):
            if key in sa or key in sb:
                assert torch.equal(sa[key], sb[key]), f"state {key} of {name} differs"


def check_equal_to_step(kind, device, accumulate, dtype=torch.float32):
    """In-backward updates give the bits of step() after backward, and step() gives torch's
    updates on the same gradients (fp32: the reference on the parameters; bf16: on an fp32 copy
    of them, which emsa's master is, within what bf16 moments carry)."""
    ref_model, ref_opt, ref_sched = make(kind, False, device, dtype=dtype)
    model, opt, sched = make(kind, True, device, accumulate, dtype)
    torch_params = [p.detach().float().clone().requires_grad_() for p in ref_model.parameters()]
    torch_opt = REFERENCES[kind](torch_params)
    torch_sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, warmup_cosine(3, STEPS))
    data = batches(device, STEPS * accumulate)
    for k in range(STEPS):
        micro = data[k * accumulate:(k + 1) * accumulate]
        ref_opt.zero_grad(set_to_none=True)
        for b in micro:
            gpt_loss(ref_model, b).backward()
        for p, q in zip(ref_model.parameters(), torch_params):
            q.grad = p.grad.float()
        ref_opt.step()
        ref_sched.step()
        torch_opt.step()
        torch_sched.step()
        for j, b in enumerate(micro):
            gpt_loss(model, b).backward()
            last = j == accumulate - 1
            grads = [p.grad is None for p in model.parameters()]
            assert all(grads) if last else not any(grads), (k, j, grads)
        opt.step()  # does nothing in this mode
        opt.zero_grad()
        sched.step()
    assert int(opt.state[next(model.parameters())]["step"]) == STEPS
    assert_same(model, opt, ref_model, ref_opt)
    for (name, p), q in zip(ref_model.named_parameters(), torch_params):
        if dtype == torch.float32:
            assert_close(p, q.detach(), rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
        else:  # bf16 moments: about 1% of lr per element and step, against lr up to 3e-3
            assert_close(ref_opt.state[p]["master"], q.detach(), rtol=0, atol=3e-4,
                         msg=lambda m: f"{name}: {m}")


@pytest.mark.numerics
@pytest.mark.parametrize("kind", sorted(OPTS))
def test_matches_step_after_backward(kind):
    check_equal_to_step(kind, "cpu", 1)


@pytest.mark.numerics
def test_accumulate_matches_micro_batches_then_step():
    check_equal_to_step("adamw", "cpu", 2)


@pytest.mark.numerics
def test_bf16_parameters_and_state_match_step():
    # Stochastic rounding hashes the element index within each tensor, so updating one
    # parameter per call gives the bits of one call over all of them.
    check_equal_to_step("adamw", "cpu", 1, torch.bfloat16)


@requires_cuda
@pytest.mark.parametrize("kind,accumulate", [("adamw", 1), ("adamw", 2), ("lion", 1)])
def test_cuda_matches_step_after_backward(kind, accumulate):
    check_equal_to_step(kind, "cuda", accumulate)
    torch.cuda.synchronize()


@requires_cuda
def test_cuda_bf16_matches_step_after_backward():
    check_equal_to_step("adamw", "cuda", 1, torch.bfloat16)


def _wide_chain(device):
    torch.manual_seed(3)
    layers = [torch.nn.Linear(2048, 2048, bias=False) for _ in range(8)]
    return torch.nn.Sequential(*[m for l in layers for m in (l, torch.nn.Tanh())]).to(device)


def _train_wide(in_backward, steps=8):
    """Large parameters, little compute: an update still running when the next forward reads
    its layer (a missing wait after the pass) or when the caching allocator hands its gradient
    to later backward work (a missing record_stream) changes the result."""
    model = _wide_chain("cuda")
    opt = emsa.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, skip_nonfinite=False,
                     step_in_backward=in_backward, profile=str(CPU_PROFILE))
    gen = torch.Generator(device="cuda").manual_seed(11)
    for _ in range(steps):
        x = torch.randn(4, 2048, device="cuda", generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return model


@requires_cuda
def test_cuda_updates_in_backward_equal_step():
    """Bucket updates made in backward on the current stream give the bits of step() after
    backward."""
    ref = _train_wide(False)
    inline = _train_wide(True)
    for (name, a), b in zip(ref.named_parameters(), inline.parameters()):
        assert torch.equal(a, b), f"{name}: inline updates in backward differ from step()"


@requires_cuda
@pytest.mark.numerics
def test_cuda_frozen_and_absent_parameters_follow_torch():
    """CUDA in backward: a frozen parameter gets no state; one without a gradient in a pass
    keeps its step count; the others are updated as torch.optim.AdamW updates them."""
    a = torch.nn.Parameter(torch.linspace(-1, 1, 3, device="cuda"))
    frozen = torch.nn.Parameter(torch.ones(2, device="cuda"), requires_grad=False)
    sometimes = torch.nn.Parameter(torch.full((3,), 0.5, device="cuda"))
    ref = [p.detach().clone().requires_grad_(p.requires_grad) for p in (a, frozen, sometimes)]
    opt = emsa.AdamW([a, frozen, sometimes], step_in_backward=True)
    ref_opt = torch.optim.AdamW(ref)
    for k in range(5):
        for (x, f, z), o in (((a, frozen, sometimes), None), (tuple(ref), ref_opt)):
            loss = (x * x).sum() + (f * 0).sum() + ((z * x).sum() if k % 2 == 0 else 0)
            loss.backward()
            if o is not None:
                o.step()
                o.zero_grad()
    assert frozen not in opt.state and 1 not in opt.state_dict()["state"]
    assert int(opt.state[a]["step"]) == 5 and int(opt.state[sometimes]["step"]) == 3
    for p, q in zip((a, frozen, sometimes), ref):
        assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.numerics
def test_scheduler_lr_is_read_each_pass():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(4))
    opt = emsa.AdamW([w], lr=1.0, weight_decay=0.0, step_in_backward=True,
                     profile=str(CPU_PROFILE))
    for lr in (1.0, 0.5, 0.0, 0.25):
        for g in opt.param_groups:
            g["lr"] = lr
        before = w.detach().clone()
        (w * torch.ones(4)).sum().backward()
        # Adam's first steps with a constant gradient move each element by about lr.
        moved = (before - w.detach()).abs()
        assert torch.allclose(moved, torch.full((4,), lr), atol=1e-3), (lr, moved)
        assert w.grad is None


def test_closure_is_called_and_step_updates_nothing():
    w = torch.nn.Parameter(torch.ones(3))
    opt = emsa.AdamW([w], step_in_backward=True, profile=str(CPU_PROFILE))
    w.grad = torch.ones(3)
    before = w.detach().clone()
    assert opt.step(lambda: 7.0) == 7.0
    assert torch.equal(w.detach(), before)


def test_options_are_checked():
    w = torch.nn.Parameter(torch.ones(3))
    # skip_nonfinite is off by default in backward (the check makes a pass's updates wait for
    # the end of backward) and accepted when asked for (test_amp tests what it does).
    assert emsa.AdamW([w], step_in_backward=True).skip_nonfinite is False
    assert emsa.AdamW([w], step_in_backward=True, skip_nonfinite=True).skip_nonfinite is True
    with pytest.raises(ValueError, match="step_in_backward"):
        emsa.AdamW([w], accumulate=2)
    with pytest.raises(ValueError, match="accumulate"):
        emsa.AdamW([w], step_in_backward=True, accumulate=0)


@pytest.mark.numerics
def test_parameter_without_a_gradient_is_skipped_as_torch_does():
    """A parameter that gets no gradient in a pass is not updated and keeps its step count;
    the pass ends with the backward call, so the others are updated every pass."""
    a = torch.nn.Parameter(torch.linspace(-1, 1, 3))
    unused = torch.nn.Parameter(torch.ones(2))
    sometimes = torch.nn.Parameter(torch.full((3,), 0.5))
    ref = [p.detach().clone().requires_grad_() for p in (a, unused, sometimes)]
    opt = emsa.AdamW([a, unused, sometimes], step_in_backward=True, profile=str(CPU_PROFILE))
    ref_opt = torch.optim.AdamW(ref)
    for k in range(5):
        for (x, _, z), o in (((a, unused, sometimes), None), (tuple(ref), ref_opt)):
            loss = (x * x).sum() + ((z * x).sum() if k % 2 == 0 else 0)
            loss.backward()
            if o is not None:
                o.step()
                o.zero_grad()
    assert int(opt.state[a]["step"]) == 5 and int(opt.state[sometimes]["step"]) == 3
    assert unused not in opt.state and torch.equal(unused, torch.ones(2))  # as torch: no entry
    for p, q in zip((a, unused, sometimes), ref):
        assert_close(p, q, rtol=1e-6, atol=1e-7)
        if q in ref_opt.state:
            assert int(opt.state[p]["step"]) == int(ref_opt.state[q]["step"])


def test_two_backward_calls_are_two_passes():
    """Several backward calls over disjoint parameters: each is a pass of its own, updating
    what it reached; the other parameters keep their step counts."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = emsa.AdamW([a, b], step_in_backward=True, profile=str(CPU_PROFILE))
    a.sum().backward()
    b.sum().backward()
    a.sum().backward()
    assert int(opt.state[a]["step"]) == 2 and int(opt.state[b]["step"]) == 1
    assert a.grad is None and b.grad is None


@pytest.mark.numerics
def test_reentrant_checkpoint_is_one_pass():
    """checkpoint(use_reentrant=True) runs a backward inside the backward: the pass (and the
    clipping norm) still spans the whole outer backward."""
    from torch.utils.checkpoint import checkpoint

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6),
                                   torch.nn.Tanh(), torch.nn.Linear(6, 2))

    x, y = torch.randn(8, 6), torch.randn(8, 2)

    def loss_of(m):  # the checkpointed segment holds the parameters whose gradients come first
        h = m[2](m[1](m[0](x)))
        return ((checkpoint(lambda h: m[4](m[3](h)), h, use_reentrant=True) - y) ** 2).sum()

    ref, model = net(), net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = emsa.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.1, step_in_backward=True,
                     profile=str(CPU_PROFILE))
    for _ in range(3):
        loss_of(ref).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_of(model).backward()
    assert opt.clip_count == 3
    for p, q in zip(ref.parameters(), model.parameters()):
        assert_close(q, p, rtol=1e-6, atol=1e-7)


def test_frozen_parameters_are_not_waited_for():
    a = torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    opt = emsa.AdamW([a, frozen], step_in_backward=True, profile=str(CPU_PROFILE))
    for _ in range(3):
        (a * a).sum().backward()
    assert int(opt.state[a]["step"]) == 3
    assert torch.equal(frozen.detach(), torch.ones(2))


def test_parameter_reached_twice_in_one_backward_is_refused():
    """A parameter used inside two reentrant checkpoint segments gets two gradients in one
    backward; in backward that is refused (the first was already used), in step() mode fine
    (on CUDA step() mode hooks gather statistics; on the CPU it has no hooks)."""
    from torch.utils.checkpoint import checkpoint

    w = torch.nn.Parameter(torch.full((3,), 0.5))
    x = torch.ones(3, requires_grad=True)  # reentrant checkpoint needs an input that does

    def loss_of():
        h = checkpoint(lambda h: torch.tanh(h * w), x, use_reentrant=True)
        return checkpoint(lambda h: torch.tanh(h * w), h, use_reentrant=True).sum()

    opt = emsa.AdamW([w], step_in_backward=True, profile=str(CPU_PROFILE))
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        loss_of().backward()
    assert int(opt.state[w]["step"]) == 1  # the update from the first gradient, as the error says
    w.grad = None
    ref = w.detach().clone().requires_grad_()
    step_opt = emsa.AdamW([ref], profile=str(CPU_PROFILE))
    for _ in range(2):
        h = checkpoint(lambda h: torch.tanh(h * ref), x, use_reentrant=True)
        checkpoint(lambda h: torch.tanh(h * ref), h, use_reentrant=True).sum().backward()
        step_opt.step()
        step_opt.zero_grad()
    assert int(step_opt.state[ref]["step"]) == 2
