"""The benchmark's input texts: mixed lengths from 5 to 128 tokens, generated from a seed, no downloads.

Every word in `WORDS` is one token of the default model's WordPiece vocabulary (all-MiniLM-L6-v2,
uncased), and so are "," and ".". A text of target length `n` (special tokens included) is therefore
`n - 2` pieces: words with an occasional comma, ending with a period. Target lengths are log-uniform,
so short texts (queries) are common and long ones (passages) rarer, which is what makes length grouping
and padding matter. `bench.run` checks the lengths with the model's own tokenizer.
"""

from __future__ import annotations

import itertools
import math
import random

MIN_TOKENS = 5
MAX_TOKENS = 128
SPECIAL_TOKENS = 2
"""[CLS] and [SEP], which the tokenizer adds to every text."""

_WORD_TEXT = """
    the of and to in is was for on that with as by at from his he it an were are which this be or first
    also has had one their its after new but who not they have her she two been other when there all
    during into school time may years more most only over city some world would where later up such used
    many can state about national out known university united then made states well american three between
    however team season part year film several while under area both these since high series history war
    following including until became born public based life age number early being second group system game
    called around against people work home water place county form family found line local government album
    music member body company long north south west east small large great power light level point side
    name show river road house field market court land human data health service report student process
"""
WORDS = tuple(_WORD_TEXT.split())


def target_lengths(count: int, seed: int = 0) -> list[int]:
    """`count` lengths in tokens, log-uniform over [MIN_TOKENS, MAX_TOKENS]."""
    rng = random.Random(seed)
    low, high = math.log(MIN_TOKENS), math.log(MAX_TOKENS + 1)
    return [min(MAX_TOKENS, int(math.exp(rng.uniform(low, high)))) for _ in range(count)]


def make_text(tokens: int, rng: random.Random) -> str:
    """A sentence of exactly `tokens` tokens (special tokens included) for the default model."""
    pieces = tokens - SPECIAL_TOKENS - 1  # the final period is a token too
    parts: list[str] = []
    for index in range(pieces):
        if 0 < index < pieces - 1 and parts[-1] != "," and rng.random() < 0.08:
            parts.append(",")
        else:
            parts.append(rng.choice(WORDS))
    text = " ".join(parts).replace(" ,", ",") + "."
    return text[0].upper() + text[1:]


def corpus(count: int = 2048, seed: int = 0) -> list[str]:
    """`count` texts of mixed length, the same for the same seed."""
    rng = random.Random(seed + 1)
    return [make_text(length, rng) for length in target_lengths(count, seed)]


def length_histogram(lengths: list[int], edges: tuple[int, ...] = (5, 9, 17, 33, 65, 129)) -> list[str]:
    """Rows `[lo, hi): count (share)` for printing the length distribution."""
    rows = []
    for low, high in itertools.pairwise(edges):
        count = sum(1 for length in lengths if low <= length < high)
        rows.append(f"[{low:3d}, {high:3d}) tokens: {count:5d} ({count / max(1, len(lengths)):6.1%})")
    return rows
