"""Documents longer than the context, and collections of files: segment caches with retrieval.

`ingest_files` reads one or more files (directories are walked for PDF, text and markdown). When
they fit one cache together, a single file becomes an ordinary entry (as `session.ingest`) and
several become a one-segment group; otherwise `segments.split` cuts them at page, section and
paragraph boundaries and each segment is prefilled into its own cache, one progress bar over
all tokens. Each segment is an ordinary entry (crash-safe and checksummed like any other; an
interrupted ingest resumes from the segments already saved); the group record (`store.groups`)
names them and is written last.

`ask_group` ranks the segments for the question (`retrieval`), restores only the chosen ones and
answers from the best; with `segments=k > 1` it answers from each of the k best and keeps the
answer the model itself scores highest (mean log-probability of its tokens). It names the
file and page the answer came from (`retrieval.cite`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from longctx import config, conversation, engine, estimate, kvcache, model_scores, prompt, retrieval, session
from longctx import segments as seg
from longctx.documents import TEXT_SUFFIXES, Document, read_document
from longctx.errors import ConfigError, ContextLengthError, DocumentError, EntryNotFound, StoreError
from longctx.runtime import models
from longctx.store import Entry, Store, budget, entry_id, groups
from longctx.store.groups import Group
from longctx.runtime import distributed
from longctx.errors import ResourceError

SUFFIXES = (".pdf", *TEXT_SUFFIXES)
_TAIL = 8  # tokens after a segment's text in its prompt ("</document>", "Question:")


@dataclass
class SetPlan:
    """What ingesting a set of files would do (the whole of `--dry-run` for several files)."""

    documents: list[Document]
    name: str
    model: models.ModelRef
    preset: kvcache.Preset
    segments: list[seg.Segment]
    tokens: list[list[int]]  # each segment's prefix tokens
    context_length: int
    budget: int
    group_id: str
    question_suffix: str
    fp16_bytes_per_token: int


@dataclass
class SetResult:
    target: Entry | Group
    reused: bool
    stats: engine.PrefillStats | None = None
    built: int = 0  # segments prefilled now (the rest were reused)
    empty_pages: dict | None = None  # file name -> (pages, pages without text)
    eviction: object = None  # budget.Eviction after the save
    eviction_error: str = ""

    @property
    def entry(self) -> Entry | Group:
        return self.target


def expand(paths: Sequence[str | Path]) -> list[Path]:
    """The files to ingest: files as given, directories walked (sorted; hidden names skipped)."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file()
                and f.suffix.lower() in SUFFIXES
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise DocumentError(
                    f"{raw} is a directory with no PDF, text or markdown files in it; give files, or a directory that holds some."
                )
            out.extend(found)
        else:
            out.append(p)
    seen, unique = set(), []
    for p in out:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def segment_budget(context: int) -> int:
    """Most prefix tokens of one segment: the context less the question-and-answer reserve,
    or `LONGCTX_SEGMENT_TOKENS` when smaller."""
    budget = context - session.answer_reserve(context)
    wanted = config.get("segment_tokens")
    return min(budget, wanted) if wanted else budget


def plan(
    paths: Sequence[str | Path],
    name: str | None = None,
    model: str | None = None,
    preset: str = kvcache.DEFAULT_PRESET,
    password: str | None = None,
    documents: list[Document] | None = None,
) -> SetPlan:
    """Read, tokenize and segment the files, without running the model (`documents`: the files,
    already read)."""
    from mlx_lm.utils import load_config

    files = expand(paths)
    if not files:
        raise DocumentError("No files given; name a PDF, text or markdown file or a directory.")
    docs = documents or [read_document(f, password=password) for f in files]
    names = [d.name for d in docs]
    if len(set(names)) < len(names):
        docs = [Document(**{**d.__dict__, "name": str(f)}) for d, f in zip(docs, files)]
    title = name or (docs[0].name if len(docs) == 1 else Path(files[0]).parent.name or "collection")
    ref = models.resolve(model)
    kv = kvcache.get_preset(preset)
    tokenizer = models.tokenizer(ref)
    cfg = load_config(ref.path)
    context = int(cfg.get("text_config", cfg).get("max_position_embeddings") or 2048)
    budget = segment_budget(context)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    def prefix(title_: str, text: str) -> list[int]:
        return prompt.prefix_tokens(tokenizer, prompt.layout(tokenizer, title_, text))

    try:
        parts = seg.split(docs, title, count, lambda t, x: len(prefix(t, x)), budget)
    except ValueError:
        raise ContextLengthError(
            f"'{title}' does not fit this model and cannot be split into segments: the model's "
            f"context is {context:,} tokens, {session.answer_reserve(context):,} of them kept for the question "
            f"and answer, which leaves {budget:,} per segment, too few for the prompt around any "
            "text; use a longer-context model (--model)."
        ) from None
    lay = prompt.layout(tokenizer, title, "")
    gid = groups.group_id(
        [d.sha256 for d in docs],
        ref.weights_sha256,
        ref.tokenizer_sha256,
        kv.name,
        prompt.layout_sha256(tokenizer),
        budget,
        title,
    )
    return SetPlan(
        docs,
        title,
        ref,
        kv,
        parts,
        [prefix(p.title, p.text) for p in parts],
        context,
        budget,
        gid,
        session.light_suffix(ref, tokenizer, lay),
        session.fp16_bytes_per_token(cfg),
    )


def ingest_files(
    paths: Sequence[str | Path],
    name: str | None = None,
    model: str | None = None,
    preset: str = kvcache.DEFAULT_PRESET,
    force: bool = False,
    password: str | None = None,
    progress=None,
    chunk: int = engine.DEFAULT_CHUNK,
) -> SetResult:
    """Ingest files (or directories) as one document set; see the module docstring.

    Returns:
        SetResult whose `target` is an `Entry` (one file that fits) or a `Group`.
    """

    files = expand(paths)
    read = None
    if len(files) == 1 and not name:
        single = session.plan(files[0], model, preset, password)
        if single.fits:
            r = session.ingest(files[0], model, preset, force, password, progress, chunk, planned=single)
            return SetResult(
                r.entry,
                r.reused,
                r.stats,
                0 if r.reused else 1,
                {r.entry.name: (r.entry.pages, r.empty_pages)} if r.empty_pages else None,
                r.eviction,
                r.eviction_error,
            )
        read = [single.document]  # too long for one cache: segments
    p = plan(files, name, model, preset, password, documents=read)
    empty = {d.name: (d.pages, d.empty_pages) for d in p.documents if d.empty_pages}
    kind = "collection" if len(p.documents) > 1 else "segments"
    total = sum(len(t) for t in p.tokens)
    estimate.check(p.model, p.preset, [len(t) for t in p.tokens], p.name, chunk)

    if distributed.group() is not None:
        if distributed.mode() == "data":
            return _ingest_spread(p, files, kind, empty, force, progress, chunk)
        raise ConfigError(
            f"'{p.name}' is past the model's context ({len(p.segments)} segments): under "
            "mlx.launch, ingest it with --parallel data (each rank its segments), or in one process."
        )
    store = Store()
    try:
        with store.lock(p.group_id):
            existing = groups.get(store, p.group_id)
            if existing and not force and _intact(store, existing):
                store.touch_latest(existing)  # type: ignore[arg-type]
                return SetResult(existing, True, empty_pages=empty or None)
            lm: list = []
            saved: list[Entry] = []
            done, seconds, peak, built = 0, 0.0, 0, 0
            for i, tokens in enumerate(p.tokens):
                base = done
                entry, stats = _segment(
                    store, p, files, i, lm, force, (lambda d, t: progress(base + d, total)) if progress else None, chunk
                )
                saved.append(entry)
                if stats is not None:
                    seconds += stats.seconds
                    peak = max(peak, stats.peak_bytes)
                    built += 1
                done += len(tokens)
                if progress:
                    progress(done, total)
            group = groups.save(store, _group(p, files, kind, saved, seconds), saved)
            stats = engine.PrefillStats(total, seconds, peak) if built else None
            result = SetResult(group, False, stats, built, empty or None)
        try:  # the new group is saved whatever happens here
            result.eviction = budget.evict(store, keep=(group.id, *group.segment_ids))
        except StoreError as err:
            result.eviction_error = str(err)
        return result
    finally:
        store.close()


def _segment_id(p: SetPlan, i: int) -> str:
    part = p.segments[i]
    return entry_id(part.sha256, p.model.weights_sha256, p.model.tokenizer_sha256, p.preset.name, p.group_id)


def _segment(
    store: Store, p: SetPlan, files: list[Path], i: int, lm: list, force: bool, progress, chunk: int
) -> tuple[Entry, engine.PrefillStats | None]:
    """Segment i's entry, reused if intact, else prefilled and saved (stats None: reused); `lm`
    holds the model once loaded."""
    part, tokens, eid = p.segments[i], p.tokens[i], _segment_id(p, i)
    with store.lock(eid):
        old = store.get(eid)
        if old is not None and not force and store.verify(old):
            return old, None
        if not lm:
            lm.append(models.load(p.model))
        entry, stats = session.build_entry(
            store,
            lm[0],
            p.preset,
            tokens,
            eid,
            fp16_bytes_per_token=p.fp16_bytes_per_token,
            name=part.title,
            path=str(Path(files[0]).resolve()),
            document_sha256=part.sha256,
            kind="segment",
            pages=_pages(part),
            question_suffix=p.question_suffix,
            progress=progress,
            chunk=chunk,
            group=p.group_id,
            segment=part.index,
        )
        groups.save_text(store, eid, part.text)
        return entry, stats


def _group(p: SetPlan, files: list[Path], kind: str, saved: list[Entry], seconds: float) -> Group:
    """The group record naming `saved`, the plan's segments in order."""
    return Group(
        id=p.group_id,
        name=p.name,
        kind=kind,
        files=tuple(
            {"name": d.name, "path": str(Path(f).resolve()), "sha256": d.sha256, "kind": d.kind, "pages": d.pages}
            for d, f in zip(p.documents, files)
        ),
        segments=tuple(
            {"id": e.id, "label": part.label, "tokens": e.tokens, "spans": [s.to_json() for s in part.spans]}
            for e, part in zip(saved, p.segments)
        ),
        model_id=p.model.model_id,
        model_spec=p.model.spec,
        weights_sha256=p.model.weights_sha256,
        tokenizer_sha256=p.model.tokenizer_sha256,
        kv_preset=p.preset.name,
        prefill_seconds=seconds,
        bits_per_channel=saved[0].bits_per_channel if saved else 0.0,
        question_suffix=p.question_suffix,
    )


def _ingest_spread(p: SetPlan, files: list[Path], kind: str, empty: dict, force: bool, progress, chunk: int) -> SetResult:
    """Data parallel (`--parallel data` under mlx.launch): rank r prefills segments r, r+N, ...
    into its store (each under its own entry's lock, as any ingest); once every rank's are in
    (`agree`, a barrier), rank 0 writes the group record under the group's lock, and the others
    wait for it (a second barrier). The ranks must share one store (one machine, or one
    LONGCTX_HOME): rank 0 names segments it finds there."""
    what = f" while ingesting '{p.name}'"
    mine = distributed.share(len(p.segments))
    leader = distributed.is_leader()
    total = sum(len(p.tokens[i]) for i in mine)
    store = Store()
    try:
        existing = groups.get(store, p.group_id)
        if distributed.agree(bool(existing and not force and _intact(store, existing)), what=what):
            store.touch_latest(existing)  # type: ignore[arg-type]
            return SetResult(existing, True, empty_pages=empty or None)
        lm: list = []
        done, seconds, peak, built = 0, 0.0, 0, 0
        try:
            for i in mine:
                base = done
                _, stats = _segment(
                    store, p, files, i, lm, force, (lambda d, t: progress(base + d, total)) if progress else None, chunk
                )
                if stats is not None:
                    seconds, peak, built = seconds + stats.seconds, max(peak, stats.peak_bytes), built + 1
                done += len(p.tokens[i])
        except BaseException:
            distributed.agree(False, what=what)
            raise
        if not distributed.agree(True, what=what):
            raise ResourceError(
                f"Another rank failed{what}; the segments saved are kept (an ingest "
                "again reuses them) but the document is not recorded. Ingest it again."
            )
        group, missing = None, []
        if leader:
            with store.lock(p.group_id):
                saved = [store.get(_segment_id(p, i)) for i in range(len(p.segments))]
                missing = [i + 1 for i, e in enumerate(saved) if e is None]
                if not missing:
                    group = groups.save(store, _group(p, files, kind, saved, seconds), saved)
        if not distributed.agree(not missing, what=what):
            if missing:
                raise ResourceError(
                    f"Segments {', '.join(map(str, missing))} of '{p.name}' are not in rank 0's "
                    "store: data-parallel ranks need one shared store (one machine, or one "
                    "LONGCTX_HOME); they are kept in the other ranks' stores."
                )
            raise ResourceError(f"Rank 0 could not record '{p.name}'; its segments are kept. Ingest it again.")
        group = group or groups.get(store, p.group_id) or _group(p, files, kind, [], seconds)
        stats = engine.PrefillStats(total, seconds, peak) if built else None
        return SetResult(group, False, stats, built, empty or None)
    finally:
        store.close()


def dry_run(
    paths: Sequence[str | Path],
    name: str | None = None,
    model: str | None = None,
    preset: str = kvcache.DEFAULT_PRESET,
    password: str | None = None,
) -> dict:
    """What `ingest_files` would do, as a dict for the CLI: documents, tokens, segments, the
    cache size on disk, the ingest's peak memory and whether this machine has it."""

    files = expand(paths)
    single = session.plan(files[0], model, preset, password) if len(files) == 1 and not name else None
    read = [single.document] if single is not None else None
    if single is not None and not single.fits:
        single = None
    if single is not None:
        docs, title, ref, kv = [single.document], single.document.name, single.model, single.preset
        counts, labels, eid, context = [len(single.tokens)], [], single.entry_id, single.context_length
        estimated = single.estimated_tokens
    else:
        p = plan(files, name, model, preset, password, documents=read)
        docs, title, ref, kv = p.documents, p.name, p.model, p.preset
        counts, labels, eid = [len(t) for t in p.tokens], [s.label for s in p.segments], p.group_id
        context = p.context_length
        estimated = sum(prompt.estimate_tokens(d.text) for d in docs)
    est = estimate.for_ingest(ref, kv, counts, title, engine.DEFAULT_CHUNK)
    info = {
        "document": title,
        "files": len(docs),
        "pages": sum(d.pages for d in docs),
        "estimated_tokens": estimated,
        "tokens": sum(counts),
        "model": ref.model_id,
        "context_length": context,
        "segments": len(counts),
        "kv_preset": kv.name,
        "estimated_cache_bytes": est["cache_bytes"],
        "estimated_peak_memory_bytes": est["peak_memory_bytes"],
        "machine_memory_bytes": est["machine_memory_bytes"],
        "memory": est["memory"],
        "entry_id": eid,
    }
    if labels and len(labels) > 1:
        info["segment_labels"] = "; ".join(f"{i + 1}: {lab} ({n:,} tok)" for i, (lab, n) in enumerate(zip(labels, counts)))
    empty = {d.name: (d.pages, list(d.empty_pages)) for d in docs if d.empty_pages}
    if empty:
        info["_empty_pages"] = empty
    return info


def _pages(part: seg.Segment) -> int:
    return sum(s.last - s.first + 1 if s.pdf else 1 for s in part.spans)


def _intact(store: Store, group: Group) -> bool:
    for sid in group.segment_ids:
        e = store.get(sid)
        if e is None or not store.verify(e):
            return False
    return True


def find(store: Store, ref: str | None) -> Entry | Group:
    """The group or entry named `ref` (name, id or id prefix), or the latest if None. Segment
    entries are reached through their group only."""
    here = distributed.tag()
    found = groups.groups(store)
    stored = store.entries()
    elsewhere = [e for e in stored if distributed.place(e.topology) != here]
    stored = [e for e in stored if distributed.place(e.topology) == here]  # other topologies' shards are not ours
    entries = [e for e in stored if not e.group]
    if ref is not None and elsewhere and not any(t.name == ref or t.id.startswith(ref.strip()) for t in [*found, *entries]):
        other = next((e for e in elsewhere if e.name == ref or e.id.startswith(ref.strip())), None)
        if other is not None:
            raise EntryNotFound(_topology_hint(other, here))
    if not found and not entries:
        raise EntryNotFound("No documents ingested yet; run `longctx ingest FILE` first.")
    if ref is None:
        latest = store.get_value("latest")
        for t in [*found, *entries]:
            if t.id == latest:
                return t
        return max([*found, *entries], key=lambda t: t.created)
    ref = ref.strip()
    every = [*found, *entries]
    segment = [e for e in stored if e.group and e.id == ref]  # by its exact id only
    matches = (
        [t for t in every if t.id == ref]
        or segment
        or [t for t in every if t.name == ref]
        or [t for t in every if ref and t.id.startswith(ref)]
    )
    if not matches:
        names = ", ".join(sorted({t.name for t in every})[:8])
        raise EntryNotFound(f"No ingested document matches '{ref}'. Known: {names}.")
    matches.sort(key=lambda t: t.created, reverse=True)
    if len(matches) > 1 and not any(m.name == ref for m in matches):
        ids = ", ".join(m.id for m in matches)
        raise EntryNotFound(f"'{ref}' matches several entries ({ids}); give an id.")
    return matches[0]


def ask_group(
    group: Group,
    question: str,
    model: str | None,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    answer,
    start: float,
    ranker: str | None = None,
    segments: int = 1,
) -> Iterator[str]:
    """Answer from a group's best segment(s); fills `answer.sources` and `answer.ranking`."""

    ranker = ranker or config.get("ranker")
    if ranker not in retrieval.RANKERS:
        raise ConfigError(f"Unknown ranker '{ranker}'; choose one of: {', '.join(retrieval.RANKERS)}.")
    if segments < 1:
        raise ConfigError("--segments must be at least 1.")
    store = Store(cleanup=False)
    try:
        entries = [store.get(sid) for sid in group.segment_ids]
        if any(e is None for e in entries):
            raise EntryNotFound(f"Segments of '{group.name}' are missing from the store; ingest it again.")
        texts = [groups.text(store, e.id) for e in entries]
        ref = models.resolve(model or group.model_spec)
        session.check_same_model(entries[0], ref)
        lm = None
        restored: dict[int, tuple] = {}

        def load(i: int):
            nonlocal lm
            if lm is None:
                lm = (models.load_light(ref) if group.question_suffix else None) or models.load(ref)
            if i not in restored:
                restored[i] = session.restore_verifying(entries[i], lm, store)
            return restored[i]

        def model_score(i: int) -> float:
            cache, pending = load(i)
            pending.wait()
            suffix = session.question_suffix(lm, entries[i], question)
            if ranker == "attention":
                # The template before the text (system turn, instructions, document tag) and
                # after it (closing tag, "Question:") are not the document.
                head = len(prompt.prefix_tokens(lm.tokenizer, prompt.layout(lm.tokenizer, entries[i].name, ""))) - _TAIL
                return model_scores.attention_mass(lm, cache, suffix, max(0, head), _TAIL)
            n_q = len(prompt.encode(lm.tokenizer, " " + " ".join(question.split()), first=False))
            return model_scores.question_likelihood(lm, cache, suffix, max(2, min(n_q, len(suffix))))

        order = retrieval.rank(question, texts, ranker, model_score)
        answer.ranking = order
        chosen = order[:segments]
        for j in [j for j in restored if j not in chosen]:  # the model ranker's losers
            restored.pop(j)[1].wait()
        for i in chosen:
            load(i)
            store.record_use(entries[i].id)
    finally:
        store.close()
    answer.restore_seconds = time.perf_counter() - start
    if len(chosen) == 1:
        i = chosen[0]
        answer.entry = entries[i]
        cache, pending = restored[i]
        yield from conversation.answer_from(
            lm, entries[i], cache, pending, question, max_tokens, temperature, seed, answer, start
        )
        answer.sources = [_cite(group, i, texts[i], question + " " + answer.text)]
        return
    best = None
    for i in chosen:
        cache, pending = restored[i]
        trial = session.Answer(entry=entries[i])
        text = "".join(
            conversation.answer_from(lm, entries[i], cache, pending, question, max_tokens, temperature, seed, trial, start)
        )
        suffix = session.question_suffix(lm, entries[i], question)
        ids = list(lm.tokenizer.encode(text, add_special_tokens=False)) if text else []
        score = model_scores.answer_likelihood(lm, cache, suffix, ids)
        if best is None or score > best[0]:
            best = (score, i, text)
    _, i, text = best
    answer.entry = entries[i]
    answer.first_token_seconds = time.perf_counter() - start
    answer.text = text
    answer.sources = [_cite(group, i, texts[i], question + " " + text)]
    yield text


def _cite(group: Group, i: int, text: str, query: str) -> str:
    """Where in segment i the answer is: a PDF page, else the file's lines this segment holds."""
    spans = [seg.Span.from_json(s) for s in group.segments[i].get("spans") or []]
    where = retrieval.cite(text, query, spans[0].file if spans else group.name)
    if " p. " not in where:
        for s in spans:
            if s.file == where and not s.pdf:
                return s.label()
    return where


def _topology_hint(entry: Entry, here: str) -> str:
    """One line saying how to ask a document stored for another topology."""
    t = distributed.parse_tag(entry.topology)
    if t is None:
        return (
            f"'{entry.name}' was ingested in one process; ask it without mlx.launch, or split it for "
            f"these ranks with `longctx reshard {entry.name} --ranks N`."
        )
    how = "" if t.parallel == "tensor" else f" with `--parallel {t.parallel}`"
    return (
        f"'{entry.name}' was ingested across {t.ranks} ranks ({t.parallel} parallel): ask it under "
        f"`mlx.launch -n {t.ranks}`{how}, or join its shards with `longctx merge {entry.name}` to ask it in one process."
    )
