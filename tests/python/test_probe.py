"""emsa.probe: what it records, that it leaves the model exactly as it was, and that the C++
side accepts every record it makes."""

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import emsa
from conftest import CPU_PROFILE
from models import SmallCNN, TinyGPT, cnn_batches, gpt_batches, gpt_loss

PROFILE = str(CPU_PROFILE)  # a preset, so the tests do not spend time measuring


def probe_gpt(model=None, **kw):
    model = model or TinyGPT()
    idx, targets = gpt_batches(1)[0]
    return model, emsa.probe(model, idx, targets, profile=PROFILE, **kw)


def model_state(model):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [p.grad for p in model.parameters()],
        "grad_values": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
        "hooks": [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()],
    }


def assert_same_state(before, after):
    for a, b in zip(before["params"], after["params"]):
        assert torch.equal(a, b)
    for a, b in zip(before["grads"], after["grads"]):
        assert a is b  # the very same tensor objects (or None) are back
    for a, b in zip(before["grad_values"], after["grad_values"]):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(before["buffers"], after["buffers"]):
        assert torch.equal(a, b)
    assert before["training"] == after["training"]
    assert torch.equal(before["rng"], after["rng"])
    assert before["hooks"] == after["hooks"]


@pytest.mark.parametrize("kind", ["gpt", "cnn"])
def test_probe_leaves_model_state_bitwise_unchanged(kind):
    torch.manual_seed(0)
    if kind == "gpt":
        model = TinyGPT(dropout=0.2)  # dropout draws from the RNG the probe must restore
        args = gpt_batches(1)[0]
        gpt_loss(model, gpt_batches(1, seed=1)[0]).backward()  # grads the probe must not touch
    else:
        model = SmallCNN()  # BatchNorm: running statistics change in a train-mode forward
        args = (cnn_batches(1)[0][0],)
        model(cnn_batches(1, seed=1)[0][0]).sum().backward()
    next(model.parameters()).grad = None  # and one None grad
    model.train()
    model.get_submodule("fc" if kind == "cnn" else "ln_f").eval()  # mixed modes stay mixed
    before = model_state(model)
    record = emsa.probe(model, *args, profile=PROFILE)
    assert_same_state(before, model_state(model))
    assert len(record.params) == len(list(model.parameters()))


def test_probe_restores_state_when_the_forward_fails():
    model = SmallCNN()
    wrong = torch.randn(2, 5, 12, 12)  # wrong channel count
    before = model_state(model)
    with pytest.raises(RuntimeError):
        emsa.probe(model, wrong, profile=PROFILE)
    assert_same_state(before, model_state(model))


def test_tied_parameters_are_listed_once():
    model, record = probe_gpt()
    names = [p.name for p in record.params]
    assert "head.weight" not in names
    wte = record.param("head.weight")
    assert wte.name == "wte.weight" and wte.tied_names == ["head.weight"]
    assert wte.use_count == 2  # used by the embedding and by the head


def test_frozen_parameters_are_recorded_untrainable():
    model = TinyGPT()
    model.wpe.weight.requires_grad_(False)
    _, record = probe_gpt(model)
    wpe = record.param("wpe.weight")
    assert wpe.trainable is False and wpe.grad_ready_order == -1
    assert wpe.forward_order >= 0  # used in forward all the same


def test_orders_follow_forward_and_backward():
    _, record = probe_gpt()
    by_name = {p.name: p for p in record.params}
    assert by_name["wte.weight"].forward_order == 0  # the embedding is used first
    assert by_name["head.bias"].grad_ready_order == 0  # the head's gradient is ready first
    assert (by_name["blocks.0.qkv.weight"].forward_order
            < by_name["blocks.1.qkv.weight"].forward_order
            < by_name["ln_f.weight"].forward_order)
    assert (by_name["blocks.1.out.weight"].grad_ready_order
            < by_name["blocks.0.out.weight"].grad_ready_order)
    ready = sorted(record.params, key=lambda p: p.grad_ready_order)
    times = [p.grad_ready_time for p in ready]
    assert times == sorted(times)
    assert record.forward_time > 0 and record.backward_time > 0
    assert all(t >= record.forward_time for t in times)
    assert record.peak_device_bytes == 0  # a CPU probe measures no device memory
    assert record.period_under_load == 0.0  # nor times the model under the host tier's load
    events = {m.event for m in record.memory}
    assert events == {"forward_pre", "forward_post", "backward_post"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gradient_order_under_cuda_autocast_with_the_warmup_pass():
    """The warm-up pass runs inside the caller's autocast: its cached weight casts must not be
    reused by the observed pass (the order in which gradients become final broke: the
    embedding's came first, the planner put it in the first bucket, and the host tier updated it
    last although the next forward needs it first)."""
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    idx, targets = (t.cuda() for t in gpt_batches(1)[0])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        record = emsa.probe(model, idx, targets, profile=CPU_PROFILE, trace=False)
    by_name = {p.name: p for p in record.params}
    order = sorted(record.params, key=lambda p: p.grad_ready_order)
    assert {p.name for p in order[-2:]} == {"wte.weight", "wpe.weight"}, \
        f"gradient order: {[p.name for p in order]}"
    assert by_name["head.bias"].grad_ready_order == 0
    assert (by_name["ln_f.weight"].grad_ready_order
            < by_name["blocks.1.qkv.weight"].grad_ready_order
            < by_name["blocks.0.qkv.weight"].grad_ready_order)


def test_rescale_maps_observed_times_onto_unobserved_durations():
    """The hooks stretch a fast GPU's step; the probe rescales forward and backward times to an
    unobserved pass's durations, never lengthening them, keeping every order."""
    import importlib

    probe_module = importlib.import_module("emsa.probe")
    _, record = probe_gpt()
    f0, b0 = record.forward_time, record.backward_time
    before = [(p.forward_time, p.grad_ready_time) for p in record.params]
    samples = [m.time for m in record.memory]
    probe_module._rescale(record, f0 / 4, b0 / 2)
    assert record.forward_time == pytest.approx(f0 / 4)
    assert record.backward_time == pytest.approx(b0 / 2)
    for p, (fwd, ready) in zip(record.params, before):
        assert p.forward_time == pytest.approx(fwd / 4)
        assert p.grad_ready_time == pytest.approx(f0 / 4 + (ready - f0) / 2)
    for m, t in zip(record.memory, samples):
        want = t / 4 if t <= f0 else f0 / 4 + (t - f0) / 2
        assert m.time == pytest.approx(want)
    # A slower unobserved pass is noise: nothing lengthens.
    f1, b1 = record.forward_time, record.backward_time
    probe_module._rescale(record, f1 * 3, b1 * 3)
    assert (record.forward_time, record.backward_time) == (f1, b1)


def test_shared_module_use_count():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 4)
            self.shared = nn.Linear(4, 4)

        def forward(self, x):
            return self.shared(torch.relu(self.shared(self.inp(x)))).sum()

    record = emsa.probe(Shared(), torch.randn(3, 4), profile=PROFILE)
    assert record.param("shared.weight").use_count == 2
    assert record.param("inp.weight").use_count == 1
    assert record.param("inp.weight").forward_order < record.param("shared.weight").forward_order


def test_graph_where_fx_traces_and_none_where_it_does_not():
    cnn = emsa.probe(SmallCNN(), cnn_batches(1)[0][0], profile=PROFILE)
    assert cnn.graph, "SmallCNN traces with torch.fx"
    conv = [op for op in cnn.graph if "conv1.weight" in op.params]
    assert len(conv) == 1
    assert all(i < cnn.graph.index(op) for op in cnn.graph for i in op.inputs)
    _, gpt = probe_gpt()
    head = [op for op in gpt.graph if "head.bias" in op.params]
    assert len(head) == 1 and "head.weight" in head[0].params  # the tied alias, as named there

    class Branchy(nn.Module):  # data-dependent control flow: fx cannot trace; hooks suffice
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else -self.a(x)

    branchy = emsa.probe(Branchy(), torch.ones(2, 4), profile=PROFILE)
    assert branchy.graph == [] and branchy.param("a.weight").grad_ready_order >= 0
    _, untraced = probe_gpt(trace=False)
    assert untraced.graph == []


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, with_loss=True):
        logits = self.lin(x)
        return {"logits": logits, "loss": logits.pow(2).mean() if with_loss else None}


def test_default_loss_forms():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(2, dtype=torch.bfloat16, requires_grad=True)
    scalar = a.sum()
    assert emsa.default_loss(scalar) is scalar
    assert emsa.default_loss({"logits": a, "loss": scalar}) is scalar

    class HfLike:
        loss = scalar
        logits = a

    assert emsa.default_loss(HfLike()) is scalar
    fallback = emsa.default_loss({"logits": a, "loss": None, "extra": (b, [a])})
    assert torch.equal(fallback, a.sum() + b.float().sum() + a.sum())
    with pytest.raises(ValueError, match="loss_fn"):
        emsa.default_loss((torch.ones(2), torch.zeros(2, dtype=torch.long)))


def test_probe_uses_the_loss_it_is_given():
    x = torch.randn(3, 4)
    rec = emsa.probe(DictOut(), x, with_loss=False, profile=PROFILE)
    assert rec.param("lin.bias").grad_ready_order >= 0
    lin = nn.Linear(4, 2)
    seen = []
    rec = emsa.probe(lin, x, loss_fn=lambda out: seen.append(out) or out.abs().mean(),
                     profile=PROFILE)
    assert len(seen) == 1 and seen[0].shape == (3, 2)
    with pytest.raises(ValueError, match="scalar"):
        emsa.probe(lin, x, loss_fn=lambda out: out, profile=PROFILE)


def every_record():
    """A variety of records: every one must be accepted by the C++ parser and planner."""
    _, gpt = probe_gpt()
    frozen = TinyGPT()
    frozen.blocks[0].requires_grad_(False)
    _, gpt_frozen = probe_gpt(frozen)
    cnn = emsa.probe(SmallCNN(), cnn_batches(1)[0][0], profile=PROFILE)
    unused = SmallCNN()
    unused.extra = nn.Linear(2, 2)
    cnn_unused = emsa.probe(unused, cnn_batches(1)[0][0], profile=PROFILE)
    dict_out = emsa.probe(DictOut(), torch.randn(3, 4), profile=PROFILE)
    return [gpt, gpt_frozen, cnn, cnn_unused, dict_out]


def test_every_record_is_accepted_by_the_cpp_side(tmp_path):
    for i, record in enumerate(every_record()):
        record.check()
        plan = emsa.make_plan(record)
        assert len(plan.json["params"]) == len(record.params)
        path = tmp_path / f"record{i}.json"
        record.save(path)
        loaded = emsa.ProbeRecord.load(path)
        assert loaded == record
        assert loaded.to_json() == record.to_json()


def test_the_cpp_side_rejects_a_broken_record():
    _, record = probe_gpt()
    record.params[1].numel += 1
    with pytest.raises(emsa.EmsaError, match=r"params\[1\].*numel"):
        record.check()


def test_measured_profile_is_embedded():
    record = emsa.probe(nn.Linear(4, 4), torch.randn(2, 4))
    assert record.profile["cpu"]["logical_cores"] >= 1
    emsa.make_plan(record)


@pytest.mark.numerics
def test_optimizer_with_probe_plans_at_construction_and_matches_unprobed():
    torch.manual_seed(0)
    model = TinyGPT()
    twin = copy.deepcopy(model)
    _, record = probe_gpt(model)
    opt = emsa.AdamW(model.parameters(), lr=1e-3, probe=record)
    assert opt.plan is not None  # planned before any step
    assert "blocks.0.qkv.weight" in str(opt.plan)
    twin_opt = emsa.AdamW(twin.parameters(), lr=1e-3)
    ref = copy.deepcopy(twin)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for batch in gpt_batches(3):
        for m, o in ((model, opt), (twin, twin_opt), (ref, ref_opt)):
            o.zero_grad()
            gpt_loss(m, batch).backward()
            o.step()
    for p, q, r in zip(model.parameters(), twin.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        assert_close(p, r, rtol=1e-5, atol=1e-7)


def test_optimizer_matches_a_saved_record_by_name_or_position(tmp_path):
    model, record = probe_gpt()
    path = tmp_path / "gpt.json"
    record.save(path)
    by_name = emsa.AdamW(model.named_parameters(), probe=str(path))
    assert by_name.plan is not None
    by_position = emsa.AdamW(model.parameters(), probe=emsa.ProbeRecord.load(path))
    assert by_position.plan is not None
    # A subset of the model: the rest is planned as frozen, with no state laid out for it.
    subset = emsa.AdamW(model.blocks[1].named_parameters(prefix="blocks.1"), probe=str(path))
    planned = subset.probe_record
    assert planned.param("blocks.1.fc.weight").trainable
    assert not planned.param("blocks.0.fc.weight").trainable
    with pytest.raises(ValueError, match="probe record has"):
        emsa.AdamW(model.blocks[1].parameters(), probe=str(path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_probe_measures_memory_and_restores_cuda_rng():
    model = TinyGPT(dropout=0.2).cuda()
    idx, targets = (t.cuda() for t in gpt_batches(1)[0])
    rng = torch.cuda.get_rng_state()
    record = emsa.probe(model, idx, targets, profile=PROFILE, under_load=True)
    assert torch.equal(rng, torch.cuda.get_rng_state())
    assert record.device.startswith("cuda")
    assert record.peak_device_bytes > 0
    assert 0 < record.activation_peak_bytes <= record.peak_device_bytes
    assert max(m.device_bytes for m in record.memory) > 0
    assert record.param("head.bias").grad_ready_order == 0
    # Timed again under the host tier's load (the settled median of three to nine passes): a
    # real duration, kept through JSON; the state restored all the same (the RNG check above).
    assert record.period_under_load > 0
    assert record.setup_times["under_load"] > 0
    assert emsa.ProbeRecord.from_json(record.to_json()).period_under_load == \
        record.period_under_load
    off = emsa.probe(model, idx, targets, profile=PROFILE, under_load=False)
    assert off.period_under_load == 0.0
    # By default only when the host tier may be used: this model's state fits the device.
    auto = emsa.probe(model, idx, targets, profile=PROFILE)
    assert auto.period_under_load == 0.0 and "under_load" not in auto.setup_times
    record.check()
