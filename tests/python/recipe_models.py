"""Small models for the recipe tests and bench/recipes_numerics.py: Hugging Face GPT-2 (tied
embeddings), Llama (grouped-query attention), BERT and Qwen2 (tied) built from configs with
random weights (nothing downloaded), and two hand-made models for frozen and absent gradients.

All fp32, eager attention, dropout 0. `size="tiny"` is small enough that 20 steps of three
optimizers run in seconds on two CPU cores; `size="bench"` is the H200 benchmark's size.

Zero-gradient parameters. A key bias (BERT's and Qwen2's k_proj bias, the key third of GPT-2's
c_attn bias) has an exactly zero gradient in exact arithmetic: softmax ignores a constant added
to every score of a row. Its float gradient is rounding noise, which Adam divides by its own
root mean square and turns into lr-sized steps of random sign. Two correct optimizers (torch's
foreach and fused among them) that differ by one ulp anywhere then train different models, so
an end-to-end comparison measures noise. `SPECS[name].lockstep` says how each model is compared:
True (the key bias models): in lockstep, every optimizer fed the gradients of one reference
model each step, so only the optimizers decide the distance; False (Llama: no biases): end to
end, each optimizer training its own copy from its own forward and backward.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

VOCAB = 128
SEQ = 16


def _hf():
    import transformers  # imported here: the CPU suite runs without it, skipping these models

    transformers.logging.set_verbosity_error()
    return transformers


def _dims(size: str) -> dict:
    if size == "tiny":
        return dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=VOCAB, seq=SEQ)
    if size == "bench":
        return dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=688, vocab=1024, seq=128)
    raise ValueError(f"size={size!r}; 'tiny' or 'bench'")


def gpt2(size: str = "tiny") -> nn.Module:
    t, d = _hf(), _dims(size)
    cfg = t.GPT2Config(vocab_size=d["vocab"], n_positions=d["seq"], n_embd=d["hidden"],
                       n_layer=d["layers"], n_head=d["heads"], n_inner=d["ffn"],
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                       tie_word_embeddings=True, attn_implementation="eager")
    return t.GPT2LMHeadModel(cfg)


def llama(size: str = "tiny") -> nn.Module:
    t, d = _hf(), _dims(size)
    cfg = t.LlamaConfig(vocab_size=d["vocab"], hidden_size=d["hidden"],
                        intermediate_size=d["ffn"], num_hidden_layers=d["layers"],
                        num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                        max_position_embeddings=d["seq"], attention_bias=False,
                        attention_dropout=0.0, tie_word_embeddings=False,
                        attn_implementation="eager")
    return t.LlamaForCausalLM(cfg)


def bert(size: str = "tiny") -> nn.Module:
    t, d = _hf(), _dims(size)
    cfg = t.BertConfig(vocab_size=d["vocab"], hidden_size=d["hidden"],
                       num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                       intermediate_size=d["ffn"], max_position_embeddings=d["seq"],
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       attn_implementation="eager")
    return t.BertForMaskedLM(cfg)


def qwen2(size: str = "tiny") -> nn.Module:
    t, d = _hf(), _dims(size)
    cfg = t.Qwen2Config(vocab_size=d["vocab"], hidden_size=d["hidden"],
                        intermediate_size=d["ffn"], num_hidden_layers=d["layers"],
                        num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                        max_position_embeddings=d["seq"], attention_dropout=0.0,
                        tie_word_embeddings=True, attn_implementation="eager")
    return t.Qwen2ForCausalLM(cfg)


@dataclass(frozen=True)
class Spec:
    build: Callable[[str], nn.Module]
    lockstep: bool  # compared in lockstep (it has zero-gradient key biases): module docstring


SPECS = {
    "gpt2": Spec(gpt2, lockstep=True),
    "llama": Spec(llama, lockstep=True),
    "bert": Spec(bert, lockstep=True),
    "qwen2": Spec(qwen2, lockstep=True),
}


def lm_batches(n: int, size: str = "tiny", batch: int = 4, seed: int = 0, device="cpu"):
    """n batches of (input_ids, labels); labels are the inputs (causal LMs shift them) or, for
    BERT, other random tokens at every position (a masked-LM loss on all of them)."""
    d = _dims(size)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, d["vocab"], (batch, d["seq"]), generator=g)
        other = torch.randint(0, d["vocab"], (batch, d["seq"]), generator=g)
        out.append((ids.to(device), other.to(device)))
    return out


def lm_loss(name: str, model: nn.Module, batch) -> torch.Tensor:
    ids, other = batch
    labels = other if name == "bert" else ids
    return model(input_ids=ids, labels=labels).loss


def hf_param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Two groups, as Hugging Face's Trainer makes them: weight decay on matrices and
    embeddings, none on biases and norms. A tied weight is listed once (named_parameters()
    yields each tensor once)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or "norm" in name.lower() else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """A LambdaLR factor: linear warmup from lr/warmup (no step at lr 0), then cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


class FrozenEmbeddingBranch(nn.Module):
    """A frozen embedding (requires_grad=False: no state, no update), a trunk, and a branch used
    on even steps only (its parameters' .grad is None on odd steps: torch.optim skips them, so
    their own step counts fall behind the trunk's). No parameter with a zero true gradient: a
    tanh MLP with a squared-error loss."""

    def __init__(self, vocab: int = 64, d: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.embed.weight.requires_grad_(False)
        self.trunk = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
        self.branch = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.head = nn.Linear(d, 4)

    def forward(self, ids: torch.Tensor, step: int) -> torch.Tensor:
        x = self.trunk(self.embed(ids))
        if step % 2 == 0:
            x = x + self.branch(x)
        return self.head(torch.tanh(x))


def frozen_branch_batches(n: int, vocab: int = 64, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (8, 6), generator=g).to(device),
             torch.randn(8, 6, 4, generator=g).to(device)) for _ in range(n)]


def frozen_branch_loss(model: FrozenEmbeddingBranch, batch, step: int) -> torch.Tensor:
    ids, target = batch
    return (model(ids, step) - target).square().mean()


class LoRALinear(nn.Module):
    """A frozen base layer (1024x1024 weight and bias) with rank-r adapters: y = base(x) +
    scale * B(A(x)). B starts at zero, as in LoRA, so the first step changes only B."""

    def __init__(self, d: int = 1024, rank: int = 8, alpha: float = 16.0):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(d, rank, bias=False)
        self.lora_b = nn.Linear(rank, d, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))


class LoRAModel(nn.Module):
    """Two LoRA layers around a tanh and a trainable head: the adapters train, the bases
    (2 x 4 MiB of fp32 weights) must get no optimizer state."""

    def __init__(self, d: int = 1024, rank: int = 8):
        super().__init__()
        self.l1 = LoRALinear(d, rank)
        self.l2 = LoRALinear(d, rank)
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.l2(torch.tanh(self.l1(x))))


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ---- the comparisons (tests/python/test_recipes.py and bench/recipes_numerics.py) ----------
def surrogate_backward(params: list[torch.Tensor], grads: list[torch.Tensor | None],
                       scale=lambda loss: loss) -> None:
    """A backward whose gradients are exactly `grads`: d/dp sum(p * g) = 1 * g, which rounds to
    g. Lockstep feeds another model's gradients through autograd this way, so emsa's hooks
    (updates in backward, statistics gathered in backward) see them as a real backward's.
    `scale`: applied to the loss first (GradScaler.scale: a power of two, exact)."""
    terms = [(p * g).sum() for p, g in zip(params, grads) if g is not None]
    scale(torch.stack(terms).sum()).backward()


def distance(model: nn.Module, ref: nn.Module, init: list[torch.Tensor]) -> float:
    """The largest element-wise parameter difference from the reference (in float64),
    relative to the largest distance the reference's parameters moved from `init`: 0 equal,
    about 1 for an optimizer that did nothing, about 1/steps for one update missing."""
    diff = max((a.detach().double() - b.detach().double()).abs().max().item()
               for a, b in zip(model.parameters(), ref.parameters()))
    moved = max((b.detach().double() - p0.double()).abs().max().item()
                for b, p0 in zip(ref.parameters(), init))
    return diff / moved


def compare_clipped(name: str, make_emsa, device="cpu", steps: int = 20, max_norm: float = 1.0,
                    lr: float = 3e-3, size: str = "tiny", sync=lambda opt: None) -> dict:
    """Trains `name` `steps` steps four ways from the same weights: torch.optim.AdamW
    (foreach) + clip_grad_norm_ (foreach), the reference; torch.optim.AdamW(fused=True) +
    clip_grad_norm_(foreach=False), torch's other implementation; make_emsa(model, groups,
    hyper) with max_grad_norm=max_norm inside it; and, in lockstep, the first in float64
    ("exact"). Two param groups (no weight decay on biases and norms), transformers'
    warmup+cosine schedule. Lockstep (every run fed the reference's gradients) or end to end,
    as SPECS says.

    Returns the distances (`distance`) the bar names, emsa to the reference (d_emsa) and
    fused to the reference (d_torch), and in lockstep each fp32 run's distance to the float64
    one (e_emsa, e_foreach, e_fused: how far each optimizer is from the exact update; None end
    to end, where a float64 model would measure its own forward's rounding, not the
    optimizers'); the steps torch clipped, emsa's clip_count, and the largest relative gap
    between emsa's last_grad_norm and torch's norm over the steps."""
    from transformers import get_cosine_schedule_with_warmup

    spec = SPECS[name]
    torch.manual_seed(0)
    ref = spec.build(size).to(device)
    peer, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    exact = copy.deepcopy(ref).double() if spec.lockstep else None
    init = [p.detach().clone() for p in ref.parameters()]
    hyper = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    ref_opt = torch.optim.AdamW(hf_param_groups(ref), foreach=True, **hyper)
    peer_opt = torch.optim.AdamW(hf_param_groups(peer), fused=True, **hyper)
    opt = make_emsa(ours, hf_param_groups(ours), dict(hyper, max_grad_norm=max_norm))
    opts = (ref_opt, peer_opt, opt)
    if exact is not None:
        opts += (torch.optim.AdamW(hf_param_groups(exact), foreach=False, **hyper),)
    scheds = [get_cosine_schedule_with_warmup(o, max(1, steps // 5), steps) for o in opts]
    clipped, norm_gap = 0, 0.0
    for batch in lm_batches(steps, size, device=device):
        for o in opts:
            o.zero_grad(set_to_none=True)
        lm_loss(name, ref, batch).backward()
        if spec.lockstep:
            grads = [p.grad for p in ref.parameters()]
            for p, q, g in zip(peer.parameters(), exact.parameters(), grads):
                p.grad, q.grad = g.clone(), g.double()
            surrogate_backward(list(ours.parameters()), [g.clone() for g in grads])
            torch.nn.utils.clip_grad_norm_(exact.parameters(), max_norm)
        else:
            for m in (peer, ours):
                lm_loss(name, m, batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, foreach=True)
        torch.nn.utils.clip_grad_norm_(peer.parameters(), max_norm, foreach=False)
        clipped += int(max_norm / (norm.item() + 1e-6) < 1.0)
        for o in opts:
            o.step()
        sync(opt)
        got = opt.last_grad_norm
        gap = math.inf if got is None else abs(got - norm.item()) / norm.item()
        norm_gap = max(norm_gap, gap)
        for s in scheds:
            s.step()
    sync(opt)
    exact_distance = (lambda m: None) if exact is None else (
        lambda m: distance(m, exact, init))
    return {"model": name, "lockstep": spec.lockstep, "steps": steps,
            "d_emsa": distance(ours, ref, init), "d_torch": distance(peer, ref, init),
            "e_emsa": exact_distance(ours), "e_foreach": exact_distance(ref),
            "e_fused": exact_distance(peer), "torch_clipped": clipped,
            "emsa_clip_count": int(opt.clip_count), "grad_norm_gap": norm_gap}
