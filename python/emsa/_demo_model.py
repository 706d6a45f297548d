"""The demo's model and its training text, both made here, no downloads.

The model: a small GPT (token + position embedding, pre-norm blocks of causal self-attention and
a GELU MLP, a final norm and a linear head). Nothing in it is random at run time (no dropout),
so two copies built from the same weights compute the same loss on the same batch, and any
difference between them after training comes from their optimizers alone.

The text: English-like sentences from a small grammar. A fixed seed makes the same text on every
machine; the grammar has enough structure (agreement, clauses, a few fixed phrases) that a small
model's loss falls visibly within a few hundred steps, and is small enough that nothing is
memorized. Tokens are characters: the vocabulary is ALPHABET, so the model needs no tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ALPHABET", "make_text", "encode", "decode", "Batches", "GPTConfig", "GPT"]

# Every character the grammar can produce; its index is the token id.
ALPHABET = "\n ,.;'?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

_NOUNS = ["river", "engine", "teacher", "garden", "lantern", "sailor", "machine", "village",
          "merchant", "forest", "letter", "tower", "captain", "kettle", "harbor", "student"]
_ADJECTIVES = ["quiet", "old", "bright", "small", "patient", "heavy", "curious", "distant",
               "green", "careful", "broken", "silver"]
_VERBS = [("sees", "see"), ("follows", "follow"), ("carries", "carry"), ("finds", "find"),
          ("remembers", "remember"), ("builds", "build"), ("watches", "watch"),
          ("answers", "answer"), ("mends", "mend"), ("greets", "greet")]
_ADVERBS = ["slowly", "again", "at dawn", "every morning", "without a word", "in the rain",
            "before supper", "once more"]
_PLACES = ["by the river", "near the tower", "in the village", "under the bridge",
           "across the harbor", "behind the garden"]
_OPENERS = ["Then", "Later", "Meanwhile", "Still", "At last", "In the evening"]
_NAMES = ["Ada", "Tom", "Mira", "Jonah", "Elsa", "Felix"]


class _Grammar:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def pick(self, items):
        return items[self.rng.randrange(len(items))]

    def noun_phrase(self) -> tuple[str, bool]:
        """A noun phrase and whether it is plural (the verb agrees with it)."""
        r = self.rng.random()
        if r < 0.2:
            return self.pick(_NAMES), False
        plural = self.rng.random() < 0.3
        noun = self.pick(_NOUNS) + ("s" if plural else "")
        det = self.pick(["the", "some"] if plural else ["the", "a", "every"])
        if det == "a" and noun[0] in "aeiou":
            det = "an"
        if self.rng.random() < 0.5:
            adj = self.pick(_ADJECTIVES)
            if det == "an" and adj[0] not in "aeiou":
                det = "a"
            elif det == "a" and adj[0] in "aeiou":
                det = "an"
            return f"{det} {adj} {noun}", plural
        return f"{det} {noun}", plural

    def clause(self) -> str:
        subject, plural = self.noun_phrase()
        singular_verb, plural_verb = self.pick(_VERBS)
        obj, _ = self.noun_phrase()
        parts = [subject, plural_verb if plural else singular_verb, obj]
        if self.rng.random() < 0.4:
            parts.append(self.pick(_PLACES))
        if self.rng.random() < 0.3:
            parts.append(self.pick(_ADVERBS))
        return " ".join(parts)

    def sentence(self) -> str:
        r = self.rng.random()
        if r < 0.15:
            text = f"{self.pick(_OPENERS)}, {self.clause()}"
        elif r < 0.3:
            text = f"{self.clause()}, and {self.clause()}"
        elif r < 0.4:
            text = f"{self.clause()} because {self.clause()}"
        elif r < 0.47:
            subject, plural = self.noun_phrase()
            verb, obj = self.pick(_VERBS)[1], self.noun_phrase()[0]
            text = f"{'do' if plural else 'does'} {subject} {verb} {obj}"
            return text[0].upper() + text[1:] + "?"
        else:
            text = self.clause()
        return text[0].upper() + text[1:] + "."


def make_text(chars: int, seed: int = 1234) -> str:
    """About `chars` characters of sentences, six or so to a paragraph; the same for a seed."""
    grammar = _Grammar(random.Random(seed))
    out: list[str] = []
    size = 0
    while size < chars:
        paragraph = " ".join(grammar.sentence() for _ in range(grammar.rng.randint(3, 8)))
        out.append(paragraph)
        size += len(paragraph) + 1
    return "\n".join(out)[:chars]


_INDEX = {c: i for i, c in enumerate(ALPHABET)}


def encode(text: str) -> torch.Tensor:
    """Token ids (int64) of `text`; raises ValueError naming a character outside ALPHABET."""
    try:
        return torch.tensor([_INDEX[c] for c in text], dtype=torch.long)
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} is not in the demo's alphabet") from None


def decode(ids) -> str:
    return "".join(ALPHABET[int(i)] for i in ids)


class Batches:
    """Random windows of the token stream: (input, target) pairs of shape (batch, block), the
    target shifted by one. Its own generator, so both models of the demo get the same batches
    without touching torch's global RNG."""

    def __init__(self, tokens: torch.Tensor, batch: int, block: int, seed: int):
        if tokens.numel() <= block + 1:
            raise ValueError(f"the corpus has {tokens.numel()} tokens, too few for windows of "
                             f"{block + 1}; make more text or use a smaller block")
        self.tokens, self.batch, self.block = tokens, batch, block
        self.gen = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(block + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.tokens.numel() - self.block - 1, (self.batch, 1),
                               generator=self.gen)
        window = self.tokens[starts + self._offsets]
        return window[:, :-1], window[:, 1:]


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64  # longest sequence, in tokens
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    tie_head: bool = False  # share the token embedding with the output head


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model={cfg.d_model} is not a multiple of n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        # No bias: a key bias adds the same score to every position, which softmax cancels, so
        # its gradient is rounding noise that Adam would amplify into a random walk.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_head:
            self.head.weight = self.wte.weight
        self.apply(self._init)
        # GPT-2's scaling of the residual projections keeps the residual stream's variance
        # from growing with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits (batch, time, vocab); with targets, the mean cross-entropy instead."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size="
                             f"{self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
