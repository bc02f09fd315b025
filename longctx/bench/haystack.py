"""Haystacks: real prose, cut at sentence boundaries, with needles inserted at requested depths.

The prose is the essays shipped in `samples/haystack/` (written for this project, same license).
Essays are taken whole, in a seeded random order, paragraph by paragraph and cycled when a long
haystack needs more text than the corpus holds (each cycle in a new order). A needle is a sentence
of its own, inserted between two sentences of the body: at depth d it goes to the boundary whose
token position is nearest to d x the body's tokens (0: before the first sentence, 1: after the
last). The number of sentences is then chosen by bisection so that the exact token count (the
caller's `count`, normally the model's whole cached prompt prefix) is as large as possible
without exceeding the target.
"""

from __future__ import annotations

import bisect
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from longctx.errors import ConfigError

CORPUS_DIR = Path(__file__).resolve().parents[2] / "samples" / "haystack"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(\u201c])")


@dataclass(frozen=True)
class Unit:
    """One sentence of prose and what follows it (a space, or a paragraph break)."""

    sentence: str
    sep: str


@dataclass(frozen=True)
class Haystack:
    """A document with needles: `offsets[i]` is where needle i starts in `text`, `depths[i]` its
    depth in tokens as a fraction of the body (the text after the preamble)."""

    text: str
    offsets: tuple[int, ...]
    depths: tuple[float, ...]
    tokens: int


def load_corpus(directory: Path | None = None) -> list[list[Unit]]:
    """Essays as lists of sentence units (markdown headings dropped).

    Args:
        directory: a folder of `.md`/`.txt` files (default: the shipped `samples/haystack`);
            README files are skipped.
    """
    directory = Path(directory or CORPUS_DIR)
    files = (
        sorted(p for p in directory.glob("*") if p.suffix in (".md", ".txt") and not p.name.upper().startswith("README"))
        if directory.is_dir()
        else []
    )
    if not files:
        raise ConfigError(
            f"No haystack prose (.md/.txt files) in {directory}; pass a folder of "
            "prose, or run from a source checkout that has samples/haystack/."
        )
    essays = []
    for path in files:
        units = []
        for para in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
            para = " ".join(para.split())
            if not para or para.startswith("#"):
                continue
            sentences = _SENTENCE_END.split(para)
            units += [Unit(s, " ") for s in sentences[:-1]] + [Unit(sentences[-1], "\n\n")]
        if units:
            essays.append(units)
    return essays


def _stream(essays: list[list[Unit]], rng: random.Random):
    while True:
        order = list(range(len(essays)))
        rng.shuffle(order)
        for i in order:
            yield from essays[i]


def _boundaries(cum: list[int], n: int, depths: Sequence[float]) -> list[int]:
    """For each depth, the sentence boundary (0..n) nearest to depth x body tokens."""
    out = []
    for d in depths:
        want = d * cum[n]
        j = bisect.bisect_left(cum, want, 0, n + 1)
        if j > n or (j > 0 and want - cum[j - 1] <= cum[j] - want):
            j -= 1
        out.append(max(0, min(n, j)))
    return out


def _render(units: list[Unit], n: int, needles: Sequence[str], where: list[int], preamble: str) -> tuple[str, list[int]]:
    at: dict[int, list[int]] = {}
    for i, b in enumerate(where):
        at.setdefault(b, []).append(i)
    parts, offsets, pos = [preamble] if preamble else [], [0] * len(needles), len(preamble)
    for j in range(n + 1):
        for i in at.get(j, ()):
            offsets[i] = pos
            parts.append(needles[i] + " ")
            pos += len(needles[i]) + 1
        if j < n:
            piece = units[j].sentence + units[j].sep
            parts.append(piece)
            pos += len(piece)
    return "".join(parts).rstrip(), offsets


def build(
    essays: list[list[Unit]],
    needles: Sequence[str],
    depths: Sequence[float],
    target_tokens: int,
    count: Callable[[str], int],
    piece_tokens: Callable[[str], int],
    seed: int,
    preamble: str = "",
) -> Haystack:
    """A haystack of at most `target_tokens` (as `count` measures) with `needles` at `depths`.

    Args:
        essays: from `load_corpus`.
        needles: sentences to insert (each complete, ending with punctuation).
        depths: one per needle, in [0, 1].
        target_tokens: the most tokens `count(text)` may return.
        count: exact token count of a whole document text (e.g. the model's prompt prefix).
        piece_tokens: token count of one sentence (used to place needles by token position).
        seed: picks the order of the essays; the same seed gives the same haystack.
        preamble: text put before the body (not counted in depths), e.g. the task's instructions.
    """
    if len(needles) != len(depths) or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ConfigError("Each needle needs a depth between 0 and 1.")
    stream = _stream(essays, random.Random(seed))
    units: list[Unit] = []
    cum = [0]

    def grow(tokens: int) -> None:
        while cum[-1] < tokens:
            units.append(next(stream))
            cum.append(cum[-1] + piece_tokens(units[-1].sentence))

    def render(n: int) -> tuple[str, list[int], list[int]]:
        where = _boundaries(cum, n, depths)
        text, offsets = _render(units, n, needles, where, preamble)
        return text, offsets, where

    grow(target_tokens + 64)
    while count(render(len(units))[0]) <= target_tokens:
        grow(2 * cum[-1] + 64)
    lo, hi = 0, len(units)  # count(render(lo)) <= target < count(render(hi)), lo = 0 trusted
    if count(render(0)[0]) > target_tokens:
        raise ConfigError(f"The needles and instructions alone exceed {target_tokens} tokens.")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(render(mid)[0]) <= target_tokens:
            lo = mid
        else:
            hi = mid
    text, offsets, where = render(lo)
    total = cum[lo] or 1
    return Haystack(text, tuple(offsets), tuple(cum[b] / total for b in where), count(text))
