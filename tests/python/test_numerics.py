"""emsa's updates against torch.optim (and a Lion reference), element-wise."""

import copy

import pytest
import torch
from torch.testing import assert_close

import emsa
from conftest import CPU_PROFILE
from models import (LionReference, SmallCNN, TinyGPT, cnn_batches, cnn_loss, gpt_batches,
                    gpt_loss, param_groups, warmup_cosine)

STEPS = 50
MODELS = {
    "gpt": (TinyGPT, gpt_batches, gpt_loss),
    "cnn": (SmallCNN, cnn_batches, cnn_loss),
    "gpt_bias": (lambda: TinyGPT(qkv_bias=True), gpt_batches, gpt_loss),
}


def train(model, opt, batches, loss_fn, sched=None):
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def run(make_opt, kind="gpt", steps=STEPS, seed=0, scheduled=True):
    make_model, make_batches, loss_fn = MODELS[kind]
    torch.manual_seed(seed)
    model = make_model()
    opt = make_opt(model)
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(5, steps))
             if scheduled else None)
    losses = train(model, opt, make_batches(steps), loss_fn, sched)
    return model, opt, losses


def lockstep(make_ours, make_ref, kind, steps=STEPS):
    """The same inputs for both: gradients computed once, on the reference model, and copied
    to ours, so each optimizer alone decides the difference (DESIGN.md's contract)."""
    make_model, make_batches, loss_fn = MODELS[kind]
    torch.manual_seed(0)
    ref = make_model()
    ours = copy.deepcopy(ref)
    opt, ref_opt = make_ours(ours), make_ref(ref)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine(5, steps)) for o in (opt, ref_opt)]
    for batch in make_batches(steps):
        ref_opt.zero_grad()
        loss_fn(ref, batch).backward()
        for p, q in zip(ours.parameters(), ref.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        ref_opt.step()
        for s in scheds:
            s.step()
    return ours, ref


def assert_params_close(a, b, rtol=1e-5, atol=1e-7):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.wheel
@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["gpt", "cnn"])
def test_adamw_matches_torch_with_groups_and_scheduler(kind):
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    ours, opt, _ = run(lambda m: emsa.AdamW(param_groups(m), **hyper), kind)
    ref, ref_opt, _ = run(lambda m: torch.optim.AdamW(param_groups(m), **hyper), kind)
    assert_params_close(ours, ref)
    for p, q in zip(ours.parameters(), ref.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            # Moments average gradients, whose small elements come from cancellation: after
            # 50 steps on parameters 1e-7 apart, they agree relative to the tensor's scale.
            want = ref_opt.state[q][key]
            assert_close(opt.state[p][key], want, rtol=1e-5, atol=1e-5 * want.abs().max())
        assert opt.state[p]["step"].item() == ref_opt.state[q]["step"].item() == STEPS
    # The scheduler drove emsa's learning rate through the groups, as it drives torch's.
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["gpt_bias", "cnn"])
def test_adamw_matches_torch_on_the_same_gradients(kind):
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    ours, ref = lockstep(lambda m: emsa.AdamW(param_groups(m), **hyper),
                         lambda m: torch.optim.AdamW(param_groups(m), **hyper), kind)
    assert_params_close(ours, ref)


@pytest.mark.numerics
def test_repeated_runs_are_bitwise_equal():
    make = lambda m: emsa.AdamW(param_groups(m), lr=3e-3)  # noqa: E731
    a, _, losses_a = run(make)
    b, _, losses_b = run(make)
    ref, _, _ = run(lambda m: torch.optim.AdamW(param_groups(m), lr=3e-3))
    assert_params_close(a, ref)  # the runs are torch's, not only each other's
    assert losses_a == losses_b
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.numerics
def test_adam_l2_matches_torch():
    hyper = dict(lr=2e-3, weight_decay=0.01)
    ours, _, _ = run(lambda m: emsa.Adam(m.parameters(), **hyper), "cnn")
    ref, _, _ = run(lambda m: torch.optim.Adam(m.parameters(), **hyper), "cnn")
    assert_params_close(ours, ref)


@pytest.mark.numerics
def test_adam_decoupled_is_adamw():
    ours, _, _ = run(lambda m: emsa.Adam(m.parameters(), lr=2e-3, weight_decay=0.1,
                                         decoupled_weight_decay=True), steps=10)
    ref, _, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.1),
                    steps=10)
    assert_params_close(ours, ref)


@pytest.mark.numerics
def test_maximize_matches_torch():
    ours, _, _ = run(lambda m: emsa.AdamW(m.parameters(), lr=1e-3, maximize=True), steps=10)
    ref, _, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, maximize=True),
                    steps=10)
    assert_params_close(ours, ref)


@pytest.mark.wheel
@pytest.mark.numerics
def test_lion_matches_reference():
    hyper = dict(lr=3e-4, betas=(0.9, 0.99))
    ours, opt, _ = run(lambda m: emsa.Lion(param_groups(m, weight_decay=0.3), **hyper), "cnn")
    ref, _, _ = run(lambda m: LionReference(param_groups(m, weight_decay=0.3), **hyper), "cnn")
    assert_params_close(ours, ref)
    assert set(opt.state[next(ours.parameters())]) == {"step", "exp_avg"}


@pytest.mark.numerics
def test_none_grads_are_skipped_like_torch():
    def make_model():
        torch.manual_seed(0)
        m = SmallCNN()
        m.unused = torch.nn.Linear(4, 4)  # never in forward: its grad stays None
        return m

    ours, ref = make_model(), make_model()
    opt = emsa.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    before = ours.unused.weight.detach().clone()
    train(ours, opt, cnn_batches(5), cnn_loss)
    train(ref, ref_opt, cnn_batches(5), cnn_loss)
    assert_params_close(ours, ref)
    assert torch.equal(ours.unused.weight, before)
    # No entry for a parameter never updated, as torch keeps none.
    assert ours.unused.weight not in opt.state and ref.unused.weight not in ref_opt.state
    assert opt.state[ours.conv1.weight]["step"].item() == 5


@pytest.mark.numerics
def test_closure_returns_loss_and_matches_plain_steps():
    torch.manual_seed(0)
    a = SmallCNN()
    b = copy.deepcopy(a)
    opt_a = emsa.AdamW(a.parameters(), lr=1e-2)
    opt_b = emsa.AdamW(b.parameters(), lr=1e-2)
    batches = cnn_batches(5)
    train(b, opt_b, batches, cnn_loss)
    for batch in batches:
        def closure():
            opt_a.zero_grad()
            loss = cnn_loss(a, batch)
            loss.backward()
            return loss

        loss = opt_a.step(closure)
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    torch.manual_seed(0)
    ref = SmallCNN()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), batches, cnn_loss)
    assert_params_close(a, ref)


@pytest.mark.numerics
def test_grad_scaler_matches_torch():
    def go(make_opt):
        torch.manual_seed(0)
        model = SmallCNN()
        opt = make_opt(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
        for i, batch in enumerate(cnn_batches(8)):
            opt.zero_grad()
            scaler.scale(cnn_loss(model, batch)).backward()
            if i == 4:  # an overflow: the scaler must skip this step and back off
                model.fc.bias.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        return model, opt, scaler

    ours, opt, scaler = go(lambda m: emsa.AdamW(m.parameters(), lr=1e-2,
                                                skip_nonfinite=False))
    ref, ref_opt, ref_scaler = go(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert opt.state[ours.fc.bias]["step"].item() == 7
    assert_params_close(ours, ref)


@pytest.mark.numerics
def test_bf16_state_stays_close_to_fp32():
    ours, opt, _ = run(lambda m: emsa.AdamW(m.parameters(), lr=1e-3,
                                            state_dtype=torch.bfloat16), steps=20,
                       scheduled=False)
    ref, _, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), steps=20,
                    scheduled=False)
    p = next(ours.parameters())
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    # bf16 moments carry 8 bits of mantissa: per-element updates differ by ~1% of lr, and
    # 20 steps of lr=1e-3 move a weight by at most 2e-2.
    assert_params_close(ours, ref, rtol=0, atol=2e-4)


def test_named_parameters_and_plan_after_first_step():
    torch.manual_seed(0)
    model = TinyGPT()
    opt = emsa.AdamW(model.named_parameters(), lr=1e-3)
    assert opt.plan is None
    train(model, opt, gpt_batches(1), gpt_loss)
    plan = opt.plan
    names = [p["name"] for p in plan.json["params"]]
    assert names == [n for n, _ in model.named_parameters()]
    assert "wte.weight" in str(plan)
    # Without a probe, the first backward's gradient order was recorded: the head's bias is
    # first; the embeddings (the tied one is also the head's weight) come last, in an order
    # autograd is free to choose between them.
    record = opt.probe_record
    assert record.param("head.bias").grad_ready_order == 0
    assert record.param("wte.weight").grad_ready_order >= len(names) - 2
    assert record.param("wte.weight").forward_order in (0, 1)


@pytest.mark.numerics
def test_channels_last_parameters_keep_their_layout():
    hyper = dict(lr=3e-3)

    def make(m):
        m.to(memory_format=torch.channels_last)
        return emsa.AdamW(m.parameters(), **hyper)

    ours, ref = lockstep(make, lambda m: torch.optim.AdamW(m.parameters(), **hyper), "cnn", 10)
    assert_params_close(ours, ref)
    assert ours.conv2.weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.numerics
def test_bf16_parameters_keep_an_fp32_master():
    """bf16 weights: emsa updates an fp32 master copy and stores it rounded to nearest, so it
    equals fp32 AdamW on the same gradients, rounded; torch.optim on bf16 weights would lose
    every update smaller than half a bf16 ulp."""
    torch.manual_seed(0)
    master = SmallCNN().to(torch.bfloat16).float()  # starts where the bf16 weights start
    model = copy.deepcopy(master).to(torch.bfloat16)
    opt = emsa.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    for batch in cnn_batches(10):
        opt.zero_grad()
        x, y = batch
        torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y).backward()
        for p, q in zip(model.parameters(), master.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), master.parameters()):
        assert p.dtype == torch.bfloat16
        assert_close(opt.state[p]["master"], q.detach(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p, opt.state[p]["master"].to(torch.bfloat16))


@pytest.mark.numerics
def test_bf16_master_follows_writes_made_outside_the_optimizer():
    torch.manual_seed(0)
    model = SmallCNN().to(torch.bfloat16)
    opt = emsa.AdamW(model.parameters(), lr=1e-3, probe=emsa.probe(
        model, cnn_batches(1)[0][0].to(torch.bfloat16), trace=False,
        profile=str(CPU_PROFILE)))  # planned (masters copied) at construction
    other = SmallCNN().to(torch.bfloat16)
    model.load_state_dict(other.state_dict())  # then the weights are replaced
    x, y = cnn_batches(1)[0]
    torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y).backward()
    opt.step()
    # The reference: fp32 AdamW's step from the loaded weights, on the same gradients.
    master = [q.detach().float().requires_grad_() for q in other.parameters()]
    for p, q in zip(model.parameters(), master):
        q.grad = p.grad.float()
    torch.optim.AdamW(master, lr=1e-3).step()
    for p, q in zip(model.parameters(), master):
        assert_close(opt.state[p]["master"], q.detach(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p, opt.state[p]["master"].to(torch.bfloat16))


@pytest.mark.numerics
def test_tensor_lr_and_group_lr_changes_are_read_each_step():
    ours, _, _ = run(lambda m: emsa.AdamW(m.parameters(), lr=torch.tensor(2e-3)), "cnn",
                     steps=5, scheduled=False)
    ref, _, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=2e-3), "cnn", steps=5,
                    scheduled=False)
    assert_params_close(ours, ref)
    model = SmallCNN()
    opt = emsa.AdamW(model.parameters(), lr=1e-2)
    model(cnn_batches(1)[0][0]).sum().backward()
    opt.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
