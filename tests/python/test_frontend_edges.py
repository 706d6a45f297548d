"""Front-end edge cases: a parameter re-laid after planning, torch.compile around step(), and
the corner cases torch.optim takes (empty parameters, duplicates, huge loaded step counts)."""

import warnings

import pytest
import torch

import emsa
from conftest import requires_cuda


def _conv(device):
    torch.manual_seed(0)
    return torch.nn.Conv2d(8, 16, 3).to(device)


def _steps(model, opt, n, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(2, 8, 6, 6, generator=g).to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_layout_change_after_planning_is_refused_and_changes_nothing(device):
    model = _conv(device)
    opt = emsa.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, 1, device)
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    weight = model.weight.detach().clone()
    model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 6, 6).to(device)
    model(x).square().mean().backward()
    refused = (r"params\[0\] changed memory layout.*"
               r"strides \(72, 9, 3, 1\) -> \(72, 1, 24, 8\).*new optimizer")
    with pytest.raises(ValueError, match=refused):
        opt.step()
    assert torch.equal(model.weight.detach(), weight)
    for k, v in opt.state[model.weight].items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_transposed_data_in_place_is_refused(device):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8, bias=False).to(device)  # square: .t() keeps shape and pointer
    opt = emsa.AdamW(lin.parameters(), lr=1e-2)
    lin(torch.randn(4, 8, device=device)).sum().backward()
    opt.step()
    lin.weight.data = lin.weight.data.t()
    lin(torch.randn(4, 8, device=device)).sum().backward()
    with pytest.raises(ValueError, match=r"memory layout.*\(8, 1\) -> \(1, 8\)"):
        opt.step()


@pytest.mark.numerics
def test_new_optimizer_with_loaded_state_follows_the_layout_change_exactly():
    """The remedy the message names: a new optimizer after the change, this one's state
    loaded into it, stays with torch.optim.AdamW run through the same change."""
    model, ref_model = _conv("cpu"), _conv("cpu")
    opt = emsa.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    _steps(model, opt, 2, "cpu")
    _steps(ref_model, ref, 2, "cpu")
    model.to(memory_format=torch.channels_last)
    ref_model.to(memory_format=torch.channels_last)
    opt2 = emsa.AdamW(model.parameters(), lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    _steps(model, opt2, 5, "cpu", seed=2)
    _steps(ref_model, ref, 5, "cpu", seed=2)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)  # one update moves ~1e-2


def _linear_pair(device):
    torch.manual_seed(0)
    ours = torch.nn.Linear(64, 64).to(device)
    ref = torch.nn.Linear(64, 64).to(device)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


@pytest.mark.numerics
@pytest.mark.parametrize("eager_first", [0, 2])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_step_under_torch_compile_matches_torch(eager_first, device):
    """Compiled from the first step (planning included) and after eager steps."""
    ours, ref = _linear_pair(device)
    opt = emsa.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    compiled = torch.compile(lambda: opt.step())
    g = torch.Generator().manual_seed(3)
    for k in range(5):
        x = torch.randn(16, 64, generator=g).to(device)
        for m, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
        compiled() if k >= eager_first else opt.step()
        ref_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    assert all((s["exp_avg_sq"] >= 0).all() for s in opt.state.values())


@pytest.mark.numerics
@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_compiled_model_with_clipping_matches_torch(in_backward, device):
    """The model under torch.compile, clipped at a norm that fires, trained by emsa.AdamW
    (max_grad_norm=, in step() or in backward) and by torch.optim.AdamW + clip_grad_norm_ on
    a twin compiled alike: equal within a tolerance that one update exceeds."""
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 32)).to(device)
    ref = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                              torch.nn.Linear(64, 32)).to(device)
    ref.load_state_dict(ours.state_dict())
    start = [p.detach().clone() for p in ref.parameters()]
    opt = emsa.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.05,
                     step_in_backward=in_backward)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    run_ours = torch.compile(ours, backend="aot_eager")
    run_ref = torch.compile(ref, backend="aot_eager")
    g = torch.Generator().manual_seed(5)
    for _ in range(6):
        x = torch.randn(8, 32, generator=g).to(device)
        run_ours(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        run_ref(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    opt.synchronize()
    assert int(opt.clip_count) == 6, "the norm should clip every step"
    moved = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), start))
    assert moved > 1e-3
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_only_empty_parameters_step_as_torch_does(device):
    p = torch.zeros(0, device=device, requires_grad=True)
    q = torch.zeros(0, device=device, requires_grad=True)
    opt, ref = emsa.AdamW([p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2)
    for _ in range(3):
        p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
        opt.step()
        ref.step()
    assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]) == 3.0


@pytest.mark.numerics
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_a_2_by_0_parameter_beside_a_real_one_matches_torch(device):
    torch.manual_seed(0)
    w = torch.randn(4, 3, device=device)
    ps = [torch.zeros(2, 0, device=device, requires_grad=True), w.clone().requires_grad_()]
    qs = [torch.zeros(2, 0, device=device, requires_grad=True), w.clone().requires_grad_()]
    opt, ref = emsa.AdamW(ps, lr=1e-2), torch.optim.AdamW(qs, lr=1e-2)
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        grad = torch.randn(4, 3, generator=g).to(device)
        ps[0].grad, qs[0].grad = torch.zeros_like(ps[0]), torch.zeros_like(qs[0])
        ps[1].grad, qs[1].grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(ps[1], qs[1], rtol=1e-5, atol=1e-7)
    assert ps[0].shape == (2, 0)


def test_the_same_parameter_twice_in_a_group_fails_saying_what_to_do():
    p = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.optim's own duplicate warning
        with pytest.raises(ValueError, match=r"appears 2 times.*list each parameter once"):
            emsa.AdamW([p, p], lr=1e-2)


@pytest.mark.parametrize("step", [2.0**63, 1e30, float("inf"), float("nan"), -1.0])
def test_a_loaded_step_out_of_range_is_refused_and_changes_nothing(step):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    opt = emsa.AdamW(lin.parameters(), lr=1e-2)
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    bad = {"state": {k: dict(v) for k, v in sd["state"].items()},
           "param_groups": sd["param_groups"]}
    for v in bad["state"].values():
        v["step"] = torch.tensor(step)
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    with pytest.raises(ValueError, match=r"step .* is not a count of steps.*2\*\*53"):
        opt.load_state_dict(bad)
    after = opt.state_dict()["state"]
    for k, v in before.items():
        for n, t in v.items():
            assert torch.equal(after[k][n], t), (k, n)
    opt.step()  # still usable


@pytest.mark.numerics
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_a_size_1_stride_change_is_taken_and_matches_torch(device):
    """Strides of size-1 dimensions do not place any element: the same memory, nothing to
    re-lay, and the steps stay with torch.optim's."""
    torch.manual_seed(0)
    w = torch.randn(4, 1, device=device)
    p, q = w.clone().requires_grad_(), w.clone().requires_grad_()
    opt, ref = emsa.AdamW([p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for k in range(4):
        if k == 2:
            p.data = p.data.as_strided((4, 1), (1, 7))
            assert p.stride() == (1, 7)
        grad = torch.randn(4, 1, generator=g).to(device)
        p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


class _LandingTier:
    """What the host tier's forward pre-hook uses of a HostTier, its waits HostTier's own:
    bucket b is the model's parameter b, which holds stale values while b is pending, until
    wait(b, stream) lands its upload."""

    from emsa._native.host_tier import HostTier as _Tier

    wait_all_compiled = _Tier.wait_all_compiled
    wait_all = _Tier.wait_all
    wait_pending = _Tier.wait_pending
    buckets_of = _Tier.buckets_of
    _module_forward = _Tier._module_forward

    def __init__(self, model):
        import weakref

        self.params = list(model.parameters())
        self._bucket_of = {id(p): b for b, p in enumerate(self.params)}
        self._module_buckets = weakref.WeakKeyDictionary()
        self.pending, self.held, self.landing, self.waits = set(), {}, {}, []
        self.device, self.sharded, self._compiled_warned = None, False, False

    def _release_copied(self):
        pass

    def upload(self, values):
        """A step's new parameters, enqueued: until waited for, each parameter reads stale."""
        with torch.no_grad():
            for b, (p, v) in enumerate(zip(self.params, values)):
                self.landing[b] = v.clone()
                p.fill_(1e3)
                self.pending.add(b)

    def wait(self, b, stream):
        assert stream == "current stream"
        with torch.no_grad():
            self.params[b].copy_(self.landing.pop(b))
        self.waits.append(b)
        self.pending.discard(b)


@pytest.mark.parametrize("compiled", [None, "wrapper", "in_place"])
def test_host_tier_forward_waits_for_its_uploads_under_torch_compile(compiled, monkeypatch):
    """A model under torch.compile reads every parameter only after its upload has landed. That
    holds for torch.compile(model), whose wrapper's hooks run eagerly, and for model.compile(),
    whose tracer runs the module hooks. An eager model holds it too, each module waiting for its
    own. Tested on the host tier's forward pre-hook, with a tier that lands uploads in wait()."""
    import copy

    from emsa._native.host_tier import forward_pre_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16),
                                torch.nn.Sequential(torch.nn.Linear(16, 16)))
    truth = copy.deepcopy(model)
    tier = _LandingTier(model)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current stream")
    handle = torch.nn.modules.module.register_module_forward_pre_hook(forward_pre_hook(tier))
    run = model
    if compiled == "wrapper":
        run = torch.compile(model, backend="aot_eager")
    elif compiled == "in_place":
        model.compile(backend="aot_eager")
    x = torch.randn(4, 16)
    try:
        for step in range(6):
            tier.waits.clear()
            if step % 3 != 2:  # every third step uploads nothing: nothing to wait for
                with torch.no_grad():
                    for p in truth.parameters():
                        p.add_(torch.randn_like(p), alpha=0.1)
                tier.upload([p.detach() for p in truth.parameters()])
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                out = run(x)
            torch.testing.assert_close(out, truth(x), rtol=1e-5, atol=1e-6,
                                       msg=f"step {step}: a parameter read before its upload")
            assert not tier.pending
            uploaded = step % 3 != 2
            assert tier.waits == (list(range(len(tier.params))) if uploaded else [])
            warned = [w for w in seen if str(w.message).startswith("emsa:")]
            # Compiled, the slower wait (all at the region's first module) is reported once.
            messages = [str(w.message) for w in seen]
            assert len(warned) == (1 if compiled and step == 0 else 0), messages
    finally:
        handle.remove()


def test_fsdp_upload_waits_traced_by_torch_compile_wait_for_every_upload(monkeypatch):
    """FSDP2's per-unit waits (emsa._distributed.dtensor._UploadWaits), traced by torch.compile: no
    per-unit lookup (FSDP's internals are not traceable), one eager wait for every pending
    upload through the tier (HostTier.wait_all_compiled, which also waits on the host when
    sharded, since FSDP's all-gathers read on streams of their own)."""
    from emsa._distributed import dtensor as _dtensor
    from emsa._native import host_tier as _host_tier

    class Tier:
        def __init__(self):
            self.pending, self.calls = {1, 2}, 0

        def wait_all_compiled(self):
            self.calls += 1
            self.pending.clear()

    tier = Tier()
    waits = _dtensor._UploadWaits(tier, {})
    monkeypatch.setattr(_host_tier, "_compiling", lambda: True)
    monkeypatch.setattr(_dtensor, "_fsdp_state", lambda m: pytest.fail("looked up FSDP state"))
    waits(torch.nn.Linear(2, 2), ())
    waits(torch.nn.Linear(2, 2), ())  # nothing pending any more: nothing to do
    assert tier.calls == 1 and not tier.pending
