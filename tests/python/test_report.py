"""emsa report: run directories in, report.md and PNGs out; missing data and bad input."""

import json

import pytest

pytest.importorskip("matplotlib")

from conftest import CPU_PROFILE, ROOT  # noqa: E402

from emsa import report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ["tier_map.png", "memory.png", "time_split.png", "loss.png", "step_time.png"]
MiB = 1 << 20


def _param(index, name, module, tier, state_bytes):
    return {"index": index, "name": name, "module": module, "tier": tier,
            "state_bytes": state_bytes, "numel": state_bytes // 8, "trainable": True}


def _plan():
    """A hand-made plan: the embedding on the device, the last block and head on the host."""
    params = [
        _param(0, "head.weight", "head", "L2", 8 * MiB),
        _param(1, "embed.weight", "embed", "L1", 8 * MiB),
        _param(2, "blocks.0.attn.weight", "blocks.0.attn", "L1", 4 * MiB),
        _param(3, "blocks.0.mlp.weight", "blocks.0.mlp", "L1", 2 * MiB),
        _param(4, "blocks.1.attn.weight", "blocks.1.attn", "L2", 4 * MiB),
        _param(5, "blocks.1.mlp.weight", "blocks.1.mlp", "L2", 6 * MiB),
    ]
    prediction = {"period": 0.030, "hbm_time": 0.001, "d2h_time": 0.004, "h2d_time": 0.004,
                  "cpu_time": 0.012, "stall_time": 0.002, "step_time": 0.032,
                  "device_state_bytes": 14 * MiB, "host_state_bytes": 18 * MiB,
                  "peak_device_bytes": 100 * MiB}
    return {"format": "emsa.plan", "version": 1, "budget_bytes": 110 * MiB,
            "min_budget_bytes": 90 * MiB, "params": params, "prediction": prediction}


def _probe():
    # Forward order differs from the plan's index order: embed, blocks, head.
    order = {"embed.weight": 0, "blocks.0.attn.weight": 1, "blocks.0.mlp.weight": 2,
             "blocks.1.attn.weight": 3, "blocks.1.mlp.weight": 4, "head.weight": 5}
    memory = [{"module": "embed", "event": "forward_pre", "time": 0.0,
               "device_bytes": 40 * MiB},
              {"module": "blocks.0", "event": "forward_post", "time": 0.01,
               "device_bytes": 70 * MiB},
              {"module": "head", "event": "backward_post", "time": 0.03,
               "device_bytes": 50 * MiB}]
    return {"format": "emsa.probe", "version": 1, "params": [
        {"name": n, "forward_order": o} for n, o in order.items()], "memory": memory}


def _steps(n=20, full=True):
    rows = []
    for s in range(1, n + 1):
        row = {"step": s, "time_s": 0.032 + 0.001 * (s % 3)}
        if full:
            row.update(loss=4.0 / s, loss_peer=4.0 / s + 1e-7, hbm_s=0.001, d2h_s=0.005,
                       h2d_s=0.004, cpu_s=0.013, stall_s=0.003,
                       peak_device_bytes=(95 + s % 4) * MiB)
        rows.append(row)
    return rows


def _run_dir(path, *, plan=True, probe=True, steps=None, meta=True):
    path.mkdir(exist_ok=True)
    if plan:
        (path / "plan.json").write_text(json.dumps(_plan()))
    if probe:
        (path / "probe.json").write_text(json.dumps(_probe()))
    rows = _steps() if steps is None else steps
    (path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if meta:
        (path / "meta.json").write_text(json.dumps(
            {"title": "synthetic run", "device": "test | device", "commit": "abc1234",
             "hyperparameters": {"lr": 0.001, "betas": [0.9, 0.95]}}))
    return path


def test_full_run_writes_every_plot_and_the_report(tmp_path):
    run = _run_dir(tmp_path / "run")
    path = report.write(run)
    assert path == run / "report.md"
    text = path.read_text()
    for png in PLOTS:
        data = (run / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, png
        assert f"]({png})" in text
    assert "Skipped" not in text
    assert text.startswith("# synthetic run\n")
    assert "| device | test \\| device |" in text  # a pipe in meta must not break the table
    assert "| hyperparameters | lr 0.001, betas (0.9, 0.95) |" in text
    assert "| budget | 110.00 MiB |" in text
    assert "| predicted step | 32.000 ms |" in text
    assert "| measured peak device memory | 98.00 MiB |" in text
    assert "| final loss | 0.200000 |" in text
    assert "| parameters | 6 (3 in L2, 3 in L1) |" in text


def test_missing_data_skips_plots_with_reasons(tmp_path):
    run = _run_dir(tmp_path / "run", probe=False, meta=False, steps=_steps(full=False))
    (run / "loss.png").write_bytes(PNG_MAGIC)  # an older run's plot must not survive
    text = report.write(run).read_text()
    assert (run / "tier_map.png").exists() and (run / "step_time.png").exists()
    for png in ("memory.png", "time_split.png", "loss.png"):
        assert not (run / png).exists(), png
        assert f"]({png})" not in text
    assert "Skipped: steps.jsonl has no loss." in text
    assert "Skipped: no device memory was recorded" in text
    assert "Skipped: steps.jsonl has no per-engine times" in text
    assert "(no meta.json)" in text


def test_partial_data_draws_what_exists_and_notes_the_rest(tmp_path):
    steps = [{"step": s, "time_s": 0.03, "cpu_s": 0.01, "loss": 1.0 / s} for s in range(1, 6)]
    run = _run_dir(tmp_path / "run", steps=steps)
    text = report.write(run).read_text()
    assert (run / "memory.png").exists()  # the probe's timeline alone is enough
    assert "steps.jsonl has no peak_device_bytes: measured peaks left out" in text
    assert (run / "time_split.png").exists()
    assert "not measured, drawn as 0: hbm_s, d2h_s, h2d_s, stall_s" in text


def test_tier_groups_follow_forward_order_and_sum_per_tier():
    groups = report.tier_groups(_plan(), _probe())
    assert list(groups) == ["embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn",
                            "blocks.1.mlp", "head"]
    assert groups["embed"] == {"L1": 8 * MiB}
    assert groups["head"] == {"L2": 8 * MiB}
    coarse = report.tier_groups(_plan(), _probe(), max_groups=4)
    assert coarse == {"embed": {"L1": 8 * MiB}, "blocks.0": {"L1": 6 * MiB},
                      "blocks.1": {"L2": 10 * MiB}, "head": {"L2": 8 * MiB}}
    coarser = report.tier_groups(_plan(), _probe(), max_groups=3)
    assert coarser == {"embed": {"L1": 8 * MiB}, "blocks": {"L1": 6 * MiB, "L2": 10 * MiB},
                       "head": {"L2": 8 * MiB}}
    # Without a probe the plan's parameter order stands.
    assert list(report.tier_groups(_plan(), None))[:2] == ["head", "embed"]


def test_real_plan_of_a_1b_model(tmp_path):
    """The plan the C++ planner writes for the shipped 1.1B probe, under a budget that sends
    most state to the host: the tier map groups 201 leaf modules into blocks."""
    import emsa

    record = emsa.ProbeRecord.load(ROOT / "examples" / "probes" / "llama-1.1b.json")
    plan = emsa.make_plan(record, CPU_PROFILE, budget="16GiB")
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(plan.text)
    (run / "probe.json").write_text(record.to_json())
    (run / "steps.jsonl").write_text(json.dumps({"step": 1, "time_s": 0.3}) + "\n")
    report.write(run)
    groups = report.tier_groups(plan.json, json.loads(record.to_json()))
    assert len(groups) <= report.MAX_BARS
    assert list(groups)[0] == "model.embed_tokens" and "model.layers.21" in groups
    for tier in ("L1", "L2"):
        want = sum(p["state_bytes"] for p in plan.json["params"] if p["tier"] == tier)
        assert sum(g.get(tier, 0) for g in groups.values()) == want > 0
    assert (run / "tier_map.png").read_bytes()[:8] == PNG_MAGIC
    assert (run / "memory.png").exists()


def test_main_prints_the_path(tmp_path, capsys):
    run = _run_dir(tmp_path / "run")
    assert report.main([str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "report.md")


@pytest.mark.parametrize("setup, expect", [
    ("missing", "does not exist"),
    ("file", "is not a directory"),
    ("no_plan", "has no plan.json"),
    ("no_steps", "has no steps.jsonl"),
    ("bad_plan", "plan.json: not valid JSON"),
    ("not_a_plan", 'expected {"format": "emsa.plan"'),
    ("bad_line", "steps.jsonl line 2: not valid JSON"),
    ("no_time", "steps.jsonl line 1: 'time_s' is missing"),
    ("no_time_before_the_last", "steps.jsonl line 1: 'time_s' is missing"),
    ("empty_steps", "holds no steps"),
    ("bad_probe", "not a probe record"),
    ("bad_param", "params[1] lacks"),
])
def test_bad_run_dir_exits_2_saying_what_is_wrong(tmp_path, capsys, setup, expect):
    run = tmp_path / "run"
    if setup == "file":
        run.write_text("x")
    elif setup != "missing":
        _run_dir(run)
        if setup == "no_plan":
            (run / "plan.json").unlink()
        elif setup == "no_steps":
            (run / "steps.jsonl").unlink()
        elif setup == "bad_plan":
            (run / "plan.json").write_text("{not json")
        elif setup == "not_a_plan":
            (run / "plan.json").write_text(json.dumps({"format": "emsa.probe"}))
        elif setup == "bad_line":
            (run / "steps.jsonl").write_text('{"step": 1, "time_s": 0.1}\n{oops\n')
        elif setup == "no_time":
            (run / "steps.jsonl").write_text('{"step": 1}\n')
        elif setup == "no_time_before_the_last":
            (run / "steps.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
        elif setup == "empty_steps":
            (run / "steps.jsonl").write_text("\n")
        elif setup == "bad_param":
            plan = _plan()
            del plan["params"][1]["tier"]
            (run / "plan.json").write_text(json.dumps(plan))
        elif setup == "bad_probe":
            (run / "probe.json").write_text("[]")
    before = sorted(p.name for p in run.iterdir()) if run.is_dir() else None
    assert report.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("emsa report: ") and expect in err, err
    if before is not None:  # bad input changes nothing
        assert sorted(p.name for p in run.iterdir()) == before


def test_optimizer_report_writes_a_run_directory_and_its_report(tmp_path):
    """opt.report(): the plan, the probe record, the measured steps (wall clock on the CPU)
    with the losses given, meta; then report.md with its plots."""
    import torch

    import emsa

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = emsa.AdamW(model.parameters(), lr=1e-2, profile=CPU_PROFILE)
    with pytest.raises(ValueError, match="has not planned yet"):
        opt.report(tmp_path / "early")
    losses = []
    for _ in range(5):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    stats = opt.step_stats()
    assert [r["step"] for r in stats] == [1, 2, 3, 4, 5]
    assert all(r["time_s"] > 0 for r in stats[:-1]) and "time_s" not in stats[-1]
    assert all(r["opt_s"] > 0 for r in stats)
    path = opt.report(tmp_path / "run", losses=losses, meta={"title": "tiny"})
    run = tmp_path / "run"
    assert path == run / "report.md" and path.read_text().startswith("# tiny")
    assert json.loads((run / "plan.json").read_text())["params"]
    assert (run / "probe.json").exists()
    rows = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # every step, the last one too
    assert [r["loss"] for r in rows] == pytest.approx(losses)
    assert "time_s" not in rows[-1]  # its end, the next step's start, has not come
    for png in ("tier_map.png", "loss.png", "step_time.png"):
        assert (run / png).read_bytes()[:8] == PNG_MAGIC, png
