"""python -m emsa: the CLI's plan and profile through the C ABI."""

import json
import os
import re
import subprocess
import sys

from conftest import CPU_PROFILE, ROOT

PROBE = ROOT / "examples" / "probes" / "tiny-gpt.json"


def emsa_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    return subprocess.run([sys.executable, "-m", "emsa", *map(str, args)], env=env,
                          capture_output=True, text=True)


def test_plan_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    r = emsa_cli("plan", PROBE, "--profile", CPU_PROFILE, "--json", out)
    assert r.returncode == 0, r.stderr
    assert "model.embed_tokens.weight" in r.stdout
    plan = json.loads(out.read_text())
    assert plan["format"] == "emsa.plan" and len(plan["params"]) > 0


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
    assert json.loads(r.stdout)["cpu"]["logical_cores"] >= 1
