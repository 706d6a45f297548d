"""pytest setup: import emsa from python/ and find the library in the repo's build folders; or,
with --installed, test the installed package (`pip install .`) as a user has it: nothing added
to the path, no library named."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
INSTALLED = False  # set by pytest_configure from --installed
_CACHE = ""  # the tests' own cache folder (XDG_CACHE_HOME), made by pytest_configure


def pytest_addoption(parser):
    parser.addoption("--installed", action="store_true",
                     help="test the installed emsa package: no python/ on sys.path, no "
                          "EMSA_LIBRARY set (run from outside the source tree)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "wheel: what can differ in the installed package (the packaged library is "
        "found and loads, the console script, every module shipped, a smoke of the numerics): "
        "with --installed only these run; the rest test the same code as the source tree")
    config.addinivalue_line(
        "markers", "numerics: compares emsa's updates with torch.optim or a float64 reference; "
        "scripts/test requires these to fail against a build whose update does nothing")
    global INSTALLED
    # emsa keeps the machine's measured profile under $XDG_CACHE_HOME/emsa: tests (and the
    # processes they start) write theirs into a folder of their own, never the user's.
    global _CACHE
    _CACHE = tempfile.mkdtemp(prefix="emsa-test-cache-")
    os.environ["XDG_CACHE_HOME"] = _CACHE
    INSTALLED = config.getoption("--installed")
    if INSTALLED:
        return
    sys.path.insert(0, str(ROOT / "python"))
    if "EMSA_LIBRARY" not in os.environ:
        for build in ("build-py", "build"):
            candidate = ROOT / build / "libemsa.so"
            if candidate.exists():
                os.environ["EMSA_LIBRARY"] = str(candidate)
                break


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--installed"):
        return
    keep = [item for item in items if item.get_closest_marker("wheel")]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def pytest_unconfigure(config):
    if _CACHE:
        shutil.rmtree(_CACHE, ignore_errors=True)


def subprocess_env(**extra) -> dict:
    """The environment for a child Python that should import the emsa these tests import."""
    env = dict(os.environ, **extra)
    if not INSTALLED:
        env["PYTHONPATH"] = str(ROOT / "python")
    return env


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU_PROFILE = ROOT / "examples" / "profiles" / "h200.json"


# ---- helpers the test files share --------------------------------------------------------------
def snapshot(model, opt):
    """Copies of the model's parameters and of the optimizer's state, for assert_unchanged."""
    return ([p.detach().clone() for p in model.parameters()],
            {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()})


def assert_unchanged(model, opt, before):
    """Every parameter and every state tensor is bitwise what snapshot(model, opt) copied (and
    no parameter has state that it had not then)."""
    params, state = before
    for (name, p), q in zip(model.named_parameters(), params):
        assert torch.equal(p, q), f"{name} changed"
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, state[id(p)][k]), f"state {k} changed"
