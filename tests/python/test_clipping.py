"""max_grad_norm: emsa clips inside its update as torch.nn.utils.clip_grad_norm_ does before
torch.optim's step, in step() mode and with step_in_backward (CPU engine)."""

import importlib.util
import math
import subprocess
import sys
import warnings

import pytest
import torch
from torch.testing import assert_close

import emsa
from conftest import CPU_PROFILE, subprocess_env
from models import LionReference

STEPS = 10
MAX_NORM = 1.0
KINDS = {
    "adamw": (lambda ps, **kw: emsa.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "adam": (lambda ps, **kw: emsa.Adam(ps, lr=1e-2, weight_decay=0.01, **kw),
             lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01)),
    "lion": (lambda ps, **kw: emsa.Lion(ps, lr=1e-3, weight_decay=0.1, **kw),
             lambda ps: LionReference(ps, lr=1e-3, weight_decay=0.1)),
}


def mlp(seed=0):
    """Every parameter gets a gradient of its own size every step (no zero true gradients)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 6))


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    # The scale grows over the steps, so the norm crosses MAX_NORM: some steps clip, some not.
    return [(torch.randn(16, 12, generator=g), torch.randn(16, 6, generator=g) * (0.2 + k / 3))
            for k in range(n)]


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean()


def torch_run(kind, batches, accumulate=1, max_norm=MAX_NORM):
    model = mlp()
    opt = KINDS[kind][1](list(model.parameters()))
    norms = []
    for k in range(0, len(batches), accumulate):
        for x, y in batches[k:k + accumulate]:
            loss_of(model, x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return model, opt, norms


def emsa_run(kind, batches, accumulate=1, **kw):
    model = mlp()
    opt = KINDS[kind][0](list(model.parameters()), max_grad_norm=MAX_NORM,
                         profile=str(CPU_PROFILE), **kw)
    norms = []
    for k in range(0, len(batches), accumulate):
        for x, y in batches[k:k + accumulate]:
            loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    return model, opt, norms


def assert_like_torch(ref, model, ref_norms, norms, opt):
    assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    fired = sum(n > MAX_NORM for n in ref_norms)
    assert 0 < fired < len(ref_norms), "the data should make some steps clip and some not"
    assert opt.clip_count == fired
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        # One update moves a parameter by about lr; these agree to float32 rounding.
        assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"{name}")


@pytest.mark.numerics
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("in_backward", [False, True])
def test_clipping_matches_clip_grad_norm(kind, in_backward):
    batches = data(STEPS)
    ref, _, ref_norms = torch_run(kind, batches)
    model, opt, norms = emsa_run(kind, batches, step_in_backward=in_backward)
    assert_like_torch(ref, model, ref_norms, norms, opt)


@pytest.mark.numerics
def test_accumulate_clips_the_accumulated_gradients():
    """accumulate=N in backward: the norm is of the N micro-batches' summed gradients."""
    batches = data(2 * STEPS)
    ref, _, ref_norms = torch_run("adamw", batches, accumulate=2)
    model = mlp()
    opt = emsa.AdamW(list(model.parameters()), lr=1e-2, weight_decay=0.1,
                     max_grad_norm=MAX_NORM, profile=str(CPU_PROFILE), step_in_backward=True,
                     accumulate=2)
    norms = []
    for k, (x, y) in enumerate(batches):
        loss_of(model, x, y).backward()
        if k % 2 == 1:
            norms.append(opt.last_grad_norm)
    assert_like_torch(ref, model, ref_norms, norms, opt)


@pytest.mark.numerics
def test_max_grad_norm_set_later_and_turned_off():
    """opt.max_grad_norm is read at each step: set after construction, then None (off)."""
    batches = data(6)
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = mlp()
    opt = emsa.AdamW(model.parameters(), lr=1e-2, profile=str(CPU_PROFILE))
    assert opt.max_grad_norm is None and opt.last_grad_norm is None
    for k, (x, y) in enumerate(batches):
        clip = 0.3 if k < 3 else None
        opt.max_grad_norm = clip
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_of(m, x, y).backward()
            if clip is not None and o is ref_opt:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            o.step()
            o.zero_grad()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert opt.clip_count == 3
    rows = opt.step_stats()
    assert [("grad_norm" in r, r.get("clipped")) for r in rows] == [(True, True)] * 3 + [
        (False, None)] * 3


def test_norm_is_the_float64_norm_rounded_and_near_torch():
    """emsa sums squares in float64: its norm is the exact one rounded to float32. torch sums
    float32 per-tensor norms, each reduced in float32: on 100k elements it is off by a few
    1e-7 relative. The clip coefficients then differ by as much, far below one update."""
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1, 7, 1000, 4096, 100_003)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    exact = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()
    ref = float(torch.nn.utils.clip_grad_norm_(copies, 1e9))
    opt = emsa.AdamW(params, max_grad_norm=1e9, profile=str(CPU_PROFILE))
    opt.step()
    assert opt.last_grad_norm == float(torch.tensor(exact, dtype=torch.float32))
    assert math.isclose(opt.last_grad_norm, ref, rel_tol=2e-6)


def test_nonfinite_with_clipping_is_skipped_unchanged():
    model = mlp()
    opt = emsa.AdamW(model.parameters(), max_grad_norm=1.0, profile=str(CPU_PROFILE))
    x, y = data(1)[0]
    loss_of(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    loss_of(model, x, y).backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="step skipped"):
        opt.step()
    assert opt.last_step_skipped
    for p, b, st in zip(model.parameters(), before, state):
        assert torch.equal(p, b)
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "1.0"])
def test_max_grad_norm_is_validated(bad):
    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="max_grad_norm"):
        emsa.AdamW([w], max_grad_norm=bad)
    opt = emsa.AdamW([w])
    with pytest.raises(ValueError, match="max_grad_norm"):
        opt.max_grad_norm = bad
    opt.max_grad_norm = 0  # off, as Trainer's 0
    assert opt.max_grad_norm is None


def test_no_warning_when_clipping_does_not_fire():
    model = mlp()
    opt = emsa.AdamW(model.parameters(), max_grad_norm=1e6, profile=str(CPU_PROFILE))
    x, y = data(1)[0]
    loss_of(model, x, y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert opt.clip_count == 0 and opt.last_grad_norm > 0


def test_trainer_callback_moves_clipping_into_emsa(tmp_path):
    """emsa.hf.EmsaTrainerCallback: Trainer's max_grad_norm goes to emsa and Trainer's is 0
    while training (restored after); an in-backward optimizer gets Accelerate's scaler; the
    logged grad_norm is emsa's. (tests/python/test_recipes.py trains a real Trainer.)"""
    transformers = pytest.importorskip("transformers")
    from types import SimpleNamespace

    from emsa.hf import EmsaTrainerCallback

    assert emsa.EmsaTrainerCallback is EmsaTrainerCallback
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_grad_norm=0.7,
                                          report_to=[], use_cpu=True)
    state = transformers.TrainerState()
    control = transformers.TrainerControl()
    model = mlp()
    opt = emsa.AdamW(model.parameters(), step_in_backward=True, profile=str(CPU_PROFILE))
    s = torch.amp.GradScaler("cpu")
    wrapped = SimpleNamespace(optimizer=opt, scaler=s)  # what Accelerate hands callbacks
    cb = EmsaTrainerCallback()
    cb.on_train_begin(args, state, control, optimizer=wrapped)
    assert opt.max_grad_norm == 0.7 and args.max_grad_norm == 0.0
    assert opt.grad_scaler is s
    x, y = data(1)[0]
    s.scale(loss_of(model, x, y) * 100).backward()
    logs = {"loss": 1.0, "grad_norm": 0.0}  # Trainer's norm of the released gradients
    state.log_history.append(dict(logs))
    cb.on_log(args, state, control, logs=logs)
    assert logs["grad_norm"] == opt.last_grad_norm == state.log_history[-1]["grad_norm"] > 0.7
    with warnings.catch_warnings():
        # Trainer's logged norm unscales after backward: emsa clips, so no warning here.
        warnings.simplefilter("error")
        s.unscale_(opt)
        s.step(opt)
        s.update()
    cb.on_train_end(args, state, control)
    assert args.max_grad_norm == 0.7

    with pytest.warns(RuntimeWarning, match="not an emsa optimizer"):
        EmsaTrainerCallback().on_train_begin(args, state, control,
                                             optimizer=torch.optim.SGD(mlp().parameters()))
    assert args.max_grad_norm == 0.7


# ---- clipping by hand after an in-backward pass (emsa._engine.hand_clipping) --------------------------

def in_backward_opt(model, **kw):
    return emsa.AdamW(list(model.parameters()), lr=1e-2, weight_decay=0.1,
                      profile=str(CPU_PROFILE), step_in_backward=True, **kw)


@pytest.mark.parametrize("call", ["clip_grad_norm_", "clip_grad.clip_grad_norm_",
                                  "clip_grad_value_"])
def test_clipping_by_hand_after_the_pass_is_refused(call):
    """Without emsa's max_grad_norm, torch's clipping after an in-backward pass would clip
    nothing and return 0: refused with what to do. Before any pass, and on parameters the pass
    did not consume, torch's function runs unchanged."""
    model = mlp()
    opt = in_backward_opt(model)
    space, _, name = call.rpartition(".")
    fn = getattr(torch.nn.utils.clip_grad if space else torch.nn.utils, name)
    limit = 0.1 if "norm" in name else 0.01
    if "norm" in name:  # no pass yet: torch's, over no gradients (its value_ fails on none)
        assert float(fn(model.parameters(), limit)) == 0.0
    x, y = data(1)[0]
    loss_of(model, x, y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="max_grad_norm=" if "norm" in name else "global norm"):
        fn(model.parameters(), limit)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    other = mlp(seed=3)  # not this optimizer's: torch's function clips its gradients
    loss_of(other, x, y).backward()
    grads = [p.grad.clone() for p in other.parameters()]
    result = fn(other.parameters(), limit)
    twin = mlp(seed=3)
    for p, g in zip(twin.parameters(), grads):
        p.grad = g.clone()
    expected = getattr(torch.nn.utils.clip_grad, name)._emsa_original(twin.parameters(), limit)
    if "norm" in name:
        assert float(result) == float(expected) > limit
    for p, q in zip(other.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert not torch.equal(other[0].weight.grad, grads[0]), "the other model's call clipped"


def test_clipping_by_hand_at_emsas_threshold_returns_its_norm():
    """With max_grad_norm = the call's max_norm, emsa clipped in backward: the call (a loop
    written for torch.optim) warns once and returns emsa's norm, and the run equals torch's
    clip_grad_norm_ + AdamW."""
    batches = data(STEPS)
    ref, _, ref_norms = torch_run("adamw", batches)
    model = mlp()
    opt = in_backward_opt(model, max_grad_norm=MAX_NORM)
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches:
            loss_of(model, x, y).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            opt.zero_grad()
    said = [w for w in caught if "finds no gradients" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__
    assert_like_torch(ref, model, ref_norms, norms, opt)
    with pytest.raises(RuntimeError, match="norm_type=1.0"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=1.0)


def test_clipping_by_hand_between_accumulated_backwards_runs_torchs():
    """accumulate=2: the first backward leaves its gradients in .grad (emsa updates after the
    second), so torch's clipping acts on them as usual; after the second it is refused."""
    model = mlp()
    opt = in_backward_opt(model, accumulate=2)
    (x, y), (x2, y2) = data(2)
    loss_of(model, x, y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert float(norm) > 1e-3
    assert not torch.equal(model[0].weight.grad, grads[0])
    loss_of(model, x2, y2).backward()
    with pytest.raises(RuntimeError, match="would clip nothing"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    opt.remove_hooks()
    loss_of(model, x, y).backward()  # no longer in backward: torch's call as usual
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)) > 1e-3


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
def test_accelerate_clipping_after_the_pass_is_refused_or_answered():
    """Accelerate's clip_grad_norm_ (torch's, looked up at each call) after an in-backward
    pass: refused without emsa's clipping, emsa's norm with it."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    x, y = data(1)[0]
    for clip in (None, MAX_NORM):
        model = mlp()
        opt = in_backward_opt(model, max_grad_norm=clip)
        model, opt = accelerator.prepare(model, opt)
        accelerator.backward(loss_of(model, x, y))
        if clip is None:
            with pytest.raises(RuntimeError, match="would clip nothing"):
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        else:
            with pytest.warns(RuntimeWarning, match="finds no gradients"):
                norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            twin = mlp()
            loss_of(twin, x, y).backward()
            torchs = torch.linalg.vector_norm(torch.cat([p.grad.flatten()
                                                         for p in twin.parameters()]))
            assert float(norm) == opt.optimizer.last_grad_norm
            assert_close(float(norm), float(torchs), rtol=1e-6, atol=0)


def test_norm_only_call_after_the_pass_returns_emsas_norm_or_nan():
    """clip_grad_norm_(..., inf) (the norm alone, as Trainer logs it) after an in-backward
    pass: emsa's norm of that pass, silently, when emsa clips (it equals torch's norm of the
    same gradients); nan with one warning when it does not (torch's call would say 0)."""
    x, y = data(1)[0]
    twin = mlp()
    loss_of(twin, x, y).backward()
    torchs = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten()
                                                       for p in twin.parameters()])))
    model = mlp()
    opt = in_backward_opt(model, max_grad_norm=MAX_NORM)
    loss_of(model, x, y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert norm.dtype == torch.float32 and float(norm) == opt.last_grad_norm
    assert_close(float(norm), torchs, rtol=1e-6, atol=0)
    model = mlp()
    opt = in_backward_opt(model)
    loss_of(model, x, y).backward()
    with pytest.warns(RuntimeWarning, match="computes their norm only when it clips"):
        assert math.isnan(float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)))


ACCELERATE_LATER = """
import sys
import torch, emsa
assert "accelerate" not in sys.modules
model = torch.nn.Linear(4, 2)
opt = emsa.AdamW(model.parameters(), profile=sys.argv[1], step_in_backward=True)
from accelerate import Accelerator  # after the optimizer: its guard is not in place yet
model(torch.ones(3, 4)).sum().backward()  # the pass's end puts Accelerate under the guard
try:
    Accelerator(cpu=True).clip_grad_norm_(model.parameters(), 1.0)
except RuntimeError as e:
    print("refused:", "would clip nothing" in str(e))
else:
    print("not refused")
"""


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
def test_accelerate_imported_after_the_optimizer_is_guarded_from_the_next_pass():
    r = subprocess.run([sys.executable, "-c", ACCELERATE_LATER, str(CPU_PROFILE)],
                       env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "refused: True", r.stdout + r.stderr
