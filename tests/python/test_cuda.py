"""emsa on CUDA parameters (the device tier through the PyTorch front end), against torch.optim.

Comparisons feed both optimizers the same gradients (computed once, on the reference model, and
copied), so that only the optimizers differ: separate backward passes would also compare cuDNN's
and attention's run-to-run noise, which Adam turns into lr-sized steps. Failure messages name the
parameter, the state and the step where it matters.
"""

import copy
import gc
import io
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import emsa
from conftest import assert_unchanged, requires_cuda, snapshot
from models import (SmallCNN, TinyGPT, cnn_batches, cnn_loss, gpt_batches, gpt_loss,
                    param_groups, warmup_cosine)
from test_numerics import LionReference

pytestmark = requires_cuda
DEVICE = "cuda"
STEPS = 50
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
MODELS = {"gpt": (TinyGPT, gpt_batches, gpt_loss), "cnn": (SmallCNN, cnn_batches, cnn_loss)}


def on_device(batch):
    return tuple(t.to(DEVICE) for t in batch)


def lockstep(make_ours, make_ref, kind, steps=STEPS, scheduled=True):
    """Trains ours and the reference on the reference's gradients; zero_grad(set_to_none) and
    a fresh gradient tensor per step, as training gives them (new addresses each step)."""
    make_model, make_batches, loss_fn = MODELS[kind]
    torch.manual_seed(0)
    ref = make_model().to(DEVICE)
    ours = copy.deepcopy(ref)
    opt, ref_opt = make_ours(ours), make_ref(ref)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine(5, steps))
              for o in (opt, ref_opt)] if scheduled else []
    for batch in make_batches(steps):
        ref_opt.zero_grad()
        loss_fn(ref, on_device(batch)).backward()
        opt.zero_grad()
        for p, q in zip(ours.parameters(), ref.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        ref_opt.step()
        for s in scheds:
            s.step()
    return ours, opt, ref, ref_opt


def assert_params_close(a, b, rtol=1e-5, atol=1e-7, what=""):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what}{n}: {m}")


def first_difference(a, b):
    """'' when a and b are bitwise equal, else where and how they differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    diff = (a.detach().cpu().view(-1) != b.detach().cpu().view(-1)).nonzero()
    if diff.numel() == 0:
        return ""
    i = diff[0].item()
    return (f"{diff.numel()} of {a.numel()} elements differ; first at flat index {i}: "
            f"{a.detach().reshape(-1)[i].item()!r} vs {b.detach().reshape(-1)[i].item()!r}")


def assert_bitwise(named_a, named_b, what):
    for (name, a), (_, b) in zip(named_a, named_b):
        where = first_difference(a, b)
        assert not where, f"{what}: {name}: {where}"


def named_state(model, opt, keys=("exp_avg", "exp_avg_sq")):
    return [(f"{n}.{k}", opt.state[p][k]) for n, p in model.named_parameters() for k in keys
            if k in opt.state[p]]


def saved(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)


def synthetic_grads(model, steps, seed=1, scale=1e-2):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) * scale for p in model.parameters()]
            for _ in range(steps)]


# ---- numerics against torch.optim --------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpt", "cnn"])
def test_adamw_matches_torch_with_groups_and_scheduler(kind):
    ours, opt, ref, ref_opt = lockstep(lambda m: emsa.AdamW(param_groups(m), **HYPER),
                                       lambda m: torch.optim.AdamW(param_groups(m), **HYPER), kind)
    assert_params_close(ours, ref, what=f"after {STEPS} steps: ")
    steps = {st["step"].item() for st in opt.state_dict()["state"].values()}
    assert steps == {STEPS}, f"step counts read back from the device: {steps}"
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert opt.state[p]["exp_avg"].device.type == DEVICE
        for key in ("exp_avg", "exp_avg_sq"):
            want = ref_opt.state[q][key]
            assert_close(opt.state[p][key], want, rtol=1e-5, atol=1e-5 * want.abs().max(),
                         msg=lambda m, n=name, k=key: f"{n}.{k}: {m}")
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_adam_l2_and_lion_match_their_references():
    ours, _, ref, _ = lockstep(lambda m: emsa.Adam(m.parameters(), lr=2e-3, weight_decay=0.01),
                               lambda m: torch.optim.Adam(m.parameters(), lr=2e-3,
                                                          weight_decay=0.01), "cnn", steps=20)
    assert_params_close(ours, ref, what="Adam: ")
    hyper = dict(lr=3e-4, betas=(0.9, 0.99))
    ours, opt, ref, _ = lockstep(lambda m: emsa.Lion(param_groups(m, weight_decay=0.3), **hyper),
                                 lambda m: LionReference(param_groups(m, weight_decay=0.3),
                                                         **hyper), "cnn", steps=20)
    assert_params_close(ours, ref, what="Lion: ")
    assert set(opt.state[next(ours.parameters())]) == {"step", "exp_avg"}


def test_repeated_runs_are_bitwise_equal_and_equal_the_cpu_path():
    """The device kernels are a transcription of the CPU kernels: same inputs, same bits."""

    def run(device):
        torch.manual_seed(0)
        model = TinyGPT().to(device)
        opt = emsa.AdamW(param_groups(model), **HYPER)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, 12))
        for step_grads in synthetic_grads(model, 12):
            opt.zero_grad()
            for p, g in zip(model.parameters(), step_grads):
                p.grad = g.to(device)
            opt.step()
            sched.step()
        return list(model.named_parameters()) + named_state(model, opt)

    first, second, cpu = run(DEVICE), run(DEVICE), run("cpu")
    assert_bitwise(second, first, "a second run on the GPU")
    assert_bitwise(cpu, first, "the CPU path vs the GPU path")


def test_bf16_parameters_keep_an_fp32_master():
    torch.manual_seed(0)
    master = SmallCNN().to(torch.bfloat16).float().to(DEVICE)  # starts where the bf16 weights do
    model = copy.deepcopy(master).to(torch.bfloat16)
    opt = emsa.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    for x, y in cnn_batches(10):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(DEVICE, torch.bfloat16)).float(),
                                    y.to(DEVICE)).backward()
        for p, q in zip(model.parameters(), master.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), master.parameters()):
        assert p.dtype == torch.bfloat16
        assert_close(opt.state[p]["master"], q.detach(), rtol=1e-5, atol=1e-7,
                     msg=lambda m, n=name: f"{n}.master: {m}")
        assert torch.equal(p, opt.state[p]["master"].to(torch.bfloat16)), \
            f"{name}: the bf16 parameter is not its master rounded to nearest"


def test_bf16_state_stays_close_to_fp32():
    ours, opt, ref, _ = lockstep(lambda m: emsa.AdamW(m.parameters(), lr=1e-3,
                                                      state_dtype=torch.bfloat16),
                                 lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), "cnn",
                                 steps=20, scheduled=False)
    assert opt.state[next(ours.parameters())]["exp_avg_sq"].dtype == torch.bfloat16
    # bf16 moments carry 8 bits: updates differ by ~1% of lr; 20 steps of 1e-3 move 2e-2 at most.
    assert_params_close(ours, ref, rtol=0, atol=2e-4)


# ---- gradients at any address ------------------------------------------------------------------

def test_gradient_addresses_do_not_change_the_result():
    """Gradients written in place (one address for the run), fresh each step with the old ones
    still alive (a new address every step), and 4 bytes off a 16-byte boundary (the kernels'
    vector path must step aside): the same bits."""

    def run(mode):
        torch.manual_seed(0)
        model = SmallCNN().to(DEVICE)
        params = list(model.parameters())
        opt = emsa.AdamW(model.parameters(), lr=1e-2)
        buffers = [torch.zeros_like(p) for p in params]
        held = []
        for step_grads in synthetic_grads(model, 8):
            for p, g, buf in zip(params, step_grads, buffers):
                if mode == "in_place":
                    buf.copy_(g)
                    p.grad = buf
                elif mode == "fresh":
                    held.append(p.grad)
                    p.grad = g.to(DEVICE)
                else:
                    big = torch.empty(p.numel() + 1, device=DEVICE)
                    big[1:].copy_(g.reshape(-1))
                    p.grad = big[1:].view_as(p)
                    assert p.grad.data_ptr() % 16 != 0
            opt.step()
        return list(model.named_parameters()) + named_state(model, opt)

    in_place = run("in_place")
    assert_bitwise(run("fresh"), in_place, "fresh gradients vs in-place ones")
    assert_bitwise(run("misaligned"), in_place, "misaligned gradients vs aligned ones")


def test_parameters_without_gradients_are_skipped_as_torch_does():
    """A parameter whose .grad is None in a step is not updated, its state stays and its own
    step count stays, as in torch.optim; a step with no gradient at all does nothing."""
    torch.manual_seed(0)
    ref = SmallCNN().to(DEVICE)
    ref.unused = nn.Linear(4, 4).to(DEVICE)  # never in forward: its grad stays None
    ours = copy.deepcopy(ref)
    opt = emsa.AdamW(ours.named_parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in ours.parameters()]
    opt.zero_grad()
    opt.step()  # no gradient at all: nothing to do, as in torch
    assert not opt.last_step_skipped
    for p, q in zip(ours.parameters(), before):
        assert torch.equal(p, q)
    for k, batch in enumerate(cnn_batches(6)):
        ref_opt.zero_grad()
        cnn_loss(ref, on_device(batch)).backward()
        if k % 2:  # fc too sits out the odd steps
            ref.fc.weight.grad = None
        opt.zero_grad()
        for p, q in zip(ours.parameters(), ref.parameters()):
            p.grad = None if q.grad is None else q.grad.clone()
        opt.step()
        ref_opt.step()
    assert_params_close(ours, ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(ours.unused.weight, before[-2]) and torch.equal(ours.unused.bias,
                                                                       before[-1])
    state = opt.state_dict()["state"]
    ref_state = ref_opt.state_dict()["state"]
    names = [n for n, _ in ours.named_parameters()]
    for i, name in enumerate(names):
        want = ref_state[i]["step"].item() if i in ref_state else 0.0
        got = state[i]["step"].item() if i in state else 0.0
        assert got == want, f"{name}: step {got} but torch counts {want}"
    fc = names.index("fc.weight")
    assert state[fc]["step"].item() == 3


def test_parameter_storage_replaced_or_reshaped_is_refused():
    torch.manual_seed(0)
    model = SmallCNN().to(DEVICE)
    opt = emsa.AdamW(model.parameters(), lr=1e-2)
    cnn_loss(model, on_device(cnn_batches(1)[0])).backward()
    opt.step()
    model.fc.weight.data = model.fc.weight.data.clone()
    with pytest.raises(ValueError, match="no longer lives where emsa planned it.*copy new values"):
        opt.step()
    model.fc.weight.data = model.fc.weight.data.reshape(5, 32)
    with pytest.raises(ValueError, match=r"changed from \(10, 16\) to \(5, 32\)"):
        opt.step()


# ---- non-finite gradients ----------------------------------------------------------------------

def skip_warnings(caught):
    return [str(w.message) for w in caught if "step skipped" in str(w.message)]


def test_nonfinite_gradient_skips_the_step_on_the_gpu():
    torch.manual_seed(0)
    model = SmallCNN().to(DEVICE)
    opt = emsa.AdamW(model.named_parameters(), lr=1e-2)
    batches = [on_device(b) for b in cnn_batches(4)]

    def backward(batch):
        opt.zero_grad()
        cnn_loss(model, batch).backward()

    for batch in batches[:2]:
        backward(batch)
        opt.step()
    opt.state_dict()  # exact step counts in opt.state
    before = snapshot(model, opt)
    backward(batches[2])
    model.bn2.bias.grad[3] = float("nan")
    model.fc.weight.grad[0, 0] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # enqueues; the GPU decides
        assert opt.last_step_skipped  # waits for it
    found = skip_warnings(caught)
    assert len(found) == 1, found
    assert "2 non-finite gradient elements" in found[0] and "step() call 3" in found[0], found[0]
    assert_unchanged(model, opt, before)
    backward(batches[3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the skip is reported once only
        opt.step()
        assert not opt.last_step_skipped
    assert opt.state_dict()["state"][0]["step"].item() == 3


def test_a_skip_found_later_is_reported_once_and_not_counted():
    """No one waits for the GPU between steps: the skip of call 4 is found at a later step() or
    at state_dict(), and the result equals a run that never took that step."""
    hyper = dict(lr=1e-2)
    torch.manual_seed(0)
    ref = SmallCNN().to(DEVICE)
    ours = copy.deepcopy(ref)
    opt, ref_opt = emsa.AdamW(ours.parameters(), **hyper), torch.optim.AdamW(ref.parameters(),
                                                                              **hyper)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, batch in enumerate(cnn_batches(8)):
            ref_opt.zero_grad()
            cnn_loss(ref, on_device(batch)).backward()
            opt.zero_grad()
            for p, q in zip(ours.parameters(), ref.parameters()):
                p.grad = q.grad.clone()
            if i == 3:
                ours.fc.bias.grad[1] = float("inf")
            else:
                ref_opt.step()
            opt.step()
        state = opt.state_dict()["state"]
    found = skip_warnings(caught)
    assert len(found) == 1 and "step() call 4" in found[0], found
    assert {st["step"].item() for st in state.values()} == {7}
    assert_params_close(ours, ref)


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_grad_scaler_matches_torch(skip_nonfinite):
    torch.manual_seed(0)
    ref = SmallCNN().to(DEVICE)
    ours = copy.deepcopy(ref)
    opt = emsa.AdamW(ours.parameters(), lr=1e-2, skip_nonfinite=skip_nonfinite)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler, ref_scaler = (torch.amp.GradScaler(DEVICE, init_scale=2.0**12, growth_interval=3)
                          for _ in range(2))
    for i, batch in enumerate(cnn_batches(8)):
        ref_opt.zero_grad()
        ref_scaler.scale(cnn_loss(ref, on_device(batch))).backward()
        if i == 4:  # an overflow: both scalers must skip this step and back off
            ref.fc.bias.grad[0] = float("inf")
        opt.zero_grad()
        scaler.scale(cnn_loss(ours, on_device(batch)))  # what a scaler must see once per step
        for p, q in zip(ours.parameters(), ref.parameters()):
            p.grad = q.grad.clone()
        for o, s in ((opt, scaler), (ref_opt, ref_scaler)):
            s.step(o)
            s.update()
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert opt.state_dict()["state"][0]["step"].item() == 7
    assert_params_close(ours, ref)


# ---- state_dict ----------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["emsa_to_torch", "torch_to_emsa"])
def test_switching_continues_like_never_switching(direction):
    ours_first = direction == "emsa_to_torch"
    first = emsa.AdamW if ours_first else torch.optim.AdamW
    second = torch.optim.AdamW if ours_first else emsa.AdamW
    torch.manual_seed(0)
    model = TinyGPT().to(DEVICE)
    opt = first(param_groups(model), **HYPER)
    batches = [on_device(b) for b in gpt_batches(20)]
    for batch in batches[:10]:
        opt.zero_grad()
        gpt_loss(model, batch).backward()
        opt.step()
    checkpoint = saved(opt.state_dict())
    if ours_first:
        for st in checkpoint["state"].values():
            assert st["step"].dtype == torch.float32 and st["step"].dim() == 0
            assert st["step"].device.type == "cpu" and st["exp_avg"].device.type == DEVICE
            assert list(st) == ["step", "exp_avg", "exp_avg_sq"]
    switched = copy.deepcopy(model)
    opt2 = second(param_groups(switched), **HYPER)
    opt2.load_state_dict(checkpoint)
    for (name, p), q in zip(model.named_parameters(), switched.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key].cpu(), opt2.state[q][key].cpu()), \
                f"{name}.{key} after loading"
    for batch in batches[10:]:  # the same gradients for both
        opt.zero_grad()
        gpt_loss(model, batch).backward()
        opt2.zero_grad()
        for p, q in zip(switched.parameters(), model.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        opt2.step()
    assert_params_close(switched, model, rtol=1e-6, atol=1e-8, what="10 steps after switching: ")
    final = opt2.state_dict() if not ours_first else opt.state_dict()
    assert {st["step"].item() for st in final["state"].values()} == {20}


def test_emsa_round_trip_is_bitwise_and_outlives_the_optimizer():
    torch.manual_seed(0)
    model = TinyGPT().to(DEVICE)
    opt = emsa.Lion(param_groups(model), lr=1e-4)
    batches = [on_device(b) for b in gpt_batches(20)]

    for batch in batches[:10]:
        opt.zero_grad()
        gpt_loss(model, batch).backward()
        opt.step()
    state = opt.state_dict()
    checkpoint = saved(state)
    other = copy.deepcopy(model)
    opt2 = emsa.Lion(param_groups(other), lr=1e-4)
    opt2.load_state_dict(checkpoint)
    for batch in batches[10:]:  # the same gradients for both
        opt.zero_grad()
        gpt_loss(model, batch).backward()
        opt2.zero_grad()
        for p, q in zip(other.parameters(), model.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        opt2.step()
    assert_bitwise(list(other.named_parameters()), list(model.named_parameters()),
                   "10 steps after an emsa -> emsa round trip")
    # The state_dict's tensors alias the arena; they stay valid after the optimizer is gone.
    exp_avg = state["state"][0]["exp_avg"]
    copy_now = exp_avg.clone()
    backend = weakref.ref(opt._bound.engine)
    del opt, state
    gc.collect()
    assert backend() is None, "the optimizer's engine outlived the optimizer (a leak)"
    junk = [torch.full((1 << 18,), 7.0, device=DEVICE) for _ in range(8)]  # reuse freed memory
    assert torch.equal(exp_avg, copy_now), "a state tensor changed after its optimizer died"
    del junk


def test_different_steps_within_a_group_load_and_continue_as_torch():
    """torch.optim keeps a step count per parameter (a parameter that missed steps has fewer):
    emsa loads such a state and continues it as torch does."""
    torch.manual_seed(0)
    model = SmallCNN().to(DEVICE)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in cnn_batches(2):
        ref_opt.zero_grad()
        cnn_loss(model, on_device(batch)).backward()
        ref_opt.step()
    sd = saved(ref_opt.state_dict())
    sd["state"][2]["step"] = torch.tensor(5.0)
    ref_opt.load_state_dict(sd)
    ours = copy.deepcopy(model)
    opt = emsa.AdamW(ours.parameters(), lr=1e-2)
    opt.load_state_dict(sd)
    assert [st["step"].item() for st in opt.state_dict()["state"].values()] == \
        [st["step"].item() for st in ref_opt.state_dict()["state"].values()]
    for batch in cnn_batches(3):
        ref_opt.zero_grad()
        cnn_loss(model, on_device(batch)).backward()
        opt.zero_grad()
        for p, q in zip(ours.parameters(), model.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        ref_opt.step()
    assert_params_close(ours, model, rtol=1e-6, atol=1e-7)
    steps = [st["step"].item() for st in opt.state_dict()["state"].values()]
    assert steps == [st["step"].item() for st in ref_opt.state_dict()["state"].values()]
    assert steps[2] == 8 and steps[0] == 5


# ---- planning ------------------------------------------------------------------------------------

def test_probe_plans_at_construction_and_a_small_budget_fails_early():
    torch.manual_seed(0)
    model = TinyGPT().to(DEVICE)
    idx, targets = on_device(gpt_batches(1)[0])
    record = emsa.probe(model, idx, targets, profile=emsa.measure_profile(False))
    opt = emsa.AdamW(model.parameters(), probe=record)
    assert opt.plan is not None
    assert {p["tier"] for p in opt.plan.json["params"] if p["trainable"]} == {"L1"}
    with pytest.raises(emsa.InfeasibleBudgetError, match="smallest budget") as e:
        emsa.AdamW(model.parameters(), probe=record, budget="1MiB")
    assert e.value.min_budget_bytes > 1 << 20
    gpt_loss(model, (idx, targets)).backward()
    opt.step()
    assert opt.state_dict()["state"][0]["step"].item() == 1


def test_steps_on_another_stream_are_ordered():
    if DEVICE != "cuda":
        pytest.skip("needs real CUDA streams")

    def run(use_side_stream):
        torch.manual_seed(0)
        model = SmallCNN().to(DEVICE)
        opt = emsa.AdamW(model.parameters(), lr=1e-2)
        side = torch.cuda.Stream()
        for k, step_grads in enumerate(synthetic_grads(model, 6)):
            for p, g in zip(model.parameters(), step_grads):
                p.grad = g.to(DEVICE)
            if use_side_stream and k % 2:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    opt.step()
                torch.cuda.current_stream().wait_stream(side)
            else:
                opt.step()
        return list(model.named_parameters()) + named_state(model, opt)

    assert_bitwise(run(True), run(False), "steps alternating between two streams")
