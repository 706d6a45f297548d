"""What bench/probe_setup.py and bench/probe_passes.py share: their command line (--out) and
their model, one 0.95 B Llama (bench/offload_e2e.py's) on cuda:0 with one batch of 4 x 512
random tokens, and the JSON record that starts with the run's provenance and that shape."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offload_e2e as oe  # noqa: E402

BATCH, SEQ = 4, 512


def llama_1b(benchmark: str, description: str):
    """Parses --out (default BENCHMARK.json), builds the model and its batch; returns
    (args, device, model, ids, out), out the record to add the measurements to."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=f"{benchmark}.json")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    model = oe.make_llama(oe.LLAMA_1B, dev)
    ids = oe.token_batches(32000, BATCH, SEQ, 1, dev)[0]
    out: dict = oe.provenance(benchmark, dev)
    out.update(model=oe.LLAMA_1B, batch=BATCH, seq=SEQ)
    return args, dev, model, ids, out
