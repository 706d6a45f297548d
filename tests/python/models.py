"""Small models for the tests: a GPT-like transformer with a tied head, and a CNN with BatchNorm."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float, qkv_bias: bool):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=qkv_bias)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    """qkv_bias=False by default (as nanoGPT's bias=False and Llama): a key bias has an exactly
    zero gradient in exact arithmetic (softmax ignores a constant added to every score), so its
    float gradient is rounding noise, which Adam normalizes into lr-sized steps. Two runs that
    differ by one ulp anywhere (torch against itself with another summation order included)
    then disagree on it completely, and an end-to-end comparison would measure noise."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, block=16, dropout=0.0,
                 qkv_bias=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout, qkv_bias) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=True)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class SmallCNN(nn.Module):
    """Convolutions before BatchNorm carry no bias, as usual: BatchNorm subtracts the mean, so
    such a bias has an exactly zero gradient and would only feed rounding noise to Adam (see
    TinyGPT's note)."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


def gpt_batches(n, batch=4, block=16, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, block), generator=g),
             torch.randint(0, vocab, (batch, block), generator=g)) for _ in range(n)]


def cnn_batches(n, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 12, 12, generator=g),
             torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def gpt_loss(model, batch):
    idx, targets = batch
    return model(idx, targets)


def cnn_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def param_groups(model, weight_decay=0.1, named=False):
    """Weight decay on matrices only, none on biases and norms (the usual GPT recipe)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append((name, p) if named else p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup=5, total=50):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


class LionReference(torch.optim.Optimizer):
    """Lion as published (and as include/emsa/update.h states it), in plain torch ops."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = m.lerp(p.grad, 1 - b1)
                p.mul_(1 - lr * wd)
                p.add_(torch.sign(c), alpha=-lr)
                m.lerp_(p.grad, 1 - b2)
