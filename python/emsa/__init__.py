"""emsa: Early Memory Selection for Balanced Adam — the PyTorch front end.

    record = emsa.probe(model, batch)                 # one dry-run forward+backward
    opt = emsa.AdamW(model.parameters(), lr=3e-4, probe=record, budget="20GiB")
    print(opt.plan)                                   # where every byte of state lives

The math, planning and memory live in the C++ core (libemsa), reached through the declared
ctypes table in emsa._native; this package stays thin. The library is loaded at first use: a
missing or mismatched one raises EmsaLibraryError saying what to do.
"""

from ._native.library import EmsaError, EmsaLibraryError
from .optimizers import Adam, AdamW, Lion
from .plan import InfeasibleBudgetError, Plan, make_plan, measure_profile, parse_bytes
from .probe import default_loss, probe
from .probe_record import GraphOp, MemorySample, ParamRecord, ProbeRecord

__version__ = "0.1.0"


def __getattr__(name):
    # emsa.EmsaTrainerCallback (emsa.hf) imports transformers: only when asked for, and not in
    # __all__, so that `from emsa import *` works without transformers installed.
    if name == "EmsaTrainerCallback":
        from .hf import EmsaTrainerCallback

        return EmsaTrainerCallback
    raise AttributeError(f"module 'emsa' has no attribute {name!r}")


__all__ = [
    "Adam",
    "AdamW",
    "EmsaError",
    "EmsaLibraryError",
    "GraphOp",
    "InfeasibleBudgetError",
    "Lion",
    "MemorySample",
    "ParamRecord",
    "Plan",
    "ProbeRecord",
    "default_loss",
    "make_plan",
    "measure_profile",
    "parse_bytes",
    "probe",
]
