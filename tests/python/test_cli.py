"""The `emsa` command of the Python package: libemsa's own command through the C ABI (the same
options, text and exit codes as the C++ binary), its verdict first, --version, --list."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import emsa
from conftest import CPU_PROFILE, INSTALLED, ROOT, subprocess_env

PROBE = ROOT / "examples" / "probes" / "tiny-gpt.json"
SEVEN_B_ON_24 = ["plan", "--model", "llama-2-7b", "--gpu-mem", "24GiB", "--batch", "1", "--seq",
                 "2048", "--checkpointing"]


def emsa_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "emsa", *map(str, args)], env=subprocess_env(),
                          capture_output=True, text=True, cwd=cwd)


@pytest.mark.wheel
def test_plan_prints_the_summary_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    r = emsa_cli("plan", PROBE, "--profile", CPU_PROFILE, "--json", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("fits         yes")
    assert "model.embed_tokens.weight" not in r.stdout
    plan = json.loads(out.read_text())
    assert plan["format"] == "emsa.plan" and len(plan["params"]) > 0
    for flag in ("--verbose", "--table"):
        r = emsa_cli("plan", PROBE, "--profile", CPU_PROFILE, flag)
        assert r.returncode == 0, r.stderr
        assert "model.embed_tokens.weight" in r.stdout


def test_plan_infeasible_budget_exits_3_naming_the_minimum():
    r = emsa_cli("plan", PROBE, "--profile", CPU_PROFILE, "--budget", "1KiB")
    assert r.returncode == 3
    assert "smallest budget that works" in r.stderr
    smallest = int(re.search(r"smallest feasible budget: .* \(--budget (\d+)\)", r.stderr).group(1))
    assert emsa_cli("plan", PROBE, "--profile", CPU_PROFILE, "--budget", smallest).returncode == 0


def test_plan_bad_input_exits_2():
    r = emsa_cli("plan", PROBE, "--budget", "lots")
    assert r.returncode == 2 and "lots" in r.stderr
    r = emsa_cli("plan", ROOT / "nonexistent.json")
    assert r.returncode == 2


def test_profile_without_bandwidth():
    r = emsa_cli("profile", "--no-bandwidth")
    assert r.returncode == 0, r.stderr
    profile = json.loads(r.stdout)
    assert profile["cpu"]["logical_cores"] >= 1
    assert profile["cpu"]["host_memory"] > 0


@pytest.mark.wheel
def test_version_is_the_packages():
    r = emsa_cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"emsa {emsa.__version__}\n"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == emsa.__version__


def test_the_verdict_comes_first_and_the_default_is_short():
    r = emsa_cli(*SEVEN_B_ON_24)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) <= 40
    head = "\n".join(lines[:5])
    assert lines[0].startswith("fits         yes: peak device memory ")
    for part in ("of the card's", "(budget 24.00 GiB)", "tokens/s", "of the host's",
                 "parameters' state on the device"):
        assert part in head, head


def test_a_budget_above_the_card_is_refused_naming_its_memory():
    r = emsa_cli("plan", "--model", "llama-3-8b", "--gpu-mem", "30GiB", "--device", "rtx-4090")
    assert r.returncode == 2
    assert "more than the 23.99 GiB of the NVIDIA GeForce RTX 4090" in r.stderr


def test_the_cxx_options_are_accepted():
    base = ["plan", PROBE, "--profile", CPU_PROFILE, "--json", "-"]
    plain = emsa_cli(*base)
    assert plain.returncode == 0, plain.stderr
    small_buckets = emsa_cli(*base, "--bucket-bytes", "64KiB")
    assert small_buckets.returncode == 0, small_buckets.stderr
    assert (len(json.loads(small_buckets.stdout)["buckets"])
            > len(json.loads(plain.stdout)["buckets"]))
    margin = emsa_cli(*base, "--safety-margin", "2GiB")
    assert margin.returncode == 0, margin.stderr
    assert (json.loads(margin.stdout)["budget_bytes"]
            == json.loads(plain.stdout)["budget_bytes"] - (1 << 30))


def test_list_and_bare_folder_names(tmp_path):
    r = emsa_cli("plan", "--list")
    assert r.returncode == 0, r.stderr
    assert "llama-2-7b" in r.stdout and "rtx-4090" in r.stdout and "model_type" in r.stdout
    folder = tmp_path / "cfg-llama"
    folder.mkdir()
    shutil.copy(ROOT / "presets" / "models" / "tinyllama-1.1b.json", folder / "config.json")
    bare = emsa_cli("plan", "--model", "cfg-llama", "--seq", "128", "--json", "-", cwd=tmp_path)
    dotted = emsa_cli("plan", "--model", "./cfg-llama", "--seq", "128", "--json", "-",
                      cwd=tmp_path)
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout == dotted.stdout


@pytest.mark.wheel
def test_the_installed_package_carries_its_library():
    """With --installed (CI's wheel step): emsa and libemsa both come from site-packages."""
    if not INSTALLED:
        return
    package = Path(emsa.__file__).resolve().parent
    assert ROOT / "python" not in package.parents and package != ROOT / "python" / "emsa"
    assert (package / "libemsa.so").exists()
    assert emsa.AdamW is not None and emsa.parse_bytes("1KiB") == 1024
    script = Path(sys.executable).parent / "emsa"
    r = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == f"emsa {emsa.__version__}\n", r.stderr
