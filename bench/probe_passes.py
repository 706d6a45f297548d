"""How much the probe's timed passes vary, alone and under emsa::HostLoad (issue 5).

One 0.95 B Llama (bench/offload_e2e.py's, 4 x 512 tokens, bf16 autocast) on the GPU; the probe's
own timed pass (forward + backward, CUDA events) run: alone and under the full load, three times
over; under the load after it has run 0.5 s; under parts of it (the CPU update only; the copies
with the update in cache; the update in cache only); alone and loaded in turn; then three whole
emsa.probe calls. Prints every pass in ms and writes them as JSON (--out).

    python3 bench/probe_passes.py --out probe-passes.json     (GPU host, emsa built)
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_common  # noqa: E402

import emsa  # noqa: E402
from emsa._native.library import check, lib  # noqa: E402

PROBE = sys.modules["emsa.probe"]  # the module (emsa.probe is also the function)


def main() -> None:
    args, dev, model, ids, out = probe_common.llama_1b("probe-passes", __doc__.splitlines()[0])
    targets = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(input_ids=ids, labels=ids)

    def passes(n: int) -> list[float]:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return [sum(PROBE._timed_pass(model, lambda out: out.loss, (), kwargs, targets, dev))
                    * 1e3 for _ in range(n)]

    def loaded(n: int, update_params: int = 64 << 20, copies: int = 1,
               settle: float = 0.0) -> list[float]:
        load = ctypes.c_void_p()
        check(lib.emsa_host_load_start(0, update_params, 0, copies, 64 << 20, ctypes.byref(load)))
        try:
            if settle:
                time.sleep(settle)
            return passes(n)
        finally:
            check(lib.emsa_host_load_stop(load, None, None))

    def show(label: str, v: list[float]) -> list[float]:
        print(f"{label:18} " + " ".join(f"{x:6.1f}" for x in v)
              + f" | median {statistics.median(v):6.1f}")
        return v

    out.update(units="ms per forward + backward pass")
    passes(3)
    for rep in range(3):
        out[f"rep{rep}"] = dict(alone=show(f"rep{rep} alone", passes(7)),
                                loaded=show(f"rep{rep} loaded", loaded(7)))
    out["settled"] = show("loaded after 0.5 s", loaded(7, settle=0.5))
    out["cpu_only"] = show("CPU update only", loaded(7, copies=0))
    out["copies_cache"] = show("copies, in cache", loaded(7, update_params=4096))
    out["cache_only"] = show("in cache only", loaded(7, update_params=4096, copies=0))
    alone, under = [], []
    for _ in range(5):
        alone += passes(1)
        under += loaded(2)[1:]
    out["alt"] = dict(alone=show("in turn: alone", alone), loaded=show("in turn: loaded", under))
    for k in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            r = emsa.probe(model, input_ids=ids, labels=ids, trace=False)
        pa = r.forward_time + r.backward_time
        print(f"probe {k}: forward + backward {pa * 1e3:.1f} ms alone, "
              f"{r.period_under_load * 1e3:.1f} under load")
        out[f"probe{k}"] = [pa, r.period_under_load]
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
