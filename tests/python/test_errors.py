"""Bad input gets a clear error (checked by its message) and changes nothing."""

import copy
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import emsa
from conftest import (CPU_PROFILE, ROOT, assert_unchanged, requires_cuda, snapshot,
                      subprocess_env)
from models import SmallCNN, cnn_batches, cnn_loss


def stepped(model, opt, n=1):
    for batch in cnn_batches(n):
        opt.zero_grad()
        cnn_loss(model, batch).backward()
        opt.step()


def test_sparse_gradients():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = emsa.AdamW(emb.parameters())
    before = emb.weight.detach().clone()
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradient.*SparseAdam"):
        opt.step()
    assert torch.equal(emb.weight, before)


def test_float64_parameters():
    with pytest.raises(ValueError, match=r"torch.float64.*cast the model \(model.float\(\)\)"):
        emsa.AdamW(nn.Linear(2, 2).double().parameters())
    with pytest.raises(ValueError, match="float64"):
        emsa.probe(nn.Linear(2, 2).double(), torch.randn(1, 2, dtype=torch.float64))


def test_complex_parameters():
    p = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex64.*view_as_real"):
        emsa.Adam([p])


def test_parameters_on_two_devices():
    a = nn.Parameter(torch.randn(3))
    b = nn.Parameter(torch.randn(3, device="meta"))
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\).*one optimizer per"):
        emsa.AdamW([a, b])
    with pytest.raises(ValueError, match="several devices"):
        emsa.AdamW([{"params": [a]}, {"params": [b]}])


@requires_cuda
def test_parameters_on_cpu_and_cuda():
    with pytest.raises(ValueError, match="several devices"):
        emsa.AdamW([nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3, device="cuda"))])


def test_parameter_reshaped_after_planning():
    model = SmallCNN()
    opt = emsa.AdamW(model.parameters())
    stepped(model, opt)
    before = snapshot(model, opt)
    model.fc.weight.data = model.fc.weight.data.reshape(5, 32)
    model.fc.weight.grad = torch.ones(5, 32)
    with pytest.raises(ValueError, match=r"changed from \(10, 16\) to \(5, 32\).*new optimizer"):
        opt.step()
    model.fc.weight.data = model.fc.weight.data.reshape(10, 16)
    assert_unchanged(model, opt, before)


@pytest.mark.numerics
def test_parameter_storage_replaced_is_followed():
    torch.manual_seed(0)
    model = SmallCNN()
    ref = copy.deepcopy(model)
    opt = emsa.AdamW(model.parameters())
    ref_opt = torch.optim.AdamW(ref.parameters())
    for m, o in ((model, opt), (ref, ref_opt)):
        stepped(m, o)
    model.fc.weight.data = model.fc.weight.data.clone()  # same shape, new memory
    for m, o in ((model, opt), (ref, ref_opt)):
        stepped(m, o)
    for p, q in zip(model.parameters(), ref.parameters()):  # updated in its new memory
        assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_parameter_added_after_planning():
    model = SmallCNN()
    opt = emsa.AdamW(model.parameters())
    stepped(model, opt)
    with pytest.raises(ValueError, match="build a new optimizer"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(2))]})
    assert len(opt.param_groups) == 1
    before = snapshot(model, opt)
    extra = nn.Parameter(torch.randn(2))
    opt.param_groups[0]["params"].append(extra)
    extra.grad = torch.ones(2)
    n = len(list(model.parameters()))
    with pytest.raises(ValueError, match=rf"hold \[{n + 1}\] parameters but emsa planned \[{n}\]"):
        opt.step()
    opt.param_groups[0]["params"].pop()
    opt.param_groups[0]["params"][0] = nn.Parameter(model.conv1.weight.detach().clone())
    with pytest.raises(ValueError, match="replaced by another tensor"):
        opt.step()
    assert_unchanged(model, opt, before)


def test_groups_added_before_planning_are_planned():
    model = SmallCNN()
    opt = emsa.AdamW(model.conv1.parameters())
    opt.add_param_group({"params": model.fc.parameters(), "lr": 0.0})
    before = model.fc.weight.detach().clone()
    stepped(model, opt)
    assert torch.equal(model.fc.weight, before)  # lr 0 in its group
    assert opt.state[model.fc.weight]["step"].item() == 1


def test_nonfinite_gradients_skip_the_step_and_change_nothing():
    model = SmallCNN()
    opt = emsa.AdamW(model.named_parameters(), lr=1e-2)
    stepped(model, opt, 2)
    before = snapshot(model, opt)
    opt.zero_grad()
    cnn_loss(model, cnn_batches(1)[0]).backward()
    model.bn2.bias.grad[3] = float("nan")
    model.fc.weight.grad[0, 0] = float("inf")
    with pytest.warns(RuntimeWarning, match=r"step skipped: 2 non-finite gradient elements "
                                            r"\(first in bn2.bias\)"):
        opt.step()
    assert opt.last_step_skipped
    assert_unchanged(model, opt, before)
    assert opt.state[model.fc.weight]["step"].item() == 2
    opt.zero_grad()
    cnn_loss(model, cnn_batches(1)[0]).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # a good step goes through again
    assert not opt.last_step_skipped
    assert opt.state[model.fc.weight]["step"].item() == 3


@pytest.mark.numerics
def test_nonfinite_gradients_applied_when_asked_like_torch():
    p = nn.Parameter(torch.ones(4))
    q = nn.Parameter(torch.ones(4))
    opt = emsa.AdamW([p], skip_nonfinite=False)
    p.grad = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    q.grad = p.grad.clone()
    opt.step()
    torch.optim.AdamW([q]).step()
    assert not opt.last_step_skipped
    assert torch.isnan(p[1]) and torch.isfinite(p[0])
    assert_close(p, q, rtol=1e-6, atol=0, equal_nan=True)


def test_budget_that_cannot_fit():
    model = SmallCNN()
    opt = emsa.AdamW(model.parameters(), budget="1KiB")
    model(cnn_batches(1)[0][0]).sum().backward()
    with pytest.raises(emsa.InfeasibleBudgetError, match="smallest budget that works") as e:
        opt.step()
    assert e.value.min_budget_bytes > 1024
    assert opt.plan is None
    # The minimum it names works, on a profile of another machine too.
    ok = emsa.AdamW(model.parameters(), budget=e.value.min_budget_bytes)
    ok.step()
    record = emsa.probe(model, cnn_batches(1)[0][0], profile=str(CPU_PROFILE))
    with pytest.raises(emsa.InfeasibleBudgetError, match="smallest budget"):
        emsa.AdamW(model.parameters(), probe=record, budget=1000, profile=str(CPU_PROFILE))


def test_bad_budget_text():
    with pytest.raises(emsa.EmsaError, match="lots"):
        emsa.AdamW(nn.Linear(2, 2).parameters(), budget="lots")


@pytest.mark.parametrize("cls,name", [(emsa.AdamW, "AdamW"), (emsa.Adam, "Adam")])
def test_amsgrad_refused(cls, name):
    with pytest.raises(ValueError, match=rf"use torch.optim.{name}\(amsgrad=True\)"):
        cls(nn.Linear(2, 2).parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        cls([{"params": nn.Linear(2, 2).parameters(), "amsgrad": True}])


@pytest.mark.parametrize("option,match", [
    ("capturable", "CUDA graph capture"), ("differentiable", "not: use torch.optim"),
])
def test_torch_implementation_options_refused(option, match):
    with pytest.raises(ValueError, match=match):
        emsa.AdamW(nn.Linear(2, 2).parameters(), **{option: True})
    emsa.AdamW(nn.Linear(2, 2).parameters(), **{option: False})


@pytest.mark.numerics
@pytest.mark.parametrize("cls", ["AdamW", "Adam"])
@pytest.mark.parametrize("impl", [{"fused": True}, {"foreach": True}, {"fused": False},
                                  {"foreach": False, "fused": False}])
def test_fused_and_foreach_accepted_as_torch_takes_them(cls, impl):
    """Scripts pass fused=/foreach= to torch's AdamW by habit: emsa takes either value, with
    the same result as torch given the same options, and refuses both True as torch does."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ref = copy.deepcopy(model)
    opt = getattr(emsa, cls)(model.parameters(), lr=1e-2, weight_decay=0.1, **impl)
    ref_opt = getattr(torch.optim, cls)(ref.parameters(), lr=1e-2, weight_decay=0.1, **impl)
    for _ in range(5):
        x = torch.randn(3, 8)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert opt.param_groups[0]["fused"] == ref_opt.param_groups[0]["fused"]
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        getattr(torch.optim, cls)(nn.Linear(2, 2).parameters(), fused=True, foreach=True)
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        getattr(emsa, cls)(nn.Linear(2, 2).parameters(), fused=True, foreach=True)
    with pytest.raises(ValueError, match="None, True or False"):
        getattr(emsa, cls)([{"params": nn.Linear(2, 2).parameters(), "fused": "yes"}])


def test_invalid_hyperparameters():
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="Invalid learning rate"):
        emsa.AdamW(params, lr=-1.0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        emsa.AdamW(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps > 0"):
        emsa.Adam(params, eps=0.0)
    with pytest.raises(ValueError, match="Invalid weight_decay"):
        emsa.Lion(params, weight_decay=-0.1)
    with pytest.raises(ValueError, match="torch.float32 or torch.bfloat16"):
        emsa.AdamW(params, state_dtype=torch.float16)


def test_not_picklable():
    opt = emsa.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match="save and load opt.state_dict"):
        pickle.dumps(opt)


@pytest.mark.wheel
def test_missing_library_is_a_clear_error_at_first_use():
    code = ("import torch, emsa\n"
            "for first_use in (lambda: emsa.AdamW(torch.nn.Linear(2, 2).parameters()),\n"
            "                  lambda: emsa.probe(torch.nn.Linear(2, 2), torch.ones(1, 2)),\n"
            "                  lambda: emsa.parse_bytes('1GiB')):\n"
            "    try:\n"
            "        first_use()\n"
            "    except emsa.EmsaLibraryError as e:\n"
            "        print('ERR', e)\n")
    env = subprocess_env(EMSA_LIBRARY="/nonexistent/libemsa.so")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 3  # importing emsa needs no library; each first use says what to do
    for line in lines:
        assert line.startswith("ERR libemsa.so not found (tried /nonexistent/libemsa.so)")
        assert "point EMSA_LIBRARY at it" in line
