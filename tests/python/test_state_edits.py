"""What training code does to an optimizer's state between steps, as torch.optim honours it:
writing state[p]["step"] (fill_, assignment), zeroing the moments in place, forgetting entries
(clear, del, pop, an empty dict, a new mapping), assigning copies. emsa's engines keep
their own step counts (on the GPU, in the host tier); an edit must reach them at the next step,
so that 10 more steps equal torch.optim's on the same edits, in step() and in backward, on the
CPU, and on CUDA in the device and the host tier."""

import collections
import copy

import pytest
import torch
from torch import nn

import emsa
from conftest import CPU_PROFILE

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
BEFORE, AFTER = 4, 10


def step_fill(opt):
    for st in opt.state.values():
        st["step"].fill_(1.0)


def step_assign(opt):
    for st in opt.state.values():  # assigning a tensor copies it into emsa's own (as torch's)
        st["step"] = torch.tensor(2.0)


def zero_all(opt):
    """A "reset optimizer" recipe: every state tensor zeroed in place."""
    for st in opt.state.values():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            st[key].zero_()


def zero_one_moment(opt):
    st = next(iter(opt.state.values()))
    st["exp_avg"].zero_()
    st["step"].fill_(3.0)


def clear(opt):
    """Another "reset optimizer" recipe: torch starts every parameter afresh."""
    opt.state.clear()


def delete_one(opt):
    del opt.state[opt.param_groups[0]["params"][0]]


def pop_one(opt):
    opt.state.pop(opt.param_groups[0]["params"][1])


def assign_empty(opt):
    opt.state[opt.param_groups[0]["params"][2]] = {}


def assign_mapping(opt):
    opt.state = collections.defaultdict(dict)


def assign_copy(opt):
    """A parameter's entry replaced by copies of its tensors, scaled (as ZeRO's load assigns)."""
    p = opt.param_groups[0]["params"][0]
    opt.state[p] = {k: v.clone() * (1 if k == "step" else 0.5) for k, v in opt.state[p].items()}


EDITS = {"step_fill": step_fill, "step_assign": step_assign, "zero_all": zero_all,
         "zero_one_moment": zero_one_moment, "clear": clear, "delete_one": delete_one,
         "pop_one": pop_one, "assign_empty": assign_empty, "assign_mapping": assign_mapping,
         "assign_copy": assign_copy}

MODES = [("cpu", "device", False), ("cpu", "device", True)]
CUDA_MODES = [("cuda", tier, inb) for tier in ("device", "host") for inb in (False, True)]


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 32)).to(device)


def _run(device, tier, in_backward, edit, clip):
    model = _model(device)
    ref = copy.deepcopy(model)
    kw = dict(profile=str(CPU_PROFILE)) if device == "cpu" else dict(tier=tier)
    if clip:
        kw["max_grad_norm"] = 0.5
    opt = emsa.AdamW(model.parameters(), **HYPER, step_in_backward=in_backward, **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 64, generator=g).to(device), torch.randn(8, 32, generator=g).to(device))
            for _ in range(BEFORE + AFTER)]
    for k, (x, y) in enumerate(data):
        if k == BEFORE:
            EDITS[edit](opt)
            EDITS[edit](ref_opt)
        for m, o, is_ref in ((model, opt, False), (ref, ref_opt, True)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            if is_ref and clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
    if device == "cuda":
        torch.cuda.synchronize()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = ((p - q).norm() / q.norm()).item()
        assert err <= 1e-6, f"{name}: relative error {err:.2e} after {edit}"
    if device == "cuda":
        opt.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = opt.state[p][key], ref_opt.state[q][key]
            assert ((a - b).norm() / b.norm().clamp_min(1e-30)).item() <= 1e-5, key


@pytest.mark.numerics
@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped"])
@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("device,tier,in_backward", MODES, ids=["step", "in_backward"])
def test_state_edit_equals_torch(device, tier, in_backward, edit, clip):
    _run(device, tier, in_backward, edit, clip)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped"])
@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("device,tier,in_backward", CUDA_MODES,
                         ids=["device-step", "device-in_backward", "host-step",
                              "host-in_backward"])
def test_state_edit_equals_torch_cuda(device, tier, in_backward, edit, clip):
    _run(device, tier, in_backward, edit, clip)


def test_step_count_version_is_one_comparison():
    """The edit check reads one version counter: the views of "step" share their storage's."""
    model = _model("cpu")
    opt = emsa.AdamW(model.parameters(), **HYPER, profile=str(CPU_PROFILE))
    nn.functional.mse_loss(model(torch.randn(2, 64)), torch.randn(2, 32)).backward()
    opt.step()
    views = [st["step"] for st in opt.state.values()]
    base = views[0]._base
    assert base is not None and all(v._base is base for v in views)
    before = base._version
    views[-1].fill_(7.0)
    assert base._version != before


def _with_unused(device="cpu"):
    """A model whose last parameter never gets a gradient (torch keeps no state for it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4)).to(device)
    model.unused = nn.Parameter(torch.randn(5, device=device))
    return model


def _one_step(model, opt, device="cpu"):
    opt.zero_grad()
    model[1](model[0](torch.randn(3, 16, device=device))).square().mean().backward()
    opt.step()


def _layout(sd):
    """A state_dict's shape: each entry's keys and step, by parameter index."""
    return {k: (sorted(v), float(v["step"]) if "step" in v else None)
            for k, v in sd["state"].items()}


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
def test_entries_appear_at_the_first_update_as_torch(in_backward):
    """No entry before a parameter's first update, none for one that never gets a gradient;
    state_dict() lists the same entries as torch's, before and after a clear()."""
    model = _with_unused()
    ref = copy.deepcopy(model)
    opt = emsa.AdamW(model.parameters(), **HYPER, profile=str(CPU_PROFILE),
                     step_in_backward=in_backward)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    assert len(opt.state) == 0 and _layout(opt.state_dict()) == {}
    for _ in range(2):
        torch.manual_seed(3)
        _one_step(model, opt)
        torch.manual_seed(3)
        _one_step(ref, ref_opt)
    assert model.unused not in opt.state
    assert _layout(opt.state_dict()) == _layout(ref_opt.state_dict())
    assert len(_layout(opt.state_dict())) == 4
    opt.state.clear()
    ref_opt.state.clear()
    assert _layout(opt.state_dict()) == _layout(ref_opt.state_dict()) == {}
    torch.manual_seed(4)
    _one_step(model, opt)
    torch.manual_seed(4)
    _one_step(ref, ref_opt)
    assert _layout(opt.state_dict()) == _layout(ref_opt.state_dict())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_empty_entry_round_trips_as_torch():
    """opt.state[p] = {} is kept as torch keeps it (state_dict lists {}), loads back, and that
    parameter starts afresh at the next update."""
    model = _with_unused()
    ref = copy.deepcopy(model)
    opt = emsa.AdamW(model.parameters(), **HYPER, profile=str(CPU_PROFILE))
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    for m, o in ((model, opt), (ref, ref_opt)):
        torch.manual_seed(3)
        _one_step(m, o)
        o.state[m[0].weight] = {}
    sd = opt.state_dict()
    assert _layout(sd) == _layout(ref_opt.state_dict())
    assert sd["state"][1] == {}  # model[0].weight: the second parameter
    opt.load_state_dict(ref_opt.state_dict())
    for m, o in ((model, opt), (ref, ref_opt)):
        torch.manual_seed(5)
        _one_step(m, o)
    assert _layout(opt.state_dict()) == _layout(ref_opt.state_dict())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_wrong_entry_assignment_changes_nothing():
    model = _with_unused()
    opt = emsa.AdamW(model.parameters(), **HYPER, profile=str(CPU_PROFILE))
    _one_step(model, opt)
    p = model[0].weight
    before = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match="emsa expects"):
        opt.state[p] = {"step": torch.tensor(3.0)}
    with pytest.raises(ValueError, match="shape"):
        opt.state[p] = {**before, "exp_avg": torch.zeros(3)}
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("cls,key,value", [
    ("AdamW", "decoupled_weight_decay", False), ("Adam", "decoupled_weight_decay", True),
    ("AdamW", "amsgrad", True)])
@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
def test_fixed_group_key_changed_mid_run_is_refused(cls, key, value, in_backward):
    """torch reads these keys at every step; emsa fixes them when it is built, so a change is
    refused at the next step (or pass) before anything changes, never ignored."""
    model = _with_unused()
    opt = getattr(emsa, cls)(model.parameters(), **HYPER, profile=str(CPU_PROFILE),
                             step_in_backward=in_backward)
    _one_step(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=key):
        _one_step(model, opt)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


def test_state_copies_are_plain_and_detached():
    """copy() and copy.deepcopy of opt.state are plain defaultdicts: editing them changes
    nothing in emsa, as a copy of torch's state changes nothing in torch."""
    model = _with_unused()
    opt = emsa.AdamW(model.parameters(), **HYPER, profile=str(CPU_PROFILE))
    _one_step(model, opt)
    p = model[0].weight
    for dup in (opt.state.copy(), copy.deepcopy(opt.state)):
        assert type(dup) is collections.defaultdict and len(dup) == len(opt.state) == 4
    assert set(opt.state.copy()) == set(opt.state)
    deep = copy.deepcopy(opt.state)  # its keys are copies of the parameters too
    next(iter(deep.values()))["exp_avg"].fill_(5.0)
    deep.clear()
    assert p in opt.state and not torch.equal(opt.state[p]["exp_avg"],
                                              torch.full_like(p, 5.0))
