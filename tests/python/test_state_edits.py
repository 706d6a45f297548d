"""What training code does to an optimizer's state between steps, as torch.optim honours it:
writing state[p]["step"] (fill_, assignment), zeroing the moments in place. emsa's engines keep
their own step counts (on the GPU, in the host tier); an edit must reach them at the next step,
so that 10 more steps equal torch.optim's on the same edits, in step() and in backward, on the
CPU, and on CUDA in the device and the host tier."""

import copy

import pytest
import torch
from torch import nn

import emsa
from conftest import CPU_PROFILE

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
BEFORE, AFTER = 4, 10


def step_fill(state):
    for st in state.values():
        st["step"].fill_(1.0)


def step_assign(state):
    for st in state.values():  # assigning a tensor copies it into emsa's own (as torch keeps it)
        st["step"] = torch.tensor(2.0)


def zero_all(state):
    """A "reset optimizer" recipe: every state tensor zeroed in place."""
    for st in state.values():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            st[key].zero_()


def zero_one_moment(state):
    st = next(iter(state.values()))
    st["exp_avg"].zero_()
    st["step"].fill_(3.0)


EDITS = {"step_fill": step_fill, "step_assign": step_assign, "zero_all": zero_all,
         "zero_one_moment": zero_one_moment}

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
            EDITS[edit](opt.state)
            EDITS[edit](ref_opt.state)
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
