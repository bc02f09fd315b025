"""Needle-in-a-haystack over the product path: ingest a haystack document, ask from its cache.

Tasks follow RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?"), with its needle and question wording:
- `single`: one needle "One of the special magic numbers for {key} is: {value}." (a 7-digit number);
- `uuid`: the same with a UUID value;
- `multikey`: the asked needle plus 3 distractor needles of other keys at seeded random depths;
- `multivalue`: 4 numbers for the same key (the first at the cell's depth, 3 at random depths),
  all asked for at once.
Scoring is RULER's `string_match_all`: the fraction of expected values found, case-insensitively,
in the greedy answer (cut where a base model starts echoing the prompt: a next "Question", the
document again; see `cut_answer`).

Every cell is one haystack (RULER's one needle group per haystack; a shared haystack per length
with every depth's needle, asked one question each, is the faster `shared=True` mode, at the cost
of turning the task into retrieval among distractors). For each (length, depth, sample) the
document is built once and written as a text file; for each KV preset it is `session.ingest`ed
(prefilled once, persisted) and its questions are asked with `asking.ask`, which restores the
cache from disk. The same documents serve every preset, so presets differ only in the cache.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from longctx import asking

from longctx import kvcache, manage, prompt, session
from longctx.bench import haystack as hay
from longctx.errors import ConfigError
from longctx.runtime import models
from longctx.store import Store

TASKS = ("single", "uuid", "multikey", "multivalue")
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_DEPTHS = tuple(i / 10 for i in range(11))
BASELINE = "fp16"
DOC_NAME = "haystack.txt"
# Where a base model's answer runs on into the prompt's structure (a made-up next question, the
# document again): cut there, so copying the document back can never score.
STOPS = ("\nQuestion", "<document", "</document>", "Some special magic")
_ADJECTIVES = (
    "amber",
    "brisk",
    "calm",
    "dusty",
    "eager",
    "faint",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lofty",
    "mellow",
    "nimble",
    "olive",
    "plain",
    "quiet",
    "rustic",
    "silver",
    "tidy",
    "upper",
    "vivid",
    "woolly",
    "young",
    "zesty",
    "bold",
    "crisp",
)
_NOUNS = (
    "anchor",
    "badger",
    "candle",
    "delta",
    "ember",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchard",
    "pebble",
    "quarry",
    "ribbon",
    "saddle",
    "thistle",
    "umbrella",
    "valley",
    "willow",
    "yarrow",
    "zephyr",
)
# Answer budgets in tokens: a 7-digit number is up to 7 tokens, a UUID up to ~36.
_MAX_TOKENS = {"single": 24, "uuid": 56, "multikey": 24, "multivalue": 72}

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Probe:
    """One question asked of a cache and the values its answer must contain."""

    question: str
    answers: tuple[str, ...]
    depth: float  # requested depth of the (first) needle it asks about


@dataclass(frozen=True)
class Case:
    """One haystack document: its text, prompt-prefix tokens and the questions to ask of it."""

    task: str
    length: int
    sample: int
    text: str
    tokens: int
    probes: tuple[Probe, ...]
    needle_depths: tuple[float, ...]  # measured depth of each probe's (first) needle


@dataclass
class Cell:
    """The result of one question: one (preset, length, depth, sample)."""

    task: str
    preset: str
    length: int
    depth: float
    sample: int
    tokens: int  # cached prefix tokens
    needle_depth: float
    question: str
    expected: list[str]
    answer: str
    score: float
    answer_seconds: float  # restore + question prefill + decode
    first_token_seconds: float
    restore_seconds: float
    ingest_seconds: float
    cache_bytes: int
    bits_per_channel: float


@dataclass
class Results:
    """All cells of a run plus what identifies it; `to_json()` is the file format."""

    task: str
    model: str
    model_id: str
    context_length: int
    lengths: list[int]
    depths: list[float]
    presets: list[str]
    samples: int
    seed: int
    shared: bool
    rope_scaling: dict | None = None  # set when the model runs with scaled RoPE (`#rope=` spec)
    skipped_lengths: list[int] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    seconds: float = 0.0

    def grid(self, preset: str) -> list[list[float | None]]:
        """Mean score per [depth][length] for `preset` (None where nothing ran)."""
        out = []
        for d in self.depths:
            row = []
            for n in self.lengths:
                s = [c.score for c in self.cells if c.preset == preset and c.length == n and c.depth == d]
                row.append(sum(s) / len(s) if s else None)
            out.append(row)
        return out

    def summary(self) -> dict:
        """Per preset: mean score, bits/channel, cache bytes per token, mean times."""
        out = {}
        for p in self.presets:
            cells = [c for c in self.cells if c.preset == p]
            if not cells:
                continue
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            longest = max(cells, key=lambda c: c.tokens)
            out[p] = {
                "score": round(mean([c.score for c in cells]), 4),
                "cells": len(cells),
                "bits_per_channel": round(mean([c.bits_per_channel for c in cells]), 3),
                "cache_bytes_per_token": round(mean([c.cache_bytes / c.tokens for c in cells]), 1),
                "cache_bytes_longest": longest.cache_bytes,
                "tokens_longest": longest.tokens,
                "mean_answer_seconds": round(mean([c.answer_seconds for c in cells]), 4),
                "mean_ingest_seconds": round(mean([c.ingest_seconds for c in cells]), 4),
            }
        return out

    def to_json(self) -> dict:
        data = asdict(self)
        data["summary"] = self.summary()
        data["grids"] = {p: self.grid(p) for p in self.presets}
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Results":
        keep = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        keep["cells"] = [Cell(**c) for c in data.get("cells", [])]
        return cls(**keep)


def string_match_all(prediction: str, references: list[str] | tuple[str, ...]) -> float:
    """RULER's metric for one answer: the fraction of references found in it (case-insensitive)."""
    pred = prediction.lower()
    return sum(1.0 for r in references if r.lower() in pred) / len(references)


def parse_length(text: str) -> int:
    """'4k' -> 4096, '7.5k' -> 7680, '2048' -> 2048."""
    t = text.strip().lower()
    try:
        return int(round(float(t[:-1]) * 1024)) if t.endswith("k") else int(t)
    except ValueError:
        raise ConfigError(f"Cannot read the length '{text}'; use tokens like 2048 or 2k.") from None


class _Keys:
    """Distinct 'adjective-noun' keys and distinct values from one seeded generator."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def key(self) -> str:
        while True:
            k = f"{self.rng.choice(_ADJECTIVES)}-{self.rng.choice(_NOUNS)}"
            if k not in self.used:
                self.used.add(k)
                return k

    def value(self, task: str) -> str:
        while True:
            v = (
                str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
                if task == "uuid"
                else str(self.rng.randint(1_000_000, 9_999_999))
            )
            if v not in self.used:
                self.used.add(v)
                return v


def _needle(task: str, key: str, value: str) -> str:
    kind = "uuids" if task == "uuid" else "numbers"
    return f"One of the special magic {kind} for {key} is: {value}."


def _preamble(task: str) -> str:
    kind = "uuids" if task == "uuid" else "numbers"
    return (
        f"Some special magic {kind} are hidden within the following text. Make sure to "
        f"memorize it. I will quiz you about the {kind} afterwards.\n\n"
    )


def make_case(
    task: str,
    length: int,
    depths: list[float],
    sample: int,
    seed: int,
    tokenizer,
    essays: list,
    budget: int,
    piece_tokens: Callable[[str], int],
) -> Case:
    """Build the haystack document of one (task, length, depths, sample): deterministic in `seed`.

    Args:
        depths: one needle group (and question) per depth.
        budget: the most tokens the cached prefix (layout + document) may have.
        piece_tokens: token count of one sentence (cached by the caller).
    """
    if task not in TASKS:
        raise ConfigError(f"Unknown NIAH task '{task}'; choose one of: {', '.join(TASKS)}.")
    rng = random.Random(f"{seed}:{task}:{length}:{sample}:{','.join(map(str, depths))}")
    keys = _Keys(rng)
    needles, where, probes = [], [], []
    what = "uuid" if task == "uuid" else "number"
    for d in depths:
        key = keys.key()
        if task == "multivalue":
            values = [keys.value(task) for _ in range(4)]
            needles += [_needle(task, key, v) for v in values]
            where += [d] + [rng.random() for _ in range(3)]
            q = f"What are all the special magic numbers for {key} mentioned in the provided text?"
        else:
            values = [keys.value(task)]
            needles.append(_needle(task, key, values[0]))
            where.append(d)
            q = f"What is the special magic {what} for {key} mentioned in the provided text?"
        probes.append((Probe(q, tuple(values), d), len(needles) - len(values)))
    if task == "multikey":
        for _ in range(3):
            needles.append(_needle(task, keys.key(), keys.value(task)))
            where.append(rng.random())

    def count(text: str) -> int:
        return len(prompt.prefix_tokens(tokenizer, prompt.layout(tokenizer, DOC_NAME, text)))

    h = hay.build(essays, needles, where, budget, count, piece_tokens, rng.randrange(1 << 30), preamble=_preamble(task))
    return Case(task, length, sample, h.text, h.tokens, tuple(p for p, _ in probes), tuple(h.depths[i] for _, i in probes))


def cut_answer(text: str) -> str:
    """The answer up to the first of STOPS (where a base model starts echoing the prompt)."""
    ends = [i for i in (text.find(m) for m in STOPS) if i >= 0]
    return (text[: min(ends)] if ends else text).strip()


def _ask(probe: Probe, entry_id: str, model: str, max_tokens: int) -> tuple[str, session.Answer, float]:
    answer = session.Answer()
    start = time.perf_counter()
    for _ in asking.ask(probe.question, doc=entry_id, model=model, max_tokens=max_tokens, answer=answer):
        if any(m in answer.text for m in STOPS):
            break
    return cut_answer(answer.text), answer, time.perf_counter() - start


def run(
    model: str | None = None,
    task: str = "single",
    lengths=DEFAULT_LENGTHS,
    depths=DEFAULT_DEPTHS,
    presets=("fp16", "tq4"),
    samples: int = 1,
    seed: int = 0,
    workdir: str | Path = "niah-work",
    shared: bool = False,
    keep: bool = False,
    progress: Progress | None = None,
    on_cell: Callable[[Cell], None] | None = None,
    corpus: str | Path | None = None,
    budget_seconds: float | None = None,
) -> Results:
    """Run the NIAH grid through `session.ingest` / `asking.ask`.

    Args:
        model: `--model` spec (None: the default model).
        task: one of TASKS.
        lengths: context lengths in tokens; those above the model's context are skipped.
        depths: needle depths in [0, 1].
        presets: KV presets; the fp16 baseline is always added first.
        samples: haystacks per cell (different needles and prose order).
        seed: makes every document deterministic.
        workdir: where the haystack documents are written.
        shared: one haystack per (length, sample) holding every depth's needle.
        keep: keep the ingested entries (default: remove each after its questions).
        progress: `progress(done, total)` over ingests.
        on_cell: called with each Cell as soon as it is scored.
        corpus: a folder of prose (default: samples/haystack).
        budget_seconds: start no new document after this long (results so far are returned).

    Returns:
        Results (JSON-able with `to_json()`).
    """
    start = time.perf_counter()
    presets = [BASELINE] + [p for p in dict.fromkeys(presets) if p != BASELINE]
    for p in presets:
        kvcache.get_preset(p)  # unknown names fail before any work
    depths = sorted({round(float(d), 4) for d in depths})
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ConfigError("Depths must be fractions between 0 and 1 (e.g. 0, 0.5, 1).")
    essays = hay.load_corpus(corpus)
    work = Path(workdir)
    with models.reuse_loaded():
        named = models.resolve(model)
        spec = str(named.path)  # the imported directory resolves instantly (no GGUF re-hash)
        ref = models.resolve(spec)
        lm = models.load(ref)
        ctx = lm.context_length
        todo = sorted({int(n) for n in lengths})
        results = Results(
            task,
            model or models.DEFAULT_MODEL,
            named.model_id,
            ctx,
            [n for n in todo if n <= ctx],
            list(depths),
            presets,
            samples,
            seed,
            shared,
            rope_scaling=models.rope_scaling(named),
            skipped_lengths=[n for n in todo if n > ctx],
        )
        sentence_tokens: dict[str, int] = {}

        def piece_tokens(s: str) -> int:
            if s not in sentence_tokens:
                sentence_tokens[s] = len(lm.tokenizer.encode(" " + s, add_special_tokens=False))
            return sentence_tokens[s]

        groups = [list(depths)] if shared else [[d] for d in depths]
        # Every length at one depth before the next depth: a run cut short by its budget still
        # compares presets over the whole length range.
        jobs = [(n, s, g) for s in range(samples) for g in groups for n in results.lengths]
        total, done = len(jobs) * len(presets), 0
        previous = latest_id()
        try:
            for n, s, group in jobs:
                if budget_seconds is not None and time.perf_counter() - start > budget_seconds:
                    break  # whole cases only: every preset answers the same documents
                budget = min(n - _MAX_TOKENS[task] - 48, ctx - session.answer_reserve(ctx))
                case = make_case(task, n, group, s, seed, lm.tokenizer, essays, budget, piece_tokens)
                doc = work / f"{task}-{n}-{s}-{'all' if shared else group[0]}" / DOC_NAME
                doc.parent.mkdir(parents=True, exist_ok=True)
                doc.write_text(case.text, encoding="utf-8")
                for preset in presets:
                    ing = session.ingest(doc, spec, preset, force=True)
                    e = ing.entry
                    for probe, depth in zip(case.probes, case.needle_depths):
                        text, ans, seconds = _ask(probe, e.id, spec, _MAX_TOKENS[task])
                        cell = Cell(
                            task,
                            preset,
                            n,
                            probe.depth,
                            s,
                            e.tokens,
                            round(depth, 4),
                            probe.question,
                            list(probe.answers),
                            text,
                            string_match_all(text, probe.answers),
                            round(seconds, 4),
                            round(ans.first_token_seconds, 4),
                            round(ans.restore_seconds, 4),
                            round(ing.stats.seconds if ing.stats else 0.0, 4),
                            e.bytes,
                            e.bits_per_channel,
                        )
                        results.cells.append(cell)
                        if on_cell:
                            on_cell(cell)
                    if not keep:
                        manage.remove_entry(e.id)
                    done += 1
                    if progress:
                        progress(done, total)
        finally:
            restore_latest(previous)
    results.seconds = round(time.perf_counter() - start, 2)
    return results


def latest_id() -> str | None:
    try:
        return manage.find_entry(None).id
    except Exception:  # no latest entry (or an empty store): nothing to put back
        return None


def restore_latest(entry_id: str | None) -> None:
    """Make the entry that was the latest before the run the latest again."""
    if entry_id is None:
        return

    store = Store()
    try:
        entry = store.get(entry_id)
        if entry is not None:
            store.touch_latest(entry)
    finally:
        store.close()


def save(results: Results, path: str | Path) -> Path:
    """Write `results.to_json()` to `path` (pretty-printed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results.to_json(), indent=1))
    return path


def load(path: str | Path) -> Results:
    """Read results written by `save`."""
    return Results.from_json(json.loads(Path(path).read_text()))
