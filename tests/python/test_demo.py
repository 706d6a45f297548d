"""emsa demo: a tiny run end to end, a broken comparison, bad arguments; its corpus, model and
progress bar."""

import io
import math
import json

import pytest
import torch

from emsa import _demo_model as corpus
from emsa import demo
from emsa._demo_model import GPT, GPTConfig
from emsa._progress import Progress

TINY = ["--steps", "6", "--layers", "1", "--d-model", "32", "--heads", "2", "--block-size",
        "16", "--batch-size", "4", "--device", "cpu", "--quiet"]


def test_tiny_demo_agrees_with_torch_and_writes_the_run_dir(tmp_path, capsys):
    out = tmp_path / "run"
    assert demo.main(TINY + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "equal within tolerance" in printed and f"report: {out / 'report.md'}" in printed
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for r in steps:
        assert abs(r["loss"] - r["loss_peer"]) <= demo.LOSS_ATOL
        assert r["time_s"] > 0 and r["opt_s"] > 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["format"] == "emsa.plan" and len(plan["params"]) > 0
    assert json.loads((out / "probe.json").read_text())["format"] == "emsa.probe"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["result"] == "equal within tolerance" and meta["steps"] == 6
    assert "loss.png" in (out / "report.md").read_text()
    assert (out / "loss.png").exists() and (out / "tier_map.png").exists()


def test_lr_schedule_reaches_both_optimizers(tmp_path):
    """Warmup then cosine: the lr recorded per step rises, then falls to min_lr_frac."""
    out = tmp_path / "run"
    assert demo.main(TINY[:1] + ["12"] + TINY[2:] + ["--out", str(out)]) == 0
    lrs = [json.loads(line)["lr"] for line in (out / "steps.jsonl").read_text().splitlines()]
    hyper = demo.Hyper()
    assert lrs[0] == pytest.approx(hyper.lr)  # 12 steps: a warmup of one step
    assert lrs[-1] < lrs[1] and lrs[-1] >= hyper.lr * hyper.min_lr_frac


def test_a_different_peer_fails_the_comparison(tmp_path, monkeypatch, capsys):
    real = demo._peer_optimizer

    def wrong_lr(groups, hyper):
        return real(groups, demo.Hyper(lr=hyper.lr * 3))

    monkeypatch.setattr(demo, "_peer_optimizer", wrong_lr)
    out = tmp_path / "run"
    assert demo.main(TINY + ["--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "DIFFERENT" in captured.out
    assert "emsa.AdamW and torch.optim.AdamW differ" in captured.err
    assert "losses differ" in captured.err or "parameter" in captured.err
    assert (out / "report.md").exists()  # the evidence is still written


@pytest.mark.parametrize("args, expect", [
    (["--steps", "0"], "--steps is 0"),
    (["--d-model", "30", "--heads", "4"], "not a multiple"),
])
def test_bad_sizes(tmp_path, capsys, args, expect):
    assert demo.main(TINY + args + ["--out", str(tmp_path / "run")]) == 2
    assert expect in capsys.readouterr().err


def test_out_that_is_a_file_exits_2(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("keep me")
    assert demo.main(TINY + ["--out", str(target)]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert target.read_text() == "keep me"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_exits_2(tmp_path, capsys):
    assert demo.main(["--device", "cuda", "--out", str(tmp_path / "run")]) == 2
    assert "use --device cpu" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---- corpus ---------------------------------------------------------------------------------
def test_corpus_is_deterministic_and_round_trips():
    a, b = corpus.make_text(5000, seed=3), corpus.make_text(5000, seed=3)
    assert a == b and len(a) == 5000
    assert corpus.make_text(5000, seed=4) != a
    assert corpus.decode(corpus.encode(a)) == a
    with pytest.raises(ValueError, match="'#' is not in the demo's alphabet"):
        corpus.encode("ab#")


def test_batches_are_shifted_windows_and_repeat_per_seed():
    tokens = torch.arange(100)
    x, y = corpus.Batches(tokens, 3, 8, seed=1).next()
    assert x.shape == y.shape == (3, 8)
    torch.testing.assert_close(y[:, :-1], x[:, 1:])
    torch.testing.assert_close(y, x + 1)  # tokens are consecutive integers here
    x2, _ = corpus.Batches(tokens, 3, 8, seed=1).next()
    torch.testing.assert_close(x, x2)
    with pytest.raises(ValueError, match="too few"):
        corpus.Batches(torch.arange(5), 1, 8, seed=0)


# ---- model ----------------------------------------------------------------------------------
def test_model_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16))
    idx = torch.randint(0, 11, (2, 8))
    changed = idx.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 11
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5], rtol=0, atol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])
    loss = model(idx, idx)
    assert loss.dim() == 0 and loss.item() == pytest.approx(math.log(11), rel=0.1)


def test_tied_head_shares_the_embedding():
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=16,
                          tie_head=True))
    assert model.head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names and "wte.weight" in names
    with pytest.raises(ValueError, match="longer than block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


# ---- progress bar ---------------------------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_plain_lines_when_not_a_tty():
    stream = io.StringIO()
    bar = Progress(100, label="training", stream=stream, lines=4)
    for i in range(1, 101):
        bar.update(i, loss=1.5)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and "\r" not in stream.getvalue()
    assert lines[-1].startswith("training [" + "#" * 30 + "] 100/100")
    assert "loss 1.5000" in lines[-1]


def test_progress_redraws_one_line_on_a_tty():
    stream = _Tty()
    bar = Progress(10, stream=stream, interval=0.0)
    for i in range(1, 11):
        bar.update(i)
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 10 and text.endswith("\n") and text.count("\n") == 1
    assert "10/10" in text.split("\r")[-1]


def test_progress_quiet_writes_nothing():
    stream = _Tty()
    bar = Progress(10, stream=stream, quiet=True)
    for i in range(1, 11):
        bar.update(i)
    bar.close()
    assert stream.getvalue() == ""
