"""What a user who ran `pip install .` does first: import emsa, step a parameter that has no
gradient yet (torch.optim skips it), and the same with torch.optim.AdamW beside it; and that the
package holds every module of the source tree. With --installed these run against the wheel."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import emsa
from conftest import ROOT, subprocess_env

pytestmark = pytest.mark.wheel


def test_every_module_of_the_source_tree_is_in_the_package():
    source = ROOT / "python" / "emsa"
    names = []
    for path in sorted(source.rglob("*.py")):
        parts = list(path.relative_to(source.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    missing = []
    for name in names:
        if name in ("emsa.hf", "emsa.lightning"):
            continue  # they import transformers / lightning, which the wheel does not need
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name}: {e}")
    assert missing == []
    assert Path(emsa.__file__).resolve().parent.name == "emsa"


def test_the_first_line_a_user_types_runs():
    code = ("import emsa, torch; emsa.AdamW([torch.nn.Parameter(torch.randn(4))]).step(); "
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr


def test_parameters_without_a_gradient_are_skipped_as_torch_does():
    torch.manual_seed(0)
    mine = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    opt = emsa.AdamW(mine, lr=0.1, weight_decay=0.01)
    peer = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01)
    for step in range(4):
        # The middle parameter never has a gradient; the last gets one from step 2 on.
        for group in (mine, ref):
            group[0].grad = torch.full((5,), 0.5 * (step + 1))
            group[2].grad = torch.full((5,), -1.0) if step >= 2 else None
        opt.step()
        peer.step()
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    assert torch.equal(mine[1].detach(), ref[1].detach())
