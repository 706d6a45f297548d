"""A run directory read back (emsa report): its files checked and parsed, with errors that name
the file and what is wrong with it. docs/report-format.md gives each file's fields."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _files

__all__ = ["Run", "RunDirError", "load"]


class RunDirError(ValueError):
    """The run directory is missing, or a file in it is missing or malformed."""


@dataclass
class Run:
    path: Path
    plan: dict[str, Any]
    steps: list[dict[str, Any]]
    probe: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    setup: dict[str, Any] | None = None


# ---- reading ---------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    try:
        return json.loads(_files.read_text(path))
    except json.JSONDecodeError as e:
        raise RunDirError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise RunDirError(f"{path}: its JSON nests too deeply") from None
    except ValueError as e:
        raise RunDirError(str(e)) from None
    except OSError as e:
        raise RunDirError(f"{path}: cannot read it ({e.strerror})") from None


def _read_steps(path: Path) -> list[dict[str, Any]]:
    steps = []
    try:
        lines = _files.read_text(path).splitlines()
    except ValueError as e:
        raise RunDirError(str(e)) from None
    except OSError as e:
        raise RunDirError(f"{path}: cannot read it ({e.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RunDirError(f"{path} line {n}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise RunDirError(f"{path} line {n}: expected a JSON object per step")
        last_of_several = n == len(lines) and len(steps) > 0
        for key in ("step",) if last_of_several and "time_s" not in row else ("step", "time_s"):
            if not isinstance(row.get(key), (int, float)) or isinstance(row.get(key), bool):
                raise RunDirError(f"{path} line {n}: {key!r} is missing or not a number; "
                                  "every step needs \"step\" and \"time_s\"")
        steps.append(row)
    if not steps:
        raise RunDirError(f"{path} holds no steps; a run writes one JSON object per step")
    return steps


def load(run_dir: str | Path) -> Run:
    """Reads a run directory; RunDirError names the file and what is wrong with it."""
    path = Path(run_dir)
    if not path.exists():
        raise RunDirError(f"run directory {path} does not exist; pass the directory that "
                          "`emsa demo --out` or opt.report() wrote")
    if not path.is_dir():
        raise RunDirError(f"{path} is not a directory; pass a run directory (it holds "
                          "plan.json and steps.jsonl)")
    for name in ("plan.json", "steps.jsonl"):
        if not (path / name).is_file():
            raise RunDirError(f"{path} has no {name}: it is not a run directory (a run "
                              "directory holds plan.json and steps.jsonl)")
    plan = _read_json(path / "plan.json")
    if not isinstance(plan, dict) or plan.get("format") != "emsa.plan":
        raise RunDirError(f"{path / 'plan.json'}: not a plan (expected "
                          '{"format": "emsa.plan", ...}, as Plan.text writes)')
    for key, kind in (("params", list), ("prediction", dict)):
        if not isinstance(plan.get(key), kind):
            raise RunDirError(f"{path / 'plan.json'}: the field {key!r} is missing or not a "
                              f"JSON {'array' if kind is list else 'object'}")
    for i, p in enumerate(plan["params"]):
        if not isinstance(p, dict) or not {"name", "tier"} <= set(p):
            raise RunDirError(f"{path / 'plan.json'}: params[{i}] lacks \"name\" or \"tier\"")
    probe = _read_json(path / "probe.json") if (path / "probe.json").is_file() else None
    if probe is not None and (not isinstance(probe, dict) or probe.get("format") != "emsa.probe"):
        raise RunDirError(f"{path / 'probe.json'}: not a probe record (expected "
                          '{"format": "emsa.probe", ...})')
    meta = _read_json(path / "meta.json") if (path / "meta.json").is_file() else {}
    if not isinstance(meta, dict):
        raise RunDirError(f"{path / 'meta.json'}: expected a JSON object")
    setup = _read_json(path / "setup.json") if (path / "setup.json").is_file() else None
    if setup is not None and not (isinstance(setup, dict)
                                  and isinstance(setup.get("times", {}), dict)):
        raise RunDirError(f"{path / 'setup.json'}: expected a JSON object with \"times\": "
                          "{phase: seconds}")
    return Run(path, plan, _read_steps(path / "steps.jsonl"), probe, meta, setup)
