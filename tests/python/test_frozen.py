"""Frozen and absent gradients as torch.optim has them (CPU engine): a parameter with
requires_grad=False at planning gets no state, no arena bytes and no state_dict entry; a
parameter whose .grad is None in a step (or that gets no gradient in a backward) is skipped
with its own step count; state_dicts move between emsa and torch.optim both ways."""

import pytest
import torch
from torch.testing import assert_close

import emsa
from conftest import CPU_PROFILE

STEPS = 10


class LoRA(torch.nn.Module):
    """A frozen 1024x1024 base with rank-8 adapters: y = base(x) + B(A(x))."""

    def __init__(self, n=1024, rank=8):
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(n, n)
        self.base.requires_grad_(False)
        self.A = torch.nn.Parameter(torch.randn(rank, n) / n**0.5)
        self.B = torch.nn.Parameter(torch.randn(n, rank) / rank**0.5)

    def forward(self, x):
        return self.base(x) + (x @ self.A.t()) @ self.B.t()


def state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def test_lora_state_bytes_match_torch():
    model, ref_model = LoRA(), LoRA()
    opt = emsa.AdamW(model.parameters(), lr=1e-3)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    x = torch.randn(4, 1024)
    for o, m in ((opt, model), (ref, ref_model)):
        m(x).square().mean().backward()
        o.step()
    arena = sum(a.nbytes for a in opt._bound.engine.arenas.values())
    torch_bytes = state_bytes(ref)
    assert abs(arena - torch_bytes) <= 0.01 * torch_bytes, (arena, torch_bytes)
    assert state_bytes(opt) == torch_bytes
    assert set(opt.state) == {model.A, model.B}
    assert sorted(opt.state_dict()["state"]) == sorted(ref.state_dict()["state"]) == [0, 1]


class Branchy(torch.nn.Module):
    """A frozen embedding, a trunk, and a branch used on even steps only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 8)
        self.emb.weight.requires_grad_(False)
        self.trunk = torch.nn.Linear(8, 8)
        self.branch = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids, k):
        h = torch.tanh(self.trunk(self.emb(ids)))
        if k % 2 == 0:
            h = h + torch.tanh(self.branch(h))
        return self.head(h).mean(1)


def branchy_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 20, (6, 5), generator=g), torch.randn(6, 3, generator=g))
            for _ in range(STEPS)]


def train(make_opt, in_backward=False, accumulate=1, clip=None):
    model = Branchy()
    opt = make_opt(model.parameters())
    for k, (ids, y) in enumerate(branchy_data()):
        for _ in range(accumulate):
            ((model(ids, k) - y) ** 2).mean().backward()
        if not in_backward and clip is not None and isinstance(opt, torch.optim.AdamW):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.numerics
@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_frozen_and_absent_follow_torch(in_backward, clip):
    ref, ref_opt = train(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), clip=clip)
    model, opt = train(lambda ps: emsa.AdamW(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=clip,
                                             step_in_backward=in_backward,
                                             profile=str(CPU_PROFILE)),
                       in_backward, clip=clip)
    if clip is not None:
        assert opt.clip_count > 0
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
        if a.requires_grad:
            assert int(opt.state[b]["step"]) == int(ref_opt.state[a]["step"]), name
    assert int(opt.state[model.branch.weight]["step"]) == STEPS // 2
    assert model.emb.weight not in opt.state
    assert torch.equal(model.emb.weight, Branchy().emb.weight)


@pytest.mark.numerics
@pytest.mark.parametrize("clip", [None, 0.05])
def test_accumulate_with_frozen_and_clipping(clip):
    """accumulate=3 in backward; the branch is used in micro-batches k + m even, so on odd
    steps its gradient comes only from the middle pass, not the updating (last) one."""
    ref = Branchy()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = Branchy()
    opt = emsa.AdamW(model.parameters(), lr=1e-2, max_grad_norm=clip, step_in_backward=True,
                     accumulate=3, profile=str(CPU_PROFILE))
    for k, (ids, y) in enumerate(branchy_data()):
        for m in (ref, model):
            for micro in range(3):
                ((m(ids, k + micro) - y) ** 2).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
    assert int(opt.state[model.branch.weight]["step"]) == int(
        ref_opt.state[ref.branch.weight]["step"]) == STEPS
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("in_backward", [False, True])
def test_frozen_parameter_with_a_gradient_is_refused(in_backward):
    model = Branchy()
    opt = emsa.AdamW(model.parameters(), step_in_backward=in_backward, profile=str(CPU_PROFILE))
    ids, y = branchy_data()[0]
    ((model(ids, 1) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()
    model.emb.weight.requires_grad_(True)  # unfrozen after planning
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model.head.weight].items()}
    with pytest.raises(RuntimeError, match="new optimizer"):
        ((model(ids, 1) - y) ** 2).mean().backward()
        opt.step()
    # Refused before anything changed: by step(), or in backward at the pass's first hook.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(opt.state[model.head.weight][k], v) for k, v in state.items())
    model.emb.weight.grad = None
    model.emb.weight.requires_grad_(False)
    opt.zero_grad()
    ((model(ids, 1) - y) ** 2).mean().backward()  # frozen again: trains on
    opt.step()
    assert int(opt.state[model.head.weight]["step"]) == 2


@pytest.mark.numerics
def test_state_dict_moves_both_ways_with_frozen_parameters():
    """emsa -> torch.optim and torch.optim -> emsa: the state lists only what trains, under
    torch's indices (frozen ones keep their index in param_groups, with no state entry)."""
    data = branchy_data()

    def run(opt, model, ks):
        for k in ks:
            ids, y = data[k]
            ((model(ids, k) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()

    ref = Branchy()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    run(ref_opt, ref, range(STEPS))

    # torch for 5 steps, then emsa from torch's state_dict
    a = Branchy()
    a_opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    run(a_opt, a, range(5))
    b_opt = emsa.AdamW(a.parameters(), lr=1e-2, profile=str(CPU_PROFILE))
    sd = a_opt.state_dict()
    assert 0 not in sd["state"]  # the frozen embedding: no state in torch either
    b_opt.load_state_dict(sd)
    run(b_opt, a, range(5, STEPS))
    for p, q in zip(ref.parameters(), a.parameters()):
        assert_close(q, p, rtol=1e-6, atol=1e-7)

    # emsa for 5 steps, then torch from emsa's state_dict
    c = Branchy()
    c_opt = emsa.AdamW(c.parameters(), lr=1e-2, profile=str(CPU_PROFILE))
    run(c_opt, c, range(5))
    sd = c_opt.state_dict()
    assert sorted(sd["state"]) == sorted(a_opt.state_dict()["state"]) == [1, 2, 3, 4, 5, 6]
    d_opt = torch.optim.AdamW(c.parameters(), lr=1e-2)
    d_opt.load_state_dict(sd)
    run(d_opt, c, range(5, STEPS))
    for p, q in zip(ref.parameters(), c.parameters()):
        assert_close(q, p, rtol=1e-6, atol=1e-7)


def test_state_of_a_frozen_parameter_is_not_loaded_and_says_so():
    model = Branchy()
    torch_model = Branchy()
    torch_model.emb.weight.requires_grad_(True)
    torch_opt = torch.optim.AdamW(torch_model.parameters())
    ids, y = branchy_data()[0]
    ((torch_model(ids, 0) - y) ** 2).mean().backward()
    torch_opt.step()
    opt = emsa.AdamW(model.parameters(), profile=str(CPU_PROFILE))
    with pytest.warns(RuntimeWarning, match="frozen"):
        opt.load_state_dict(torch_opt.state_dict())
    assert model.emb.weight not in opt.state
    assert int(opt.state[model.head.weight]["step"]) == 1


def test_only_frozen_parameters_is_refused():
    w = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    opt = emsa.AdamW([w])
    with pytest.raises(ValueError, match="require a gradient"):
        opt.step()
