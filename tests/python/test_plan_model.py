"""python -m emsa plan --model: the C ABI's analytic probe and device presets, the same exit codes
and text as the C++ `emsa` binary, and the 7B-on-24-GiB expectation."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env

from emsa._native.models import device_preset, model_options, model_probe
from emsa.plan import infeasible_message

SEVEN_B_ON_24 = ["--model", "llama-2-7b", "--gpu-mem", "24GiB", "--batch", "1", "--seq", "2048",
                 "--checkpointing", "--param-dtype", "bf16"]


def emsa_cli(*args):
    env = subprocess_env()
    return subprocess.run([sys.executable, "-m", "emsa", "plan", *map(str, args)], env=env,
                          capture_output=True, text=True)


def cxx_binary():
    lib = os.environ.get("EMSA_LIBRARY")
    binary = Path(lib).parent / "emsa" if lib else None
    if binary is None or not binary.exists():
        pytest.skip("the C++ emsa binary is not built next to libemsa")
    return binary


@pytest.mark.parametrize("name,params", [
    ("llama-2-7b", 6_738_415_616),
    ("mistral-7b", 7_241_732_096),
    ("gpt2-xl", 1_557_611_200),
    ("qwen2.5-7b", 7_615_616_512),
    ("llama-3-8b", 8_030_261_248),
])
def test_parameter_counts_match_the_real_models(name, params):
    probe, summary = model_probe(name, seq_len=128)
    record = json.loads(probe)
    assert sum(p["numel"] for p in record["params"]) == params
    assert record["model"] == name
    assert f"{params:,} parameters" in summary


def test_probe_options_reach_the_record():
    fp32 = json.loads(model_probe("tinyllama-1.1b", seq_len=512, param_dtype="fp32")[0])
    bf16 = json.loads(model_probe("tinyllama-1.1b", seq_len=512, param_dtype="bf16")[0])
    assert {p["dtype"] for p in bf16["params"]} == {"bfloat16"}
    assert [p["bytes"] * 2 for p in bf16["params"]] == [p["bytes"] for p in fp32["params"]]
    peaks = [json.loads(model_probe("tinyllama-1.1b", batch=b, seq_len=512,
                                    param_dtype="fp32")[0])["peak_device_bytes"]
             for b in (1, 2, 4)]
    assert peaks[0] < peaks[1] < peaks[2]
    ckpt = json.loads(model_probe("tinyllama-1.1b", seq_len=512, checkpointing=True,
                                  param_dtype="fp32")[0])
    assert ckpt["peak_device_bytes"] < fp32["peak_device_bytes"]
    assert ckpt["backward_time"] > fp32["backward_time"]  # each layer's forward again


def test_device_presets_are_the_shipped_files():
    for name in ("h200", "a100-40gb", "rtx-4090"):
        text = device_preset(name)
        assert text == (ROOT / "presets" / "devices" / f"{name}.json").read_text()
        assert json.loads(text)["matmul_flops"] > 0


def test_seven_b_on_24_gib_fits_only_with_the_host_tier():
    r = emsa_cli(*SEVEN_B_ON_24, "--json", "-")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["prediction"]["peak_device_bytes"] <= 24 << 30
    assert plan["prediction"]["host_state_bytes"] > 0
    tiers = [p["tier"] for p in plan["params"]]
    assert tiers.count("L2") > len(tiers) // 2
    r = emsa_cli(*SEVEN_B_ON_24, "--no-host-tier")
    assert r.returncode == 3
    assert "with everything on the device (--no-host-tier)" in r.stderr


def test_infeasible_exits_3_naming_the_smallest_budget():
    model = ["--model", "llama-2-7b", "--checkpointing", "--param-dtype", "bf16", "--summary"]
    r = emsa_cli(*model, "--gpu-mem", "4GiB")
    assert r.returncode == 3 and r.stdout == ""
    assert "needs at least" in r.stderr and "the budget is 4.00 GiB" in r.stderr
    smallest = int(re.search(r"--gpu-mem (\d+)\)", r.stderr).group(1))
    assert smallest > 4 << 30
    assert emsa_cli(*model, "--gpu-mem", smallest).returncode == 0
    assert emsa_cli(*model, "--gpu-mem", smallest - 1).returncode == 3


def test_infeasible_message_comes_from_libemsa():
    shape = dict(seq_len=2048, checkpointing=True, param_dtype="bf16")
    probe = model_probe("llama-2-7b", **shape)[0]
    h200 = device_preset("h200")
    message = infeasible_message(probe, h200, model=model_options(**shape), budget="4GiB",
                                 release_grads=True)
    assert "llama-2-7b needs at least" in message and "the budget is 4.00 GiB" in message
    assert "to need less: a smaller --batch or --seq" in message
    smallest = int(re.search(r"--gpu-mem (\d+)\)", message).group(1))
    assert infeasible_message(probe, h200, budget=smallest, release_grads=True) == ""
    # A probe record from a training run: the planner's own message and the smallest budget.
    message = infeasible_message(probe, h200, budget=smallest - 1, release_grads=True)
    assert message.endswith(f"(--budget {smallest})") and "needs at least" not in message


@pytest.mark.parametrize("args,says", [
    (["--model", "llama-9"], "not a preset (gpt2-xl, llama-2-7b"),
    (["--model", "gpt2-xl", "--seq", "4096"], "exceeds gpt2-xl's n_positions 1024"),
    (["--model", "llama-2-7b", "--batch", "0"], "--batch '0' is not a positive whole number"),
    (["--model", "llama-2-7b", "--device", "tpu"], "a100-40gb, h200, rtx-4090"),
    (["--model", "llama-2-7b", "--gpu-mem", "lots"], "lots"),
    (["--model", "llama-2-7b", "--gpu-mem", "2GiB", "--budget", "2GiB"], "give one"),
    (["--model", "llama-2-7b", "--param-dtype", "int8"], "int8"),
    (["probe.json", "--batch", "2"], "--batch goes with --model"),
    (["--checkpointing"], "--checkpointing goes with --model"),
])
def test_bad_input_exits_2(args, says):
    r = emsa_cli(*args)
    assert r.returncode == 2
    assert says in r.stderr


def test_config_files_name_the_missing_field(tmp_path):
    config = tmp_path / "my-model" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                  "intermediate_size": 128, "num_attention_heads": 4,
                                  "vocab_size": 100}))
    r = emsa_cli("--model", config.parent)
    assert r.returncode == 2
    assert "my-model: num_hidden_layers: missing" in r.stderr
    assert "supported families" in r.stderr
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                  "intermediate_size": 128, "num_attention_heads": 4,
                                  "vocab_size": 100, "num_hidden_layers": 2}))
    r = emsa_cli("--model", config, "--gpu-mem", "1GiB", "--seq", "64", "--summary")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("fits         yes")  # the verdict, then the model
    assert "\nmodel      my-model: llama family" in r.stdout


@pytest.mark.parametrize("args", [
    SEVEN_B_ON_24 + ["--summary"],
    SEVEN_B_ON_24 + ["--no-host-tier"],
    ["--model", "gpt2-xl", "--device", "rtx-4090", "--batch", "2", "--seq", "512"],
    ["--model", "qwen2.5-7b", "--device", "a100-40gb", "--keep-grads", "--state-dtype", "bf16"],
    ["--model", "mistral-7b", "--gpu-mem", "30GiB", "--all-host", "--optimizer", "lion",
     "--json", "-"],
    ["--model", "llama-2-7b", "--gpu-mem", "24GiB", "--seq", "4096", "--checkpointing",
     "--eager-attention", "--summary"],
])
def test_same_output_as_the_cxx_binary(args):
    binary = cxx_binary()
    py = emsa_cli(*args)
    cxx = subprocess.run([str(binary), "plan", *args], capture_output=True, text=True)
    assert (py.returncode, py.stdout, py.stderr) == (cxx.returncode, cxx.stdout, cxx.stderr)


def test_eager_attention_adds_the_saved_scores():
    """Fused attention (the default) saves no s x s scores; eager attention saves 5*a*s*b*s
    bytes per layer (Korthikanti et al.): with checkpointing, one layer's worth at a time."""
    fused = json.loads(model_probe("llama-2-7b", seq_len=2048, checkpointing=True)[0])
    eager, summary = model_probe("llama-2-7b", seq_len=2048, checkpointing=True,
                                 eager_attention=True)
    scores = 5 * 32 * 2048 * 1 * 2048
    assert json.loads(eager)["peak_device_bytes"] - fused["peak_device_bytes"] == scores
    assert "eager attention (scores saved)" in summary


def test_gated_steps_wait_for_the_end_of_backward():
    """A plan for passes that wait for every gradient (clipping, the non-finite check, a loss
    scale): the host tier updates nothing before backward ends, so its predicted step is longer
    than the ungated plan's at the same share, and the plan says what it assumed; the CLI's
    --gated plans the same."""
    from emsa.plan import make_plan
    probe = model_probe("tinyllama-1.1b", seq_len=1024, param_dtype="fp32")[0]
    h200 = device_preset("h200")
    kw = dict(force_all_host=True, release_grads=True, device_update_share=0.5)
    ungated, gated = (make_plan(probe, h200, gated_steps=g, **kw) for g in (False, True))
    assert gated.json["options"]["gated_steps"] is True
    assert ungated.json["options"]["gated_steps"] is False
    assert gated.json["prediction"]["step_time"] > ungated.json["prediction"]["step_time"]
    assert gated.json["prediction"]["stall_time"] > 0
    args = ["--model", "tinyllama-1.1b", "--seq", "1024", "--param-dtype", "fp32", "--all-host"]
    r = emsa_cli(*args, "--gated")
    assert r.returncode == 0, r.stderr
    assert "updates after every gradient" in r.stdout
    step = lambda text: float(re.search(r"step\s+([\d.]+) ms", text).group(1))  # noqa: E731
    assert step(r.stdout) > step(emsa_cli(*args).stdout)
