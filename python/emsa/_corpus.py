"""The demo's training text: English-like sentences from a small grammar, made here, no downloads.

A fixed seed makes the same text on every machine, so two runs of the demo see the same data.
The grammar has enough structure (agreement, clauses, a few fixed phrases) that a small model's
loss falls visibly within a few hundred steps, and is small enough that nothing is memorized.
Tokens are characters: the vocabulary is the alphabet below, so the model needs no tokenizer.
"""

from __future__ import annotations

import random

import torch

__all__ = ["ALPHABET", "make_text", "encode", "decode", "Batches"]

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
