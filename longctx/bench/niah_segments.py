"""Needle in a haystack past the model's context: segment caches, and the rankers that pick them.

A haystack document longer than the context (same prose and sentence-boundary placement as
`haystack.build`) holds one needle, "The special magic number for the {key} is: {value}.", at
the cell's depth. It is ingested through `multidoc.ingest_files`, which splits it into segment
caches under a group record; each question is then asked with each ranker through
`asking.ask(..., doc=<group id>, ranker=r)`, which ranks the segments, restores the chosen one
and answers from it. Two tasks ask of the same document (one ingest serves both):
- `literal`: RULER's wording, "What is the special magic number for the {key} mentioned in the
  provided text?" (the key's words are in the needle);
- `paraphrase`: the key said in other words, "What number was mentioned for the {paraphrase}?"
  (`PARAPHRASES`): no word of the key is in the question. "number" is its one content word in
  the needle: the question has to say what it asks for, and SmolLM2-135M answered "figure" and
  "code" phrasings with made-up numbers (0/12 at 1.5k tokens, "number" 4/4). The prose uses
  "number" about 3 times per 13k tokens, so in 8k segments it is a weak cue shared with others.
  BM25 finds the segment only through that cue or by chance (all-zero scores keep document
  order, so a needle at depth 0 is "found" so); the model ranker must recognise it, among
  BM25's best `retrieval.RERANK` only.
Per question: the segment that holds the needle (found in the stored segment texts), the
ranker's ranking, recall@1 / recall@2 (the needle's segment first / in the first two), the end
accuracy (RULER `string_match_all` on the cut answer, as `niah` scores), and timings (restore,
which includes the ranking, and first token). The haystack has no instruction preamble: it would
sit in the first segment only.

Where the wall time goes, with the default SmolLM2-135M-Instruct (8k context, tq4; a segment
holds ~7.9k tokens, so 16k/32k/64k are 3/5/9 segments): the ingest of every entry (prefill plus
quantizing and saving, 5 depths x (16k+32k+64k) = 560k tokens); each document's 4 questions (2
tasks x 2 rankers: bm25 restores one segment, model restores up to 4 and scores the question on
each, so its questions cost more); the model load. Each cell of the results file holds its
measured timings; the gpu.sh phase `niahseg` stops starting documents after 420 s
(`budget_seconds`).
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from longctx import asking

from longctx import kvcache, manage, multidoc, retrieval, session
from longctx.bench import haystack as hay
from longctx.bench import env, niah
from longctx.errors import ConfigError
from longctx.runtime import models
from longctx.store import Store, groups

TASKS = ("literal", "paraphrase")
RANKERS = retrieval.RANKERS
DEFAULT_LENGTHS = (16384, 32768, 65536)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DOC_NAME = "haystack.txt"
MAX_TOKENS = 40  # SmolLM2 restates the question (~20 tokens) before the 7-digit number
_VALUE = re.compile(r"\d{7}")  # the answer's first 7 digits: nothing after them changes its score
# (key, the same thing in other words): no content word of the paraphrase is in the key.
PARAPHRASES = (
    ("cobalt lighthouse", "blue beacon by the sea"),
    ("crimson violin", "red fiddle"),
    ("silent locomotive", "quiet steam train"),
    ("copper kettle", "reddish metal teapot"),
    ("ancient library", "very old book collection"),
    ("velvet curtain", "soft theatre drape"),
    ("emerald parrot", "green talking bird"),
    ("marble staircase", "polished stone steps"),
    ("wooden bridge", "timber crossing over the river"),
    ("iron anchor", "heavy weight that holds a ship in place"),
    ("glass greenhouse", "transparent building for growing plants"),
    ("desert caravan", "camel train crossing the sand dunes"),
    ("mountain cabin", "small hut high in the peaks"),
    ("silver locket", "tiny pendant worn around the neck"),
    ("harbor crane", "dockside lifting machine"),
    ("clockwork owl", "wind-up mechanical night bird"),
    ("paper lantern", "lamp made of folded sheets"),
    ("frozen waterfall", "icy cascade"),
    ("golden telescope", "yellow stargazing tube"),
    ("midnight bakery", "bread shop open at twelve at night"),
    ("porcelain teacup", "fine china mug"),
    ("leather saddle", "horse seat made of hide"),
)

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Case:
    """One haystack document past the context and its needle."""

    length: int
    depth: float
    text: str
    tokens: int  # the document text's tokens (each segment's prompt adds a few)
    key: str
    paraphrase: str
    value: str
    needle: str
    needle_depth: float  # measured depth of the needle in the body

    def question(self, task: str) -> str:
        if task == "literal":
            return f"What is the special magic number for the {self.key} mentioned in the provided text?"
        if task == "paraphrase":
            return f"What number was mentioned for the {self.paraphrase}?"
        raise ConfigError(f"Unknown task '{task}'; choose one of: {', '.join(TASKS)}.")


@dataclass
class Cell:
    """One question asked with one ranker of one segmented haystack."""

    task: str
    ranker: str
    length: int
    depth: float
    tokens: int  # document tokens
    segments: int
    needle_segment: int  # index of the segment holding the needle (-1: not found)
    needle_depth: float
    question: str
    expected: list[str]
    ranking: list[int]
    recall_at_1: float
    recall_at_2: float
    answer_segment: int  # the segment the answer came from
    answer: str
    score: float
    answer_seconds: float  # ranking + restore + question prefill + decode
    first_token_seconds: float
    restore_seconds: float  # ranking (model: up to RERANK restores and scores) + restore
    ingest_seconds: float
    group: str = ""  # the group's id (removed after the run unless `keep`)


@dataclass
class Results:
    """All cells of a run plus what identifies it; `to_json()` is the file format."""

    model: str
    model_id: str
    context_length: int
    preset: str
    lengths: list[int]
    depths: list[float]
    rankers: list[str]
    tasks: list[str]
    seed: int
    segments: dict = field(default_factory=dict)  # str(length) -> segment counts seen
    environment: dict = field(default_factory=dict)
    cells: list[Cell] = field(default_factory=list)
    seconds: float = 0.0

    def select(self, ranker: str, task: str | None = None, length: int | None = None) -> list[Cell]:
        return [
            c
            for c in self.cells
            if c.ranker == ranker and (task is None or c.task == task) and (length is None or c.length == length)
        ]

    def grid(self, ranker: str, task: str, metric: str = "score") -> list[list[float | None]]:
        """Mean `metric` ("score", "recall_at_1", "recall_at_2") per [depth][length]."""
        out = []
        for d in self.depths:
            row = []
            for n in self.lengths:
                s = [getattr(c, metric) for c in self.select(ranker, task, n) if c.depth == d]
                row.append(sum(s) / len(s) if s else None)
            out.append(row)
        return out

    def summary(self) -> dict:
        """{task: {ranker: {"all": stats, "<length>": stats}}}, stats = recall@1, recall@2,
        accuracy, cells, mean restore and first-token seconds."""
        out: dict = {}
        for t in self.tasks:
            for r in self.rankers:
                per = {"all": _stats(self.select(r, t))}
                per.update({str(n): _stats(self.select(r, t, n)) for n in self.lengths})
                if per["all"]:
                    out.setdefault(t, {})[r] = per
        return out

    def to_json(self) -> dict:
        data = asdict(self)
        data["summary"] = self.summary()
        data["grids"] = {r: {t: self.grid(r, t) for t in self.tasks} for r in self.rankers}
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Results":
        keep = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        keep["cells"] = [Cell(**c) for c in data.get("cells", [])]
        return cls(**keep)


def _stats(cells: list[Cell]) -> dict:
    if not cells:
        return {}
    mean = lambda xs: round(sum(xs) / len(xs), 4)  # noqa: E731
    return {
        "recall_at_1": mean([c.recall_at_1 for c in cells]),
        "recall_at_2": mean([c.recall_at_2 for c in cells]),
        "accuracy": mean([c.score for c in cells]),
        "cells": len(cells),
        "mean_restore_seconds": mean([c.restore_seconds for c in cells]),
        "mean_first_token_seconds": mean([c.first_token_seconds for c in cells]),
    }


def recall_at(ranking: list[int], segment: int, k: int) -> float:
    """1.0 if `segment` is among the first `k` of `ranking`, else 0.0 (0.0 for segment -1)."""
    return 1.0 if segment >= 0 and segment in ranking[:k] else 0.0


def needle_segment(texts: list[str], needle: str, value: str) -> int:
    """Index of the text holding the needle (or, failing that, its value); -1 if none does."""
    for probe in (needle, value):
        for i, t in enumerate(texts):
            if probe in t:
                return i
    return -1


def context_length(model: str | None) -> int:
    """The model's context in tokens (from its config; no weights loaded)."""
    from mlx_lm.utils import load_config

    cfg = load_config(models.resolve(model).path)
    return int(cfg.get("text_config", cfg).get("max_position_embeddings") or 2048)


def make_case(length: int, depth: float, seed: int, tokenizer, essays: list, piece_tokens: Callable[[str], int]) -> Case:
    """The haystack document of one (length, depth): at most `length` text tokens, deterministic
    in `seed`."""
    rng = random.Random(f"{seed}:segments:{length}:{depth}")
    key, paraphrase = rng.choice(PARAPHRASES)
    value = str(rng.randint(1_000_000, 9_999_999))
    needle = f"The special magic number for the {key} is: {value}."

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    h = hay.build(essays, [needle], [depth], length, count, piece_tokens, rng.randrange(1 << 30))
    return Case(length, depth, h.text, h.tokens, key, paraphrase, value, needle, h.depths[0])


def _ask(question: str, group_id: str, model: str, ranker: str) -> tuple[str, session.Answer, float]:
    answer = session.Answer()
    start = time.perf_counter()
    for _ in asking.ask(question, doc=group_id, model=model, max_tokens=MAX_TOKENS, answer=answer, ranker=ranker):
        if any(m in answer.text for m in niah.STOPS) or _VALUE.search(answer.text):
            break
    return niah.cut_answer(answer.text), answer, time.perf_counter() - start


def run(
    model: str | None = None,
    lengths=DEFAULT_LENGTHS,
    depths=DEFAULT_DEPTHS,
    rankers=RANKERS,
    tasks=TASKS,
    preset: str = kvcache.DEFAULT_PRESET,
    seed: int = 0,
    workdir: str | Path = "niah-work",
    keep: bool = False,
    progress: Progress | None = None,
    on_cell: Callable[[Cell], None] | None = None,
    corpus: str | Path | None = None,
    budget_seconds: float | None = None,
) -> Results:
    """Run the segmented grid: per (length, depth) one document ingested as segments, each task's
    question asked with each ranker.

    Args:
        model: `--model` spec (None: the default model).
        lengths: document lengths in tokens; each must exceed the model's context.
        depths: needle depths in [0, 1].
        rankers: "bm25" and/or "model".
        tasks: "literal" and/or "paraphrase".
        preset: the KV preset of the segment caches.
        seed: makes every document deterministic.
        workdir: where the haystack documents are written.
        keep: keep the ingested groups (default: remove each after its questions).
        progress: `progress(done, total)` over documents.
        on_cell: called with each Cell as soon as it is scored.
        corpus: a folder of prose (default: samples/haystack).
        budget_seconds: start no new document after this long (results so far are returned).

    Returns:
        Results (JSON-able with `to_json()`).
    """
    start = time.perf_counter()
    rankers = list(dict.fromkeys(rankers))
    tasks = list(dict.fromkeys(tasks))
    bad = [r for r in rankers if r not in RANKERS] + [t for t in tasks if t not in TASKS]
    if bad or not rankers or not tasks:
        raise ConfigError(
            f"Unknown ranker or task {', '.join(bad) or '(none given)'}; rankers: "
            f"{', '.join(RANKERS)}; tasks: {', '.join(TASKS)}."
        )
    kvcache.get_preset(preset)
    depths = sorted({round(float(d), 4) for d in depths})
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ConfigError("Depths must be fractions between 0 and 1 (e.g. 0, 0.5, 1).")
    essays = hay.load_corpus(corpus)
    work = Path(workdir)
    with models.reuse_loaded():
        named = models.resolve(model)
        spec = str(named.path)  # the imported directory resolves instantly (no GGUF re-hash)
        lm = models.load(models.resolve(spec))
        ctx = lm.context_length
        todo = sorted({int(n) for n in lengths})
        short = [n for n in todo if n <= ctx]
        if short or not todo:
            raise ConfigError(
                f"Segmented NIAH lengths must exceed the model's {ctx:,}-token "
                f"context (got {', '.join(map(str, short)) or 'none'}); shorter "
                "lengths run through `niah.run`."
            )
        results = Results(
            model or models.DEFAULT_MODEL,
            named.model_id,
            ctx,
            preset,
            todo,
            list(depths),
            rankers,
            tasks,
            seed,
            environment=env.environment(),
        )
        sentence_tokens: dict[str, int] = {}

        def piece_tokens(s: str) -> int:
            if s not in sentence_tokens:
                sentence_tokens[s] = len(lm.tokenizer.encode(" " + s, add_special_tokens=False))
            return sentence_tokens[s]

        # Every length at one depth before the next: a run cut short still spans the lengths.
        jobs = [(n, d) for d in depths for n in todo]
        previous = niah.latest_id()
        try:
            for done, (n, d) in enumerate(jobs):
                if budget_seconds is not None and time.perf_counter() - start > budget_seconds:
                    break
                case = make_case(n, d, seed, lm.tokenizer, essays, piece_tokens)
                for cell in _run_case(case, spec, preset, rankers, tasks, work, keep):
                    seen = results.segments.setdefault(str(n), [])
                    if cell.segments not in seen:
                        seen.append(cell.segments)
                        seen.sort()
                    results.cells.append(cell)
                    if on_cell:
                        on_cell(cell)
                if progress:
                    progress(done + 1, len(jobs))
        finally:
            niah.restore_latest(previous)
    results.seconds = round(time.perf_counter() - start, 2)
    return results


def _run_case(case: Case, spec: str, preset: str, rankers: list[str], tasks: list[str], work: Path, keep: bool) -> list[Cell]:
    doc = work / f"segments-{case.length}-{case.depth}" / DOC_NAME
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(case.text, encoding="utf-8")
    ing = multidoc.ingest_files([doc], model=spec, preset=preset, force=True)
    group = ing.target
    if not isinstance(group, groups.Group):
        manage.remove_entry(group.id)
        raise ConfigError(
            f"A {case.length:,}-token haystack fits one cache; segmented NIAH needs lengths past the model's context."
        )
    store = Store(cleanup=False)
    try:
        texts = [groups.text(store, sid) for sid in group.segment_ids]
    finally:
        store.close()
    where = needle_segment(texts, case.needle, case.value)
    ingest_seconds = round(ing.stats.seconds if ing.stats else 0.0, 4)
    cells = []
    try:
        for task in tasks:
            question = case.question(task)
            for ranker in rankers:
                text, ans, seconds = _ask(question, group.id, spec, ranker)
                ranking = list(ans.ranking)
                cells.append(
                    Cell(
                        task,
                        ranker,
                        case.length,
                        case.depth,
                        case.tokens,
                        len(texts),
                        where,
                        round(case.needle_depth, 4),
                        question,
                        [case.value],
                        ranking,
                        recall_at(ranking, where, 1),
                        recall_at(ranking, where, 2),
                        ans.entry.segment if ans.entry is not None else -1,
                        text,
                        niah.string_match_all(text, [case.value]),
                        round(seconds, 4),
                        round(ans.first_token_seconds, 4),
                        round(ans.restore_seconds, 4),
                        ingest_seconds,
                        group.id,
                    )
                )
    finally:
        if not keep:
            manage.remove_entry(group.id)
    return cells


save = niah.save  # writes `results.to_json()`, pretty-printed


def load(path: str | Path) -> Results:
    """Read results written by `save`."""
    return Results.from_json(json.loads(Path(path).read_text()))
