"""PyTorch's own optimizer inputs for AdamW and Adam (torch.testing._internal.common_optimizers,
with the foreach/fused/differentiable variants torch tests them with), each run against
torch.optim on the same model: every configuration emsa accepts equals torch after 10 steps
(within 1e-6 relative), or emsa refuses it at construction with a message that names the
option. torch's own construction-error inputs raise the same error type in emsa (or, for a
tensor lr or betas torch's foreach path cannot take, update as torch does with them as floats). A summary of
what was equal and what refused is printed (pytest -s). CPU here; CUDA on a GPU host."""

from __future__ import annotations

import copy

import pytest
import torch

import emsa
from conftest import CPU_PROFILE

_frozen = torch.backends.flags_frozen()
common = pytest.importorskip("torch.testing._internal.common_optimizers",
                             reason="needs expecttest (scripts/lib/setup.sh installs it)")
if not _frozen:  # torch's test utilities freeze the backend flags on import: unfreeze them
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

STEPS = 10
# What emsa refuses today, each named in its message; anything else refused fails.
REFUSED_OPTIONS = {"amsgrad", "capturable", "differentiable"}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _infos():
    return [i for i in common.optim_db if i.optim_cls in (torch.optim.AdamW, torch.optim.Adam)]


def _cases():
    out = []
    for info in _infos():
        for device in DEVICES:
            inputs = common._get_optim_inputs_including_global_cliquey_kwargs(
                device, torch.float32, info)
            for k, inp in enumerate(inputs):
                flags = "-".join(f for f in ("foreach", "fused", "differentiable")
                                 if inp.kwargs.get(f))
                # The numerics mark (the no-op-update mutation check) only where emsa updates:
                # a refusal is checked by its message, which a no-op update cannot change.
                refused = any(inp.kwargs.get(k) for k in REFUSED_OPTIONS)
                out.append(pytest.param(info.optim_cls.__name__, device, inp.kwargs,
                                        marks=() if refused else pytest.mark.numerics,
                                        id=f"{info.optim_cls.__name__}-{device}-{k}-"
                                           f"{inp.desc.replace(' ', '_')}-{flags or 'plain'}"))
    return out


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(),
                               torch.nn.Linear(10, 3)).to(device)


def _kwargs(kwargs, device):
    """A fresh copy of a case's kwargs (tensor lr and betas on the case's device)."""
    out = copy.deepcopy(kwargs)
    for key in ("lr", "betas"):
        if key in out:
            v = out[key]
            out[key] = (tuple(b.to(device) if torch.is_tensor(b) else b for b in v)
                        if isinstance(v, tuple) else v.to(device) if torch.is_tensor(v) else v)
    return out


def _emsa(cls, params, kwargs, device):
    extra = dict(profile=str(CPU_PROFILE)) if device == "cpu" else {}
    return getattr(emsa, cls)(params, **_kwargs(kwargs, device), **extra)


_SUMMARY: dict[str, list[str]] = {"equal": [], "refused": []}


@pytest.mark.parametrize("cls,device,kwargs", _cases())
def test_torch_optimizer_input_equals_torch(cls, device, kwargs, request):
    model = _model(device)
    ref = copy.deepcopy(model)
    try:
        opt = _emsa(cls, model.parameters(), kwargs, device)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        named = sorted(k for k in REFUSED_OPTIONS if kwargs.get(k) and k in str(e))
        assert named, f"refused with a message naming none of {sorted(REFUSED_OPTIONS)}: {e}"
        _SUMMARY["refused"].append(request.node.callspec.id)
        return
    ref_opt = getattr(torch.optim, cls)(ref.parameters(), **_kwargs(kwargs, device))
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(6, 12, generator=g).to(device)
        y = torch.randn(6, 3, generator=g).to(device)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    if device == "cuda":
        torch.cuda.synchronize()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = ((p - q).norm() / q.norm()).item()
        assert err <= 1e-6, f"{name}: relative difference {err:.2e} from torch.optim.{cls}"
    _SUMMARY["equal"].append(request.node.callspec.id)


def _error_cases():
    out = []
    for info in _infos():
        for e in info.optim_error_inputs_func("cpu", torch.float32):
            if e.error_on != common.OptimizerErrorEnum.CONSTRUCTION_ERROR:
                continue
            out.append(pytest.param(info.optim_cls.__name__, e,
                                    id=f"{info.optim_cls.__name__}-{e.optimizer_error_input.desc}"))
    return out


def _floated(kwargs):
    """kwargs with tensor lr and betas as floats and torch's own implementation picked: the
    same update, in a form torch accepts."""
    out = {k: v for k, v in kwargs.items() if k not in ("foreach", "fused")}
    if torch.is_tensor(out.get("lr")):
        out["lr"] = float(out["lr"])
    if "betas" in out:
        out["betas"] = tuple(float(b) for b in out["betas"])
    return out


@pytest.mark.parametrize("cls,error", _error_cases())
def test_torch_error_input_raises_as_torch(cls, error, recwarn):
    """torch's construction errors and warnings: emsa raises the same type, or warns the same,
    or refuses with ValueError where torch only warns (a parameter listed twice). Where torch
    refuses a tensor lr or betas only because its foreach path cannot take them, emsa (whose
    step takes them in any form) accepts, and its update equals torch's with the same values as
    floats."""
    inp = error.optimizer_error_input
    kind = error.error_type

    def params():
        return inp.params if inp.params is not None else _model("cpu").parameters()

    torch_raised = None
    try:
        getattr(torch.optim, cls)(params(), **copy.deepcopy(inp.kwargs))
    except Exception as e:  # noqa: BLE001 - the type is compared below
        torch_raised = e
    if issubclass(kind, Warning):
        assert torch_raised is None and any(issubclass(w.category, kind) for w in recwarn)
        recwarn.clear()
        try:
            getattr(emsa, cls)(params(), **inp.kwargs, profile=str(CPU_PROFILE))
        except ValueError:
            return  # refused outright, with its own message
        assert any(issubclass(w.category, kind) for w in recwarn), f"emsa did not warn {kind}"
        return
    assert isinstance(torch_raised, kind), f"torch raised {torch_raised!r}, expected {kind}"
    tensor_hyper = any(torch.is_tensor(v) for v in [inp.kwargs.get("lr"),
                                                     *inp.kwargs.get("betas", ())])
    try:
        model = _model("cpu")
        given = inp.params if inp.params is not None else model.parameters()
        opt = getattr(emsa, cls)(given, **inp.kwargs, profile=str(CPU_PROFILE))
    except kind:
        return
    assert tensor_hyper and inp.params is None, (
        f"emsa accepted what torch refuses: {torch_raised}")
    ref = _model("cpu")
    ref_opt = getattr(torch.optim, cls)(ref.parameters(), **_floated(inp.kwargs))
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(6, 12, generator=g), torch.randn(6, 3, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert ((p - q).norm() / q.norm()).item() <= 1e-6


def test_conformance_summary():
    """Printed last: how many of torch's inputs equal torch, how many emsa refuses."""
    if not _SUMMARY["equal"] and not _SUMMARY["refused"]:
        pytest.skip("no conformance case ran in this session")
    print(f"\nconformance: {len(_SUMMARY['equal'])} equal to torch, "
          f"{len(_SUMMARY['refused'])} refused at construction")
    for name in _SUMMARY["refused"]:
        print("  refused:", name)
