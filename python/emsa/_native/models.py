"""Models known by their config: an analytic probe record and the built-in device presets,
computed by libemsa (emsa/model_config.h); nothing here but argument passing. (`emsa plan
--model` is libemsa's own command: emsa.__main__.)"""

from __future__ import annotations

import ctypes

from .library import check, lib, take_string
from .structs import DTYPE, ModelOptions

__all__ = ["model_probe", "model_options", "device_preset"]

PARAM_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16",
                "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def model_options(*, batch: int = 1, seq_len: int = 0, checkpointing: bool = False,
                  param_dtype: str = "bf16", matmul_flops: float = 0.0,
                  eager_attention: bool = False) -> ModelOptions:
    """emsa_model_options from model_probe's keywords."""
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype={param_dtype!r}; use one of fp32, bf16, fp16")
    options = ModelOptions()
    lib.emsa_model_options_init(ctypes.byref(options))
    options.batch = int(batch)
    options.seq_len = int(seq_len)
    options.activation_checkpointing = int(bool(checkpointing))
    options.eager_attention = int(bool(eager_attention))
    options.param_dtype = DTYPE[PARAM_DTYPES[param_dtype]]
    options.matmul_flops = float(matmul_flops)
    return options


def model_probe(model: str, **options) -> tuple[str, str]:
    """(probe record JSON, summary text) for a preset name, config.json text or path; options:
    model_options' keywords (seq_len 0: the model's context, at most 2048; matmul_flops 0:
    libemsa's default)."""
    probe, summary = ctypes.c_void_p(), ctypes.c_void_p()
    check(lib.emsa_model_probe(model.encode(), ctypes.byref(model_options(**options)),
                               ctypes.byref(probe), ctypes.byref(summary)))
    probe_text = take_string(probe)
    return probe_text, take_string(summary)


def device_preset(name: str) -> str:
    """A built-in device profile's JSON text ("h200", "a100-40gb", "rtx-4090")."""
    out = ctypes.c_void_p()
    check(lib.emsa_device_preset(name.encode(), ctypes.byref(out)))
    return take_string(out)
