"""Hostile input: every CLI and C ABI call answers with exit 0, 2 or 3 and a message.

Never a signal, a traceback or a hang (each child runs under a timeout, a hang guard rather than
a duration assertion), and the child's peak memory stays under 4x the input's size + 256 MiB
(for the Python CLI, above the resident size of the same command on a tiny input: importing
torch alone holds more than that). Files emsa writes are replaced atomically.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import CPU_PROFILE, ROOT

HANG_GUARD_S = 60  # far above the few seconds the slowest case takes on a loaded machine
MIB = 1 << 20
PROBE = ROOT / "examples" / "probes" / "tiny-gpt.json"
CLI_BINARY = Path(os.environ.get("EMSA_LIBRARY", ROOT / "build" / "libemsa.so")).parent / "emsa"


# Runs argv from a small process and reports its wait status and peak RSS: a child forked from
# this (large) test process would count the test's own pages in its ru_maxrss.
LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write("%d %d" % (status, usage.ru_maxrss))
"""


def run_child(argv, env=None):
    """(exit code, stdout, stderr, peak RSS in bytes) of argv; fails on a hang or a signal."""
    with tempfile.TemporaryDirectory() as d, open(os.devnull, "rb") as stdin, \
            open(Path(d) / "out", "w+b") as out, open(Path(d) / "err", "w+b") as err:
        result = Path(d) / "result"
        p = subprocess.Popen([sys.executable, "-S", "-c", LAUNCHER, str(result), *argv],
                             stdin=stdin, stdout=out, stderr=err, env=env,
                             start_new_session=True)
        try:
            p.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            pytest.fail(f"{argv} still ran after {HANG_GUARD_S} s")
        status, maxrss_kib = map(int, result.read_text().split())
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    assert code >= 0, f"{argv} died of signal {signal.Signals(-code).name}: {stderr[-2000:]}"
    return code, stdout, stderr, maxrss_kib * 1024


def python_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    return run_child([sys.executable, "-m", "emsa", *map(str, args)], env=env)


def cpp_cli(*args):
    if not CLI_BINARY.exists():
        pytest.skip(f"no C++ CLI at {CLI_BINARY}")
    return run_child([str(CLI_BINARY), *map(str, args)])


def input_size(path) -> int:
    p = Path(path)
    return p.stat().st_size if p.is_file() else 0


def assert_answered(result, argv_input, allowed=(2, 3), baseline=0, what=None):
    code, out, err, peak = result
    assert code in allowed, f"exit {code}: {err[-2000:]}"
    assert "Traceback" not in err, err[-4000:]
    if code != 0:
        assert err.strip(), "a failure must say why"
        if what is not None:
            assert what in err, err[-2000:]
    bar = 4 * input_size(argv_input) + 256 * MIB
    assert peak - baseline <= bar, f"peak {peak / MIB:.0f} MiB (baseline {baseline / MIB:.0f})"


# ---- inputs ----------------------------------------------------------------------------------

def _huge_params(path):
    doc = json.loads(PROBE.read_text())
    params = doc["params"][:4]
    for p in params:  # four parameters of 2^60 fp32 elements: the byte sum wraps uint64
        p.update(shape=[1 << 60], numel=1 << 60, dtype="float32", bytes=1 << 62,
                 tied_names=[])
    doc.update(params=params, memory=[], graph=[])
    path.write_text(json.dumps(doc))


def _many_samples(path, n_params=20000, n_samples=20000):
    """A valid record with many parameters and memory samples, for the in-backward path."""
    params, memory = [], []
    for i in range(n_params):
        params.append({"name": f"p{i}", "module": f"m{i}", "shape": [64], "dtype": "float32",
                       "numel": 64, "bytes": 256, "trainable": True, "tied_names": [],
                       "use_count": 1, "forward_order": i, "forward_time": i * 1e-6,
                       "grad_ready_order": n_params - 1 - i,
                       "grad_ready_time": 1.0 + (n_params - i) * 1e-6})
    for k in range(n_samples):
        memory.append({"module": f"m{k % n_params}", "event": "backward_post",
                       "time": 1.0 + k * 1e-6, "device_bytes": 1 << 20})
    doc = {"format": "emsa.probe", "version": 1, "model": "many", "device": "analytic",
           "forward_time": 1.0, "backward_time": 1.0, "period_under_load": 0.0,
           "peak_device_bytes": 1 << 30, "activation_peak_bytes": 1 << 29, "params": params,
           "memory": memory, "graph": []}
    path.write_text(json.dumps(doc))


def _config(path, layers):
    path.write_text('{"model_type": "llama", "hidden_size": 8, "intermediate_size": 8, '
                    f'"num_hidden_layers": {layers}, "num_attention_heads": 1, '
                    '"vocab_size": 8}')


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    files = {
        "keys": ("{" + ",".join(f'"k{i:06d}": {i}' for i in range(120_000)) + "}"),
        "deep": "[" * 100_000 + "]" * 100_000,
        "deep_object": '{"a":' * 50_000 + "1" + "}" * 50_000,
        "array": "[" + ",".join(["0"] * 10_000_000) + "]",
        "strings": "[" + ",".join(['"x"'] * 3_000_000) + "]",
        "truncated": PROBE.read_text()[:5000],
        "empty": "",
        "not_utf8": None,
        "nul": None,
    }
    out = {}
    for name, text in files.items():
        out[name] = d / f"{name}.json"
        if text is not None:
            out[name].write_text(text)
    out["not_utf8"].write_bytes(b'{"format": "\xff\xfe"}')
    out["nul"].write_bytes(b"\0" * (20 * MIB))
    out["huge_params"] = d / "huge_params.json"
    _huge_params(out["huge_params"])
    out["many"] = d / "many.json"
    _many_samples(out["many"])
    for layers in ("1e6", "1e5", "100000", "1000000", "4097"):
        out[f"layers_{layers}"] = d / f"layers_{layers}" / "config.json"
        out[f"layers_{layers}"].parent.mkdir()
        _config(out[f"layers_{layers}"], layers)
    out["zero"] = Path("/dev/zero")
    return out


def _large_record(path, n_params, name_pad=0):
    """A valid record of n_params parameters, pretty-printed as ProbeRecord.save writes it, and
    written one parameter at a time (100k parameters: 34 MB)."""
    with open(path, "w") as f:
        f.write('{\n  "format": "emsa.probe",\n  "version": 1,\n  "model": "large",\n'
                '  "device": "analytic",\n  "forward_time": 1.0,\n  "backward_time": 1.0,\n'
                '  "peak_device_bytes": 1073741824,\n  "activation_peak_bytes": 536870912,\n'
                '  "params": [\n')
        for i in range(n_params):
            module = f"model.layers.{i // 8}.w{i % 8}" + "x" * name_pad
            p = {"name": module + ".weight", "module": module, "shape": [64, 4],
                 "dtype": "float32", "numel": 256, "bytes": 1024, "trainable": True,
                 "tied_names": [], "use_count": 1, "forward_order": i, "forward_time": i * 1e-6,
                 "grad_ready_order": n_params - 1 - i,
                 "grad_ready_time": 1.0 + (n_params - i) * 1e-6}
            f.write(("," if i else "") + json.dumps(p, indent=2) + "\n")
        f.write("  ]\n}\n")


@pytest.fixture(scope="module")
def large_records(tmp_path_factory):
    """The 100k-parameter record, and the largest one the limits let through: 240k parameters
    (3.9 M of the 4 M JSON values a document may hold) in just under the 128 MiB a file may
    have."""
    d = tmp_path_factory.mktemp("large")
    out = {"large": d / "large.json", "largest": d / "largest.json"}
    _large_record(out["large"], 100_000)
    _large_record(out["largest"], 240_000, name_pad=106)
    assert 120 * MIB < out["largest"].stat().st_size <= 128 * MIB
    return out


BAD_RECORDS = ["zero", "nul", "array", "strings", "keys", "deep", "deep_object", "truncated",
               "empty", "not_utf8", "huge_params"]
BAD_CONFIGS = ["layers_1e6", "layers_1e5", "layers_100000", "layers_1000000", "layers_4097"]


@pytest.fixture(scope="module")
def python_baseline():
    """The Python CLI's resident size on a tiny valid input: torch's import, mostly."""
    return python_cli("plan", PROBE, "--profile", CPU_PROFILE, "--summary")[3]


# ---- the C++ CLI -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", BAD_RECORDS)
def test_cpp_cli_refuses_a_hostile_record(inputs, name):
    assert_answered(cpp_cli("plan", inputs[name], "--profile", CPU_PROFILE, "--summary"),
                    inputs[name])


@pytest.mark.parametrize("name", BAD_RECORDS)
def test_cpp_cli_refuses_a_hostile_profile(inputs, name):
    assert_answered(cpp_cli("plan", PROBE, "--profile", inputs[name], "--summary"), inputs[name])


@pytest.mark.parametrize("name", BAD_CONFIGS)
def test_cpp_cli_refuses_too_many_layers(inputs, name):
    r = cpp_cli("plan", "--model", inputs[name], "--summary")
    assert_answered(r, inputs[name], what="num_hidden_layers")


def test_cpp_cli_names_the_byte_limit(inputs):
    r = cpp_cli("plan", inputs["huge_params"], "--profile", CPU_PROFILE, "--budget", "1GiB")
    assert_answered(r, inputs["huge_params"], what="exceeds the limit")
    assert "MiB" not in r[1], "no plan may be printed for wrapped sizes"


def test_cpp_cli_plans_many_samples_in_backward(inputs):
    for extra in ([], ["--step-in-backward"]):
        r = cpp_cli("plan", inputs["many"], "--profile", CPU_PROFILE, "--summary", *extra)
        assert_answered(r, inputs["many"], allowed=(0, 3))


@pytest.mark.parametrize("name", ["large", "largest"])
@pytest.mark.parametrize("output", ["--summary", "--verbose", "--json"])
def test_cpp_cli_plans_a_large_record_within_the_memory_bar(large_records, name, output,
                                                            tmp_path):
    # The document is never held beside the record, nor the plan's JSON built unless it is
    # written: the peak is the text, the record and the plan, each once.
    args = ["--json", tmp_path / "plan.json"] if output == "--json" else [output]
    r = cpp_cli("plan", large_records[name], "--profile", CPU_PROFILE, *args)
    assert_answered(r, large_records[name], allowed=(0,))
    if output == "--json":
        with open(tmp_path / "plan.json") as f:
            assert f.read(64).startswith('{\n  "format": "emsa.plan"')


@pytest.mark.parametrize("args", [["--budget", "99999999999999999999PiB"],
                                  ["--budget", "-1"], ["--bucket-bytes", "1EiB"],
                                  ["--bucket-bytes", "0"], ["--budget", "1e400GiB"]])
def test_cpp_cli_refuses_absurd_sizes(args):
    assert_answered(cpp_cli("plan", PROBE, "--profile", CPU_PROFILE, *args), PROBE)


def test_cpp_cli_json_output_replaces_atomically(tmp_path):
    out = tmp_path / "plan.json"
    out.write_text("old")
    r = cpp_cli("plan", PROBE, "--profile", CPU_PROFILE, "--summary", "--json", out)
    assert r[0] == 0, r[2]
    assert json.loads(out.read_text())["format"] == "emsa.plan"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"], "no temporary left"
    r = cpp_cli("plan", PROBE, "--profile", CPU_PROFILE, "--json", tmp_path / "no" / "p.json")
    assert r[0] == 1 and "p.json" in r[2]


# ---- the Python CLI --------------------------------------------------------------------------

@pytest.mark.parametrize("name", BAD_RECORDS)
def test_python_cli_refuses_a_hostile_record(inputs, name, python_baseline):
    r = python_cli("plan", inputs[name], "--profile", CPU_PROFILE, "--summary")
    assert_answered(r, inputs[name], baseline=python_baseline)


@pytest.mark.parametrize("name", ["zero", "nul", "deep", "keys", "truncated"])
def test_python_cli_refuses_a_hostile_profile(inputs, name, python_baseline):
    r = python_cli("plan", PROBE, "--profile", inputs[name], "--summary")
    assert_answered(r, inputs[name], baseline=python_baseline)


@pytest.mark.parametrize("name", BAD_CONFIGS[:2])
def test_python_cli_refuses_too_many_layers(inputs, name, python_baseline):
    r = python_cli("plan", "--model", inputs[name], "--summary")
    assert_answered(r, inputs[name], baseline=python_baseline, what="num_hidden_layers")


def test_python_cli_plans_many_samples_in_backward(inputs, python_baseline):
    r = python_cli("plan", inputs["many"], "--profile", CPU_PROFILE, "--summary",
                   "--step-in-backward")
    assert_answered(r, inputs["many"], allowed=(0, 3), baseline=python_baseline)


# ---- the C ABI, through ctypes in a child ----------------------------------------------------

# emsa_plan_create (through plan._create, the ctypes call itself) and emsa_model_probe.
C_ABI_CHILD = """
import sys
from emsa._native.library import EmsaError
from emsa._native.models import model_probe
from emsa._native.planner import _create, _plan_options
kind, path = sys.argv[1], sys.argv[2]
try:
    if kind == "model":
        model_probe(path)
    else:
        with open(path, "rb") as f:
            text = f.read(200 << 20).decode("utf-8", errors="replace").replace("\\0", " ")
        other = open(sys.argv[3]).read()
        probe, profile = (text, other) if kind == "record" else (other, text)
        _create(probe, profile, _plan_options(budget="1GiB"))
except EmsaError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
"""


def c_abi(kind, path, other=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    return run_child([sys.executable, "-c", C_ABI_CHILD, kind, str(path), str(other)], env=env)


@pytest.mark.parametrize("name", ["array", "strings", "keys", "deep", "deep_object", "truncated",
                                  "huge_params", "nul"])
def test_c_abi_refuses_a_hostile_record(inputs, name, python_baseline):
    r = c_abi("record", inputs[name], CPU_PROFILE)
    assert_answered(r, inputs[name], baseline=python_baseline)


def test_c_abi_plans_a_large_record_within_the_memory_bar(large_records, python_baseline):
    r = c_abi("record", large_records["large"], CPU_PROFILE)
    assert_answered(r, large_records["large"], allowed=(0,), baseline=python_baseline)


@pytest.mark.parametrize("name", ["array", "keys", "deep"])
def test_c_abi_refuses_a_hostile_profile(inputs, name, python_baseline):
    r = c_abi("profile", inputs[name], PROBE)
    assert_answered(r, inputs[name], baseline=python_baseline)


@pytest.mark.parametrize("name", BAD_CONFIGS)
def test_c_abi_refuses_too_many_layers(inputs, name, python_baseline):
    r = c_abi("model", inputs[name])
    assert_answered(r, inputs[name], baseline=python_baseline, what="num_hidden_layers")


# ---- atomic writes and bounded reads in Python -----------------------------------------------

def test_probe_record_save_keeps_the_old_file_when_interrupted(tmp_path, monkeypatch):
    from emsa import _files
    from emsa.probe_record import ProbeRecord

    record = ProbeRecord.load(PROBE)
    target = tmp_path / "probe.json"
    target.write_text("the old record")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_files.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        record.save(target)
    assert target.read_text() == "the old record"
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"], "no temporary left"
    monkeypatch.undo()
    record.save(target)
    assert ProbeRecord.load(target).to_json() == record.to_json()
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"]
    assert (target.stat().st_mode & 0o777) == (0o666 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("name,what", [("zero", "larger than"), ("nul", "NUL"),
                                       ("deep", "nests too deeply"), ("not_utf8", "UTF-8")])
def test_probe_record_load_refuses_hostile_files(inputs, name, what):
    from emsa.probe_record import ProbeRecord

    with pytest.raises(ValueError, match=what):
        ProbeRecord.load(inputs[name])
