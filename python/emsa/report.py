"""`emsa report RUN_DIR`: a training run's plan, prediction and measurements as report.md + PNGs.

A run directory holds plan.json and steps.jsonl (required), probe.json, meta.json and
setup.json (optional): docs/report-format.md gives each file's fields. opt.report() and
`emsa demo` write one (write_run); report.md and its PNGs are written into it. A plot whose
data is missing is left out, and report.md says why. Exit status of main(): 0 written, 2 bad
RUN_DIR or unreadable files, 1 other failure (e.g. matplotlib missing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import _files
from ._run_dir import Run, RunDirError, load

__all__ = ["main", "write", "write_run", "load", "Run", "RunDirError", "fmt_bytes", "tier_groups",
           "ENGINE_FIELDS"]

# The per-engine time fields of steps.jsonl, with their labels and colours.
ENGINE_FIELDS = [("hbm_s", "hbm_time", "device update (HBM)", "#4c72b0"),
                 ("d2h_s", "d2h_time", "gradients down (PCIe D2H)", "#dd8452"),
                 ("h2d_s", "h2d_time", "parameters up (PCIe H2D)", "#55a868"),
                 ("cpu_s", "cpu_time", "host update (CPU)", "#c44e52"),
                 ("stall_s", "stall_time", "stall before next forward", "#8c8c8c")]
TIERS = {"L0": ("L0: device, L2-cache persisting", "#8172b3"),
         "L1": ("L1: device arena", "#4c72b0"),
         "L2": ("L2: pinned host arena", "#dd8452")}
MAX_BARS = 40  # the tier map groups modules more coarsely until it has at most this many


# ---- units -----------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _byte_unit(largest: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if largest >= scale:
            return unit, float(scale)
    return "B", 1.0


def _values(steps, key) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in steps
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


# ---- plots: each returns None when drawn, else why it was skipped ---------------------------
def tier_groups(plan: dict[str, Any], probe: dict[str, Any] | None = None,
                max_groups: int = MAX_BARS) -> dict[str, dict[str, int]]:
    """State bytes per tier for each module group, in forward order (the probe's, else the
    plan's parameter order). Groups are module-name prefixes, as deep as keeps at most
    max_groups of them: leaf modules for a small model, blocks for a deep one."""
    order = {}
    if probe:
        order = {p["name"]: p.get("forward_order", -1) for p in probe.get("params", [])}
    params = sorted(plan["params"], key=lambda p: (order.get(p["name"], -1) < 0,
                                                   order.get(p["name"], 0), p.get("index", 0)))
    modules = [p.get("module") or "(root)" for p in params]
    depth = max((m.count(".") + 1 for m in modules), default=1)
    while depth > 1 and len({_prefix(m, depth) for m in modules}) > max_groups:
        depth -= 1
    groups: dict[str, dict[str, int]] = {}
    for p, m in zip(params, modules):
        g = groups.setdefault(_prefix(m, depth), {})
        g[p["tier"]] = g.get(p["tier"], 0) + int(p.get("state_bytes", 0))
    return groups


def _tier_map(run: Run, plt, out: Path) -> str | None:
    if not run.plan["params"]:
        return "the plan holds no parameters"
    groups = tier_groups(run.plan, run.probe)
    names = list(groups)
    unit, scale = _byte_unit(max(sum(g.values()) for g in groups.values()))
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.3 * len(names)))
    left = [0.0] * len(names)
    tiers = [t for t in TIERS if any(t in g for g in groups.values())]
    tiers += sorted({t for g in groups.values() for t in g} - set(TIERS))
    for tier in tiers:
        widths = [groups[n].get(tier, 0) / scale for n in names]
        label, colour = TIERS.get(tier, (f"tier {tier}", "#bbbbbb"))
        total = fmt_bytes(sum(g.get(tier, 0) for g in groups.values()))
        ax.barh(names, widths, left=left, color=colour, label=f"{label} ({total})", height=0.7)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()  # forward order reads top to bottom
    ax.set_xlabel(f"optimizer state ({unit})")
    ax.set_ylabel("module (forward order)")
    ax.set_title("Tier map: where each module's optimizer state lives")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="tier (state bytes)")
    ax.grid(axis="x", alpha=0.3)
    _save(fig, plt, out / "tier_map.png")
    return None


def _prefix(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth])


def _memory(run: Run, plt, out: Path) -> tuple[str | None, str]:
    pred = run.plan["prediction"]
    state = float(pred.get("device_state_bytes", 0))
    samples = [(float(s.get("time", 0.0)), float(s.get("device_bytes", 0)))
               for s in (run.probe or {}).get("memory") or [] if isinstance(s, dict)]
    have_timeline = any(b > 0 for _, b in samples)
    measured = _values(run.steps, "peak_device_bytes")
    if not have_timeline and not measured:
        return ("no device memory was recorded: probe.json has no memory samples above 0 and "
                "steps.jsonl has no peak_device_bytes (a CPU run has no device memory)"), ""
    note = ""
    if not have_timeline:
        note = "probe.json is missing or has no device memory samples: predicted timeline left out"
    elif not measured:
        note = "steps.jsonl has no peak_device_bytes: measured peaks left out"
    peak = float(pred.get("peak_device_bytes", 0))
    budget = float(run.plan.get("budget_bytes") or 0)
    tops = [peak] + [b + state for _, b in samples] + [v for _, v in measured]
    show_budget = 0 < budget <= 2 * max(tops)  # a far-off budget would flatten the plot
    unit, scale = _byte_unit(max(tops + ([budget] if show_budget else [])))
    panels = int(have_timeline) + int(bool(measured))
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 5.2), squeeze=False)
    axes = list(axes[0])
    if have_timeline:
        ax = axes.pop(0)
        ax.step([1e3 * t for t, _ in samples], [(b + state) / scale for _, b in samples],
                where="post", label="probe at module boundaries + device state")
        _hlines(ax, peak / scale, budget / scale if show_budget else None)
        ax.set_xlabel("time in the step's forward and backward (ms)")
        ax.set_ylabel(f"device memory ({unit})")
        ax.set_title("Predicted, within one step")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=9)
        ax.grid(alpha=0.3)
    if measured:
        ax = axes.pop(0)
        ax.plot([s for s, _ in measured], [v / scale for _, v in measured], marker=".",
                label="measured peak")
        _hlines(ax, peak / scale, budget / scale if show_budget else None)
        ax.set_xlabel("step")
        ax.locator_params(axis="x", integer=True)
        ax.set_ylabel(f"device memory ({unit})")
        ax.set_title("Measured peak, per step")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("Device memory: predicted vs measured")
    _save(fig, plt, out / "memory.png")
    return None, note


def _hlines(ax, peak: float, budget: float | None) -> None:
    ax.axhline(peak, color="#c44e52", linestyle="--", label="predicted peak")
    if budget is not None:
        ax.axhline(budget, color="black", linestyle=":", label="budget")


def _time_split(run: Run, plt, out: Path) -> tuple[str | None, str]:
    present = [f for f in ENGINE_FIELDS if _values(run.steps, f[0])]
    if not present:
        return ("steps.jsonl has no per-engine times (hbm_s, d2h_s, h2d_s, cpu_s, stall_s), so "
                "there is no measured split to set against the prediction (in the table "
                "above)"), ""
    missing = [f[0] for f in ENGINE_FIELDS if f not in present]
    pred = run.plan["prediction"]
    fig, ax = plt.subplots(figsize=(9, 5))
    bottoms = [0.0, 0.0]
    for key, pkey, label, colour in ENGINE_FIELDS:
        measured = _mean(_values(run.steps, key))
        heights = [1e3 * float(pred.get(pkey, 0.0)), 1e3 * measured]
        ax.bar(["predicted", "measured (mean)"], heights, bottom=bottoms, color=colour,
               label=label, width=0.5)
        bottoms = [a + b for a, b in zip(bottoms, heights)]
    step_times = [1e3 * float(pred.get("step_time", 0.0)), 1e3 * _mean(_values(run.steps,
                                                                               "time_s"))]
    for x, t in enumerate(step_times):
        ax.plot([x - 0.35, x + 0.35], [t, t], color="black", linewidth=2,
                label="step time" if x == 0 else None)
    ax.set_ylabel("time per step (ms)")
    ax.set_xlabel("the engines run concurrently: a stack sums their busy time,\n"
                  "the black line is the step's wall-clock time")
    ax.set_title("Step time split: predicted vs measured")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, plt, out / "time_split.png")
    note = f"not measured, drawn as 0: {', '.join(missing)}" if missing else ""
    return None, note


def _loss(run: Run, plt, out: Path) -> str | None:
    mine, peer = _values(run.steps, "loss"), _values(run.steps, "loss_peer")
    if not mine:
        return "steps.jsonl has no loss"
    panels = 2 if peer else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    ax.plot([s for s, _ in mine], [v for _, v in mine], label="emsa", linewidth=2)
    if peer:
        ax.plot([s for s, _ in peer], [v for _, v in peer], label=_peer_name(run),
                linestyle="--", linewidth=1.5)
    ax.set_xlabel("step")
    ax.locator_params(axis="x", integer=True)
    ax.set_ylabel("training loss")
    ax.set_title("Loss")
    ax.legend()
    ax.grid(alpha=0.3)
    if peer:
        floor = 1e-10
        other = dict(peer)
        diffs = [(s, max(abs(v - other[s]), floor)) for s, v in mine if s in other]
        ax = axes[0][1]
        ax.semilogy([s for s, _ in diffs], [d for _, d in diffs], marker=".", linestyle="none")
        ax.axhline(1e-4, color="#c44e52", linestyle="--", label="1e-4 (the demo's bar)")
        ax.set_xlabel("step")
        ax.locator_params(axis="x", integer=True)
        ax.set_ylabel(f"|loss difference| (0 drawn at {floor:g})")
        ax.set_title(f"emsa vs {_peer_name(run)}")
        ax.legend()
        ax.grid(alpha=0.3, which="both")
    _save(fig, plt, out / "loss.png")
    return None


def _step_time(run: Run, plt, out: Path) -> str | None:
    fig, ax = plt.subplots(figsize=(10, 4.5))
    peer = _peer_name(run)
    for key, label, colour, style in (
            ("time_s", "emsa: step", "#4c72b0", "-"),
            ("time_peer_s", f"{peer}: step", "#dd8452", "-"),
            ("opt_s", "emsa: optimizer.step()", "#4c72b0", ":"),
            ("opt_peer_s", f"{peer}: optimizer.step()", "#dd8452", ":")):
        vals = _values(run.steps, key)
        if vals:
            ax.plot([s for s, _ in vals], [1e3 * v for _, v in vals], label=label,
                    color=colour, linestyle=style, linewidth=1.2)
    predicted = float(run.plan["prediction"].get("step_time", 0.0))
    if predicted > 0:
        ax.axhline(1e3 * predicted, color="black", linestyle="--", label="predicted step")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.locator_params(axis="x", integer=True)
    ax.set_ylabel("time (ms, log scale)")
    ax.set_title("Step time, measured per step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    ax.grid(alpha=0.3, which="both")
    _save(fig, plt, out / "step_time.png")
    return None


def _peer_name(run: Run) -> str:
    return str(run.meta.get("peer", "peer"))


def _mean(vals: list[tuple[int, float]]) -> float:
    vals = vals[1:] if len(vals) > 1 else vals  # the first step plans and warms up
    return sum(v for _, v in vals) / len(vals) if vals else 0.0


def _save(fig, plt, path: Path) -> None:
    fig.tight_layout()
    with _files.replacing(path) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)


# ---- report.md -------------------------------------------------------------------------------
def _text(value: Any) -> str:
    """Floats to 4 significant digits, objects as "key value, ...", lists in parentheses."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_text(v) for v in value) + ")"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _cell(value: Any) -> str:
    """A markdown table cell: one line, pipes escaped."""
    return _text(value).replace("|", "\\|").replace("\n", " ")


def _tables(run: Run) -> list[str]:
    plan, pred, steps = run.plan, run.plan["prediction"], run.steps
    params = plan["params"]
    by_tier: dict[str, int] = {}
    for p in params:
        by_tier[p["tier"]] = by_tier.get(p["tier"], 0) + 1
    budget = plan.get("budget_bytes") or 0
    tiers = ", ".join(f"{n} in {t}" for t, n in by_tier.items())
    rows = [("parameters", f"{len(params)} ({tiers})"),
            ("budget", fmt_bytes(budget) if budget else "none (no device limit)"),
            ("smallest budget that works", fmt_bytes(plan.get("min_budget_bytes", 0))),
            ("state on the device / host", f"{fmt_bytes(pred.get('device_state_bytes', 0))} / "
                                           f"{fmt_bytes(pred.get('host_state_bytes', 0))}"),
            ("predicted forward+backward", f"{1e3 * pred.get('period', 0):.3f} ms")]
    rows += [(f"predicted {label}", f"{1e3 * pred.get(pkey, 0):.3f} ms")
             for _, pkey, label, _ in ENGINE_FIELDS]
    rows += [("predicted step", f"{1e3 * pred.get('step_time', 0):.3f} ms"),
             ("predicted peak device memory", fmt_bytes(pred.get("peak_device_bytes", 0)))]
    measured = [("steps", str(len(steps))),
                ("mean step time (after the first)",
                 f"{1e3 * _mean(_values(steps, 'time_s')):.3f} ms")]
    peer = _peer_name(run)
    for key, label in (("time_peer_s", f"mean step time, {peer}"),
                       ("opt_s", "mean optimizer.step()"),
                       ("opt_peer_s", f"mean optimizer.step(), {peer}")):
        if _values(steps, key):
            measured.append((label, f"{1e3 * _mean(_values(steps, key)):.3f} ms"))
    peaks = _values(steps, "peak_device_bytes")
    if peaks:
        measured.append(("measured peak device memory", fmt_bytes(max(v for _, v in peaks))))
    for key, label in (("loss", "final loss"), ("loss_peer", f"final loss, {peer}")):
        vals = _values(steps, key)
        if vals:
            measured.append((label, f"{vals[-1][1]:.6f}"))
    out = ["## Plan and prediction", "", "| | |", "|---|---|"]
    out += [f"| {a} | {_cell(b)} |" for a, b in rows]
    out += ["", "## Measured", "", "| | |", "|---|---|"]
    out += [f"| {a} | {_cell(b)} |" for a, b in measured]
    return out


def _setup_lines(setup: dict[str, Any]) -> list[str]:
    """The "Set-up" section: the phases' seconds and where the profile came from."""
    out = ["| phase | seconds |", "|---|---|"]
    out += [f"| {k} | {v:.3f} |" for k, v in setup.get("times", {}).items()]
    out.append(f"| total | {setup.get('total', 0.0):.3f} |")
    out += ["", f"Profile: {setup.get('profile', 'not recorded')}."]
    probe = setup.get("probe")
    if probe:
        out += ["", "emsa.probe:", "", "| phase | seconds |", "|---|---|"]
        out += [f"| {k} | {v:.3f} |" for k, v in probe["times"].items()]
        out += [f"| total | {probe['total']:.3f} |", "", f"Probe's profile: {probe['profile']}."]
    return out


def write(run_dir: str | Path) -> Path:
    """Writes report.md and its PNGs into run_dir; returns report.md's path. Raises
    RunDirError for a bad run directory, ImportError when matplotlib is missing."""
    run = load(run_dir)
    try:
        import matplotlib
    except ImportError:
        raise ImportError("emsa report draws with matplotlib, which is not installed: "
                          "pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = dict(run.meta)
    title = meta.pop("title", f"emsa run {run.path.name}")
    lines = [f"# {title}", ""]
    if meta:
        lines += ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in meta.items()]
    else:
        lines.append("(no meta.json)")
    lines += [""] + _tables(run)
    if run.setup is not None:
        lines += ["", "## Set-up", ""] + _setup_lines(run.setup)
    sections = [("Tier map", "tier_map.png", lambda: (_tier_map(run, plt, run.path), "")),
                ("Memory", "memory.png", lambda: _memory(run, plt, run.path)),
                ("Step time split", "time_split.png", lambda: _time_split(run, plt, run.path)),
                ("Loss", "loss.png", lambda: (_loss(run, plt, run.path), "")),
                ("Step time", "step_time.png", lambda: (_step_time(run, plt, run.path), ""))]
    for heading, png, draw in sections:
        stale = run.path / png
        if stale.exists():
            stale.unlink()  # a skipped plot must not leave an older run's picture behind
        skipped, note = draw()
        lines += ["", f"## {heading}", ""]
        if skipped:
            lines.append(f"Skipped: {skipped}.")
            continue
        lines.append(f"![{heading}]({png})")
        if note:
            lines += ["", f"Note: {note}."]
    path = run.path / "report.md"
    _files.write_text(path, "\n".join(lines) + "\n")
    return path


def write_run(run_dir: str | Path, *, plan, record=None, steps: list[dict[str, Any]],
              losses: list[float] | None = None, peer_losses: list[float] | None = None,
              meta: dict[str, Any] | None = None, setup: dict[str, Any] | None = None) -> Path:
    """Writes a run directory in the format above (what opt.report() measured: the plan, the
    probe record, one line per step, optional losses) and then its report; returns
    report.md's path. Every step is written, with its loss; the last has no time_s when its
    end (the next step's start) has not come."""
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    _files.write_text(out / "plan.json", plan.text)
    if record is not None:
        record.save(out / "probe.json")
    rows = {row["step"]: dict(row) for row in steps}
    for n in range(max(len(losses or []), len(peer_losses or []))):  # a loss makes a step too
        rows.setdefault(n + 1, {"step": n + 1})
    lines = []
    for step in sorted(rows):
        row = rows[step]
        if "wait_s" in row and "stall_s" not in row:
            row["stall_s"] = row["wait_s"]
        if losses is not None and step - 1 < len(losses):
            row["loss"] = float(losses[step - 1])
        if peer_losses is not None and step - 1 < len(peer_losses):
            row["loss_peer"] = float(peer_losses[step - 1])
        lines.append(json.dumps(row))
    _files.write_text(out / "steps.jsonl", "\n".join(lines) + ("\n" if lines else ""))
    _files.write_text(out / "meta.json", json.dumps(meta or {"title": "emsa run"}, indent=2))
    if setup is not None:
        _files.write_text(out / "setup.json", json.dumps(setup, indent=2))
    elif (out / "setup.json").exists():
        (out / "setup.json").unlink()  # an older run's set-up must not be reported as this one's
    return write(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="emsa report",
                                     description="Write report.md and plots for a run directory.")
    parser.add_argument("run_dir", help="a run directory (plan.json, steps.jsonl, ...)")
    args = parser.parse_args(argv)
    try:
        path = write(args.run_dir)
    except RunDirError as e:
        print(f"emsa report: {e}", file=sys.stderr)
        return 2
    except (ImportError, OSError) as e:
        print(f"emsa report: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
