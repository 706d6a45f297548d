"""Where the set-up seconds go (opt.setup_stats()["times"], record.setup_times, the report's Set-up section),
the machine's profile cache as Python and the `emsa profile` command see it, and the progress line
a long set-up shows. No durations are asserted: only which phases were timed, where the profile
came from (proved by the measurement counter and the source line, never by timing) and what
the line says. The cache folder is each test's own tmp_path, or the session's (conftest sets
XDG_CACHE_HOME): never the user's."""

import io
import json
import logging
import subprocess
import sys

import pytest
import torch

import emsa
from conftest import CPU_PROFILE, requires_cuda, subprocess_env
from emsa import _progress
from emsa._native import profile_cache as _profile_cache
from models import TinyGPT, gpt_batches


# ---- the profile cache, from Python ------------------------------------------------------------
def _cache_file(folder) -> dict:
    (path,) = folder.glob("profile-*.json")
    return json.loads(path.read_text())


def _spoil(folder, edit) -> None:
    (path,) = folder.glob("profile-*.json")
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def test_a_good_cache_is_used_without_measuring(tmp_path):
    first = _profile_cache.cached_profile(folder=tmp_path)
    assert not first["from_cache"] and "no cache file" in first["why_measured"]
    count = _profile_cache.measurement_count()
    second = _profile_cache.cached_profile(folder=tmp_path)
    assert second["from_cache"] and second["why_measured"] == ""
    assert _profile_cache.measurement_count() == count  # nothing measured
    assert second["profile"]["cpu"]["host_mem_bandwidth"] == \
        first["profile"]["cpu"]["host_mem_bandwidth"]
    assert _profile_cache.source_line(second).startswith(f"from cache {second['path']}")


@pytest.mark.parametrize("spoil, why", [
    (lambda p: p.write_text("{ not json"), "corrupt"),
    (lambda p: p.write_text("[]"), "corrupt"),
])
def test_a_corrupt_cache_is_measured_again_and_rewritten(tmp_path, spoil, why):
    _profile_cache.cached_profile(folder=tmp_path)
    (path,) = tmp_path.glob("profile-*.json")
    spoil(path)
    count = _profile_cache.measurement_count()
    again = _profile_cache.cached_profile(folder=tmp_path)
    assert not again["from_cache"] and why in again["why_measured"]
    assert _profile_cache.measurement_count() == count + 1
    assert _cache_file(tmp_path)["format"] == "emsa.profile_cache"  # rewritten whole
    assert _profile_cache.cached_profile(folder=tmp_path)["from_cache"]


def test_another_machines_cache_is_measured_again(tmp_path):
    _profile_cache.cached_profile(folder=tmp_path)
    _spoil(tmp_path, lambda d: d["key"].update(gpu="Some Other GPU", driver="1.0"))
    count = _profile_cache.measurement_count()
    again = _profile_cache.cached_profile(folder=tmp_path)
    assert not again["from_cache"] and "another machine" in again["why_measured"]
    assert _profile_cache.measurement_count() == count + 1
    assert _cache_file(tmp_path)["key"]["gpu"] != "Some Other GPU"


def test_an_old_cache_is_measured_again(tmp_path):
    _profile_cache.cached_profile(folder=tmp_path)
    _spoil(tmp_path, lambda d: d.update(measured_at=d["measured_at"] - 8 * 86400))  # > a week
    count = _profile_cache.measurement_count()
    again = _profile_cache.cached_profile(folder=tmp_path)
    assert not again["from_cache"] and "older than the age limit" in again["why_measured"]
    assert _profile_cache.measurement_count() == count + 1
    # A shorter age limit of the caller's own applies the same way.
    _spoil(tmp_path, lambda d: d.update(measured_at=d["measured_at"] - 60))
    assert not _profile_cache.cached_profile(folder=tmp_path, max_age=30)["from_cache"]


def test_measure_profile_goes_through_the_cache():
    emsa.measure_profile()  # the session's cache (conftest's XDG_CACHE_HOME)
    count = _profile_cache.measurement_count()
    emsa.measure_profile()
    assert _profile_cache.measurement_count() == count
    emsa.measure_profile(refresh=True)
    assert _profile_cache.measurement_count() == count + 1


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "emsa", "profile", *map(str, args)],
                          env=subprocess_env(), capture_output=True, text=True)


def test_emsa_profile_uses_the_cache_and_refresh_rewrites_it(tmp_path):
    first = _cli("--cache-dir", tmp_path)
    assert first.returncode == 0, first.stderr
    assert "measured now (no cache file yet)" in first.stderr
    stamp = _cache_file(tmp_path)["measured_at"]
    again = _cli("--cache-dir", tmp_path)
    assert again.returncode == 0 and "from cache" in again.stderr
    assert json.loads(again.stdout)["cpu"] == json.loads(first.stdout)["cpu"]
    assert _cache_file(tmp_path)["measured_at"] == stamp  # not rewritten
    _spoil(tmp_path, lambda d: d.update(measured_at=d["measured_at"] - 5))
    refreshed = _cli("--cache-dir", tmp_path, "--refresh")
    assert refreshed.returncode == 0 and "measured now (refresh requested)" in refreshed.stderr
    assert _cache_file(tmp_path)["measured_at"] > stamp - 5  # rewritten
    assert json.loads(refreshed.stdout)["version"] == 1
    bad = _cli("--max-age", "soon")
    assert bad.returncode == 2 and "--max-age takes whole seconds" in bad.stderr


# ---- set-up timings ----------------------------------------------------------------------------
def test_probe_times_its_phases_and_takes_the_profile_from_the_cache():
    model = TinyGPT()
    idx, targets = gpt_batches(1)[0]
    emsa.probe(model, idx, targets)  # fills the session's cache if nothing did yet
    count = _profile_cache.measurement_count()
    record = emsa.probe(model, idx, targets)
    assert _profile_cache.measurement_count() == count  # the second probe measured nothing
    assert record.profile_source.startswith("from cache ")
    assert list(record.setup_times) == ["profile", "trace", "passes"]  # CPU: no load passes
    given = emsa.probe(model, idx, targets, profile=CPU_PROFILE, trace=False)
    assert given.profile_source == "" and "profile" in given.setup_times
    assert "setup_times" not in json.loads(record.to_json())  # not part of the record's format


def _train(opt, model, steps=2):
    for _ in range(steps):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_optimizer_times_planning_and_names_its_profile():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    given = emsa.AdamW(model.parameters(), profile=CPU_PROFILE)
    _train(given, model)  # planned at the first step
    assert "plan" in given.setup_stats()["times"]
    assert given.setup_stats()["profile"] == "given (profile=)"
    measured = emsa.AdamW(model.parameters(), step_in_backward=True)
    summary = measured.setup_stats()
    assert list(summary["times"])[:1] in (["profile"], ["plan"])
    assert summary["total"] >= summary["times"]["plan"]
    assert summary["profile"]  # where it came from, whichever way the backend planned
    measured.remove_hooks()


def test_report_has_a_set_up_section(tmp_path):
    pytest.importorskip("matplotlib")
    model = TinyGPT()
    idx, targets = gpt_batches(1)[0]
    record = emsa.probe(model, idx, targets, profile=CPU_PROFILE, trace=False)
    opt = emsa.AdamW(model.parameters(), probe=record)
    for _ in range(2):  # a report needs a step with its time, which the next one ends
        model(idx, targets).backward()
        opt.step()
        opt.zero_grad()
    path = opt.report(tmp_path / "run")
    setup = json.loads((tmp_path / "run" / "setup.json").read_text())
    assert "plan" in setup["times"] and set(setup["probe"]["times"]) >= {"profile", "passes"}
    assert setup["profile"].startswith("the probe record's")
    text = path.read_text()
    assert "## Set-up" in text and "| plan |" in text and "emsa.probe:" in text
    assert "Profile: " in text


# ---- the progress line -------------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _run_setup(stream, threshold, tty=None):
    times: dict[str, float] = {}
    scope = _progress.Setup("test set-up", stream=stream, threshold=threshold, tty=tty,
                            background=False)
    _progress._active.append(scope)
    try:
        with _progress.timed("host_arena", times) as phase:
            phase.progress(1, 4)
            scope.tick()
        with _progress.timed("bind", times):
            scope.tick()
    finally:
        _progress._active.remove(scope)
        scope.close()
    return times


def test_progress_line_on_a_terminal_says_what_and_how_far():
    out = _Terminal()
    times = _run_setup(out, threshold=0.0)
    assert list(times) == ["host_arena", "bind"]
    text = out.getvalue()
    assert "\r\x1b[K" in text and text.endswith("\n")
    assert "host_arena 25%" in text  # what it is doing, how far along
    assert "done: host_arena" in text  # what finished
    assert "took" in text.splitlines()[-1].split("\r")[-1]  # the line ends with the breakdown


def test_progress_line_is_silent_for_a_short_set_up_and_off_a_terminal():
    quick = _Terminal()
    _run_setup(quick, threshold=1e9)
    assert quick.getvalue() == ""
    log = io.StringIO()
    _run_setup(log, threshold=0.0, tty=False)
    assert log.getvalue() == ""  # not a terminal, not verbose


def test_progress_off_a_terminal_at_verbose_level_writes_plain_lines(caplog):
    log = io.StringIO()
    with caplog.at_level(logging.INFO, logger="emsa"):
        _run_setup(log, threshold=0.0, tty=False)
    text = log.getvalue()
    assert "\r" not in text and "host_arena" in text and "bind" in text
    assert any("took" in r.getMessage() and "host_arena" in r.getMessage()
               for r in caplog.records)  # the breakdown, at verbose level


def test_timed_outside_a_set_up_adds_up_in_order():
    times: dict[str, float] = {}
    for phase in ("profile", "plan", "profile"):
        with _progress.timed(phase, times):
            pass
    assert list(times) == ["profile", "plan"] and all(v >= 0 for v in times.values())


# ---- on a GPU ----------------------------------------------------------------------------------
@requires_cuda
def test_cuda_probe_and_host_tier_constructor_take_the_profile_from_the_cache():
    model = TinyGPT().cuda()
    idx, targets = (t.cuda() for t in gpt_batches(1)[0])
    emsa.probe(model, idx, targets)  # measures into the session's cache if nothing did yet
    count = _profile_cache.measurement_count()
    record = emsa.probe(model, idx, targets)
    assert _profile_cache.measurement_count() == count
    assert record.profile_source.startswith("from cache ")
    assert record.profile["gpu"]["present"] and record.profile["gpu"]["h2d_bandwidth"] > 0
    # The first pass, the graph, the observed pass and the settled unobserved ones; no load
    # passes by default for a model whose optimizer state fits the device.
    assert list(record.setup_times) == ["profile", "passes", "trace"]
    assert record.period_under_load == 0.0
    opt = emsa.AdamW(model.parameters(), tier="host", step_in_backward=True)
    summary = opt.setup_stats()
    assert list(summary["times"])[:2] == ["profile", "plan"]
    assert summary["profile"].startswith("from cache ")
    assert _profile_cache.measurement_count() == count
    opt.remove_hooks()
