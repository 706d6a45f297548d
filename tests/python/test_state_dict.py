"""state_dict interchange with torch.optim.AdamW, both directions, and its error messages."""

import copy
import io

import pytest
import torch
from torch.testing import assert_close

import emsa
from models import LionReference, TinyGPT, gpt_batches, gpt_loss, param_groups

HYPER = dict(lr=3e-3, betas=(0.9, 0.95))


def train(model, opt, batches):
    for batch in batches:
        opt.zero_grad()
        gpt_loss(model, batch).backward()
        opt.step()


def saved(state_dict):
    """As a checkpoint would carry it: through torch.save and torch.load."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)


def start(make_opt, steps=10):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = make_opt(model)
    batches = gpt_batches(steps + 10)
    train(model, opt, batches[:steps])
    return model, opt, batches[steps:]


def assert_models_close(a, b, rtol=1e-6, atol=1e-8):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_layout_matches_torch():
    model, opt, _ = start(lambda m: emsa.AdamW(param_groups(m), **HYPER), steps=1)
    ref_model, ref_opt, _ = start(lambda m: torch.optim.AdamW(param_groups(m), **HYPER), 1)
    ours, ref = opt.state_dict(), ref_opt.state_dict()
    assert ours["param_groups"] == ref["param_groups"]
    assert sorted(ours["state"]) == sorted(ref["state"])
    for k, st in ref["state"].items():
        assert list(ours["state"][k]) == list(st)
        assert ours["state"][k]["step"].dtype == st["step"].dtype == torch.float32
        assert ours["state"][k]["step"].dim() == 0
        for key in ("exp_avg", "exp_avg_sq"):
            assert ours["state"][k][key].shape == st[key].shape


@pytest.mark.numerics
@pytest.mark.parametrize("direction", ["emsa_to_torch", "torch_to_emsa"])
def test_switching_continues_like_never_switching(direction):
    ours_first = direction == "emsa_to_torch"
    first = (lambda m: emsa.AdamW(param_groups(m), **HYPER)) if ours_first else (
        lambda m: torch.optim.AdamW(param_groups(m), **HYPER))
    second_cls = torch.optim.AdamW if ours_first else emsa.AdamW
    model, opt, rest = start(first)
    checkpoint = saved(opt.state_dict())
    switched = copy.deepcopy(model)
    opt2 = second_cls(param_groups(switched), **HYPER)
    opt2.load_state_dict(checkpoint)
    for p, q in zip(model.parameters(), switched.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key])
    train(model, opt, rest)  # never switching
    train(switched, opt2, rest)
    assert_models_close(model, switched)


def round_trip(make_opt, make_ref):
    """emsa continued from its own checkpoint gives the bits of never stopping, and both are
    what the reference optimizer, continued from the same checkpoint, computes."""
    model, opt, rest = start(make_opt)
    checkpoint = saved(opt.state_dict())
    other, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt2, ref_opt = make_opt(other), make_ref(ref)
    opt2.load_state_dict(checkpoint)
    ref_opt.load_state_dict(checkpoint)
    for m, o in ((model, opt), (other, opt2), (ref, ref_opt)):
        train(m, o, rest)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
    assert_models_close(model, ref)


@pytest.mark.numerics
def test_emsa_round_trip_is_bitwise():
    round_trip(lambda m: emsa.AdamW(param_groups(m), **HYPER),
               lambda m: torch.optim.AdamW(param_groups(m), **HYPER))


@pytest.mark.numerics
def test_lion_round_trip_is_bitwise():
    round_trip(lambda m: emsa.Lion(m.parameters(), lr=1e-4),
               lambda m: LionReference(m.parameters(), lr=1e-4))


def test_state_dict_hyperparameters_are_loaded():
    model, opt, _ = start(lambda m: torch.optim.AdamW(m.parameters(), lr=0.5, eps=1e-6), 1)
    ours = emsa.AdamW(model.parameters())
    ours.load_state_dict(opt.state_dict())
    assert ours.param_groups[0]["lr"] == 0.5 and ours.param_groups[0]["eps"] == 1e-6


def snapshot(opt):
    return {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}


def assert_unchanged(opt, before):
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, before[id(p)][k]), k


def test_bad_state_dicts_are_refused_and_change_nothing():
    model, opt, _ = start(lambda m: emsa.AdamW(m.parameters(), **HYPER), 2)
    good = saved(opt.state_dict())
    before = snapshot(opt)

    wrong_shape = copy.deepcopy(good)
    wrong_shape["state"][3]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"exp_avg is \(7,\), the parameter is"):
        opt.load_state_dict(wrong_shape)

    ams = copy.deepcopy(good)
    ams["state"][0]["max_exp_avg_sq"] = torch.zeros_like(ams["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(ams)

    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(gpt_batches(1)[0][0]).sum().backward()
    sgd.step()
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt.load_state_dict(sgd.state_dict())

    fewer = copy.deepcopy(good)
    fewer["param_groups"][0]["params"] = fewer["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match="same parameter groups"):
        opt.load_state_dict(fewer)

    adam = copy.deepcopy(good)
    adam["param_groups"][0]["decoupled_weight_decay"] = False
    with pytest.raises(ValueError, match="load it into emsa.Adam"):
        opt.load_state_dict(adam)
    assert_unchanged(opt, before)


def test_load_before_first_step_and_into_bf16_state():
    model, opt, rest = start(lambda m: torch.optim.AdamW(m.parameters(), **HYPER))
    ours = emsa.AdamW(copy.deepcopy(model).parameters(), state_dtype=torch.bfloat16, **HYPER)
    ours.load_state_dict(saved(opt.state_dict()))
    for p, q in zip(model.parameters(), ours.param_groups[0]["params"]):
        got = ours.state[q]["exp_avg"]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, opt.state[p]["exp_avg"].to(torch.bfloat16))
        assert ours.state[q]["step"].item() == 10


@pytest.mark.numerics
def test_assigning_a_state_tensor_writes_into_emsas_and_state_dict_stays_plain(tmp_path):
    """opt.state[p][key] = t copies t into emsa's own tensor (the engine's memory), as Lightning
    does when it moves optimizer state to the model's device: the next steps use the values
    assigned, as torch's with the same assignment do. A wrong shape is refused, nothing changed;
    state_dict() is plain dicts, which torch.load(weights_only=True) reads."""
    torch.manual_seed(0)
    ours = torch.nn.Linear(8, 4)
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict(ours.state_dict())
    opt = emsa.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(16, 8)
    for m, o in ((ours, opt), (ref, ref_opt)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
    held = opt.state[ours.weight]["exp_avg"]
    new = torch.full_like(held, 0.5, dtype=torch.float64)  # converted to emsa's dtype
    opt.state[ours.weight]["exp_avg"] = new
    ref_opt.state[ref.weight]["exp_avg"] = new.float()
    assert opt.state[ours.weight]["exp_avg"] is held and torch.equal(held, new.float())
    with pytest.raises(ValueError, match="shape"):
        opt.state[ours.weight]["exp_avg_sq"] = torch.zeros(3)
    assert opt.state[ours.weight]["exp_avg_sq"].shape == ours.weight.shape
    for m, o in ((ours, opt), (ref, ref_opt)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    assert all(type(v) is dict for v in loaded["state"].values())
    ref_opt.load_state_dict(loaded)  # torch's AdamW takes it
