"""The demo's training text as character tokens: a generated built-in corpus or any text file."""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

CORPUS_CHARS = 1 << 18
CORPUS_SEED = 0

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher",
             "our neighbour", "the farmer", "a tired fox", "the young queen", "his brother"]
_VERBS = ["sees", "likes", "follows", "paints", "finds", "helps", "watches", "carries", "loves", "visits"]
_OBJECTS = ["a red kite", "the green door", "an apple", "the little boat", "a blue hat", "the old clock",
            "a yellow ball", "the tall tree", "a wooden box", "the river"]
_PLACES = ["in the garden", "at the station", "near the river", "on the hill", "under the bridge",
           "in the kitchen", "at school", ""]


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.6:
        place = rng.choice(_PLACES)
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)] + ([place] if place else [])
        return " ".join(words) + "."
    if kind < 0.85:
        a, b = rng.randrange(20), rng.randrange(20)
        return f"{a} plus {b} is {a + b}."
    start = rng.randrange(30)
    return "count " + " ".join(str(n) for n in range(start, start + rng.randrange(3, 7))) + "."


def make_corpus(n_chars: int = CORPUS_CHARS, seed: int = CORPUS_SEED) -> str:
    """The built-in corpus, deterministic: lines of 1-4 sentences from a small grammar
    ("the robot paints a red kite near the river."), additions ("7 plus 5 is 12.") and
    counting runs ("count 4 5 6 7.")."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < n_chars:
        line = " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:n_chars]


def read_text(path: Path) -> str:
    """The text of a UTF-8 file (bytes that are not UTF-8 become U+FFFD)."""
    return Path(path).read_text(encoding="utf-8", errors="replace")


class Vocabulary(NamedTuple):
    """The characters of a text, sorted; a character's token is its index."""

    chars: str

    @classmethod
    def of(cls, text: str) -> Vocabulary:
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> np.ndarray:
        """int32 tokens of `text`, whose characters must all be in the vocabulary."""
        index = {c: i for i, c in enumerate(self.chars)}
        return np.fromiter((index[c] for c in text), np.int32, len(text))

    def decode(self, tokens) -> str:
        return "".join(self.chars[t] for t in np.asarray(tokens))


def sample_batch(key, corpus, batch: int, length: int):
    """[batch, length] int32: random windows of `length` tokens of corpus [N] (on the device)."""
    starts = jax.random.randint(key, (batch,), 0, corpus.shape[0] - length + 1)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(corpus, (s,), (length,)))(starts)
