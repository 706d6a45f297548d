"""pytest setup: import emsa from python/ and find the library in the repo's build folders."""

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if "EMSA_LIBRARY" not in os.environ:
    for build in ("build-py", "build"):
        candidate = ROOT / build / "libemsa.so"
        if candidate.exists():
            os.environ["EMSA_LIBRARY"] = str(candidate)
            break

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU_PROFILE = ROOT / "examples" / "profiles" / "h200.json"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "numerics: compares emsa's updates with torch.optim or a float64 reference; "
        "scripts/test requires these to fail against a build whose update does nothing")
