"""The library's use cases: ingest a document into a persisted cache, ask questions of it.

Everything here reports through callbacks and return values; the CLI renders. Errors are
`longctx.errors` subclasses with messages a user can act on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from longctx import engine, kvcache, prompt
from longctx.documents import Document, read_document
from longctx.kvcache.presets import bits_per_channel
from longctx.errors import CacheCorrupt, CacheMismatch, ConfigError, ContextLengthError, ResourceError, StoreError
from longctx.runtime import models
from longctx.store import Entry, Store, budget, entry_id, layout, rebuild_hint
from longctx.store.failpoints import failpoint
from longctx.store.format import CHECKS
from longctx.runtime import distributed
from longctx.runtime.light import PROBES, TextTokenizer
from longctx import estimate

if TYPE_CHECKING:
    from longctx.store.format import PendingChecksums

_log = logging.getLogger("longctx.session")

Progress = Callable[[int, int], None]
ANSWER_RESERVE = 256  # the fewest tokens kept free after the prefix for a question and its answer
CHAT_RESERVE = 4096  # kept free for a conversation where the context allows (an eighth of it at most)


def answer_reserve(context: int) -> int:
    """Tokens an ingest keeps free after a document for questions, answers and follow-ups:
    CHAT_RESERVE where the model's context is 32k or more, an eighth of smaller contexts, at
    least ANSWER_RESERVE."""
    return max(ANSWER_RESERVE, min(CHAT_RESERVE, context // 8))


@dataclass
class Plan:
    """What ingesting a document would do (the whole of `--dry-run`)."""

    document: Document
    model: models.ModelRef
    preset: kvcache.Preset
    estimated_tokens: int  # tiktoken cl100k, instant
    tokens: list[int]  # exact, with the model's tokenizer
    context_length: int
    bytes_per_token: int
    entry_id: str
    question_suffix: str = ""  # the template after the question, when `ask` may skip transformers

    @property
    def reserve(self) -> int:
        return answer_reserve(self.context_length)

    @property
    def fits(self) -> bool:
        """Whether the prefix leaves `answer_reserve` tokens of the context for conversations."""
        return len(self.tokens) + self.reserve <= self.context_length


@dataclass
class IngestResult:
    entry: Entry
    reused: bool
    stats: engine.PrefillStats | None = None
    empty_pages: tuple[int, ...] = ()  # PDF pages without text (ingested without them)
    eviction: budget.Eviction | None = None  # what making room after the save removed
    eviction_error: str = ""  # the store could not be brought within its budget (entry kept)


@dataclass
class Answer:
    """Filled in while `ask` streams; complete once the iterator is exhausted."""

    entry: Entry | None = None
    model_seconds: float = 0.0  # from the call to the model loaded (restore_seconds includes it)
    restore_seconds: float = 0.0
    first_token_seconds: float = 0.0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    group: object = None  # the multidoc.Group answered from, if the document is segmented
    sources: list[str] = field(default_factory=list)  # where the answer came from ("a.pdf p. 3")
    ranking: list[int] = field(default_factory=list)  # segment indices, best first
    conversation: object = None  # the `conversation.Conversation` this answer is a turn of


def fp16_bytes_per_token(config: dict) -> int:
    cfg = config.get("text_config", config)
    n_kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * 2 * n_kv * head_dim * cfg["num_hidden_layers"]


def _check_fits(p: Plan) -> None:
    if not p.fits:
        raise ContextLengthError(
            f"'{p.document.name}' is {len(p.tokens):,} tokens but the model's context is "
            f"{p.context_length:,} (with {p.reserve:,} kept for questions and answers); use a "
            "longer-context model (--model) or split the document."
        )


def plan(
    path: str | Path,
    model: str | None = None,
    preset: str = kvcache.DEFAULT_PRESET,
    password: str | None = None,
    progress: Progress | None = None,
) -> Plan:
    """Read and tokenize a document and work out its cache, without running the model."""
    from mlx_lm.utils import load_config

    doc = read_document(path, password=password, progress=progress)
    ref = models.resolve(model)
    kv = kvcache.get_preset(preset)
    tokenizer = models.tokenizer(ref)
    config = load_config(ref.path)
    lay = prompt.layout(tokenizer, doc.name, doc.text)
    tokens = prompt.prefix_tokens(tokenizer, lay)
    cfg = config.get("text_config", config)
    context = int(cfg.get("max_position_embeddings") or 2048)
    eid = entry_id(doc.sha256, ref.weights_sha256, ref.tokenizer_sha256, kv.name + _at(), prompt.layout_sha256(tokenizer))
    return Plan(
        doc,
        ref,
        kv,
        prompt.estimate_tokens(doc.text),
        tokens,
        context,
        fp16_bytes_per_token(config),
        eid,
        light_suffix(ref, tokenizer, lay),
    )


def _at() -> str:
    """The topology part of a content address ("" in a single process: addresses unchanged)."""
    tag = distributed.tag()
    return f"@{tag}" if tag else ""


def light_suffix(ref: models.ModelRef, tokenizer, lay: prompt.Layout) -> str:
    """The layout's question suffix if the `tokenizers`-only tokenizer encodes questions exactly as
    the model's tokenizer does (then `ask` needs no transformers); "" otherwise."""
    light = TextTokenizer.load(ref.path)
    texts = PROBES + tuple(p + lay.suffix_text for p in PROBES)
    return lay.suffix_text if light is not None and light.matches(tokenizer, texts) else ""


def ingest(
    path: str | Path,
    model: str | None = None,
    preset: str = kvcache.DEFAULT_PRESET,
    force: bool = False,
    password: str | None = None,
    progress: Progress | None = None,
    chunk: int = engine.DEFAULT_CHUNK,
    planned: Plan | None = None,
) -> IngestResult:
    """Prefill a document once into a cache and persist it; reuse an identical earlier entry.
    After a save, least recently used entries are evicted to keep the store within its budget
    (`LONGCTX_MAX_STORE`; the new entry is kept even if it alone is over): `result.eviction`.

    Args:
        path: PDF, text or markdown file.
        model: `--model` value (None: `$LONGCTX_MODEL` or the default model).
        preset: KV preset name.
        force: rebuild even if an identical entry exists.
        password: for encrypted PDFs.
        progress: `progress(done_tokens, total_tokens)` during prefill.
        chunk: prefill chunk size in tokens.
        planned: `plan(path, model, preset, password)` when the caller has it already.
    """
    p = planned or plan(path, model, preset, password)
    _check_fits(p)
    estimate.check(p.model, p.preset, [len(p.tokens)], p.document.name, chunk)
    empty = p.document.empty_pages
    store = Store()
    try:
        # One builder per entry: a concurrent ingest of the same document waits here, then reuses.
        with store.lock(p.entry_id):
            existing = store.get(p.entry_id)
            if existing and not force and store.verify(existing):
                store.touch_latest(existing)
                store.record_use(existing.id)
                _agree_reused()
                return IngestResult(existing, reused=True, empty_pages=empty)
            failpoint("ingest:locked")
            lm = models.load(p.model)
            entry, stats = build_entry(
                store,
                lm,
                p.preset,
                p.tokens,
                p.entry_id,
                fp16_bytes_per_token=p.bytes_per_token,
                name=p.document.name,
                path=str(Path(path).resolve()),
                document_sha256=p.document.sha256,
                kind=p.document.kind,
                pages=p.document.pages,
                question_suffix=p.question_suffix,
                progress=progress,
                chunk=chunk,
            )
            result = IngestResult(entry, reused=False, stats=stats, empty_pages=empty)
        _all_ranks_kept(store, entry)  # outside the lock: a failed group's share is removed
        try:  # the new entry is saved whatever happens here
            result.eviction = budget.evict(store, keep=(result.entry.id,))
        except StoreError as err:
            result.eviction_error = str(err)
        return result
    finally:
        store.close()


def build_entry(
    store: Store,
    lm: models.LoadedModel,
    preset: kvcache.Preset,
    tokens: list[int],
    eid: str,
    *,
    fp16_bytes_per_token: int,
    name: str,
    path: str,
    document_sha256: str,
    kind: str,
    pages: int,
    question_suffix: str = "",
    progress: Progress | None = None,
    chunk: int = engine.DEFAULT_CHUNK,
    group: str = "",
    segment: int = -1,
) -> tuple[Entry, engine.PrefillStats]:
    """Prefill `tokens` into a new cache and save it as entry `eid` (hold `store.lock(eid)`)."""
    import mlx.core as mx

    cache = kvcache.make(lm.model, preset)  # first: refuses a model the preset cannot serve
    dims = kvcache.head_dims(lm.model)
    bpc = bits_per_channel(preset, dims[0], len(tokens))
    store.check_free_space(int(fp16_bytes_per_token * len(tokens) * bpc / 16), f"the cache of '{name}'")

    # a pipeline stage goes token-major: layer-major would depend on the stage's share of layers
    order = {"order": "token"} if distributed.pipelined(lm.model) else {}
    stats = engine.prefill(lm.model, tokens, cache, chunk=chunk, progress=progress, **order)
    failpoint("ingest:prefilled")
    arrays = kvcache.to_arrays(cache, preset)
    arrays["tokens"] = mx.array(tokens, dtype=mx.int32)
    heads = [kvcache.cache_heads(c) for c in cache]
    entry = Entry(
        id=eid,
        name=name,
        path=path,
        document_sha256=document_sha256,
        kind=kind,
        pages=pages,
        tokens=len(tokens),
        model_id=lm.ref.model_id,
        model_spec=lm.ref.spec,
        weights_sha256=lm.ref.weights_sha256,
        tokenizer_sha256=lm.ref.tokenizer_sha256,
        kv_preset=preset.name,
        file=f"{eid}.safetensors",
        bytes=0,
        created=0.0,
        prefill_seconds=stats.seconds,
        bits_per_channel=round(bpc, 4),
        question_suffix=question_suffix,
        group=group,
        segment=segment,
        topology=distributed.entry_tag(lm.model),
    )
    metadata = {
        "model_id": lm.ref.model_id,
        "weights_sha256": lm.ref.weights_sha256,
        "tokenizer_sha256": lm.ref.tokenizer_sha256,
        "document_sha256": document_sha256,
        "tokens": str(len(tokens)),
        "kv_config": json.dumps({**preset.to_json(), "head_dims": dims, "kv_heads": heads, **kvcache.window_config(cache)}),
        "document_name": name,
    }
    saved = store.save(entry, arrays, metadata)
    warm_answer_path(lm, preset, arrays)
    return saved, stats


def warm_answer_path(lm: models.LoadedModel, preset: kvcache.Preset, arrays: dict) -> bool:
    """On CUDA, with longctx's kernel files on (`runtime.cuda_kernels.enabled()`): one decode step through a
    fork of the new cache rebuilt from its arrays, as `ask` restores and forks it, so that the
    kernels an answer launches (longctx's, whose compiled files `runtime.cuda_kernels` writes,
    and MLX's own, which MLX keeps on disk) compile here, inside the ingest, instead of before
    the first answer token of a later `ask` (a question goes token by token on CUDA, through the
    same step: `engine.stepwise`). Once compiled it costs ~two decode steps. Returns whether it
    ran; it never fails the ingest (the entry is saved already)."""
    import mlx.core as mx

    # deferred: loads mlx.core (the light commands start without it)
    from longctx.kernels import backend

    # deferred: loads mlx.core (the light commands start without it)
    from longctx.runtime import cuda_kernels

    try:
        if backend() != "cuda" or not cuda_kernels.enabled() or preset.kind != "turbo":
            return False
        cache = kvcache.fork(kvcache.from_arrays(arrays, lm.model, preset, getattr(mx, lm.dtype)))
        last = int(arrays["tokens"][-1].item())
        for _ in engine.token_stream(lm.model, [last], cache, max_tokens=1):
            pass
        return True
    except Exception as err:  # noqa: BLE001 - the first `ask` compiles them instead
        _log.debug("warming the answer path failed: %r", err)
        return False


def check_same_model(entry: Entry, ref: models.ModelRef) -> None:
    if entry.weights_sha256 != ref.weights_sha256:
        raise CacheMismatch(
            f"'{entry.name}' was ingested with model {entry.model_id} "
            f"(weights {entry.weights_sha256[:12]}), not {ref.model_id} "
            f"(weights {ref.weights_sha256[:12]}); ask without --model, or ingest it again with "
            "this model."
        )
    if entry.tokenizer_sha256 != ref.tokenizer_sha256:
        raise CacheMismatch(
            f"'{entry.name}' was ingested with the tokenizer of {entry.model_id} "
            f"(tokenizer {entry.tokenizer_sha256[:12]}), not that of {ref.model_id} "
            f"(tokenizer {ref.tokenizer_sha256[:12]}); ask without --model, or ingest it again "
            "with this model."
        )


def _check_cache_fits(entry: Entry, meta: dict, lm: models.LoadedModel, preset: kvcache.Preset) -> None:
    """Refuse a (checksum-verified) cache file built for another model, tokenizer or preset."""
    check_same_model(
        Entry(
            **{
                **entry.to_json(),
                "model_id": meta["model_id"],
                "weights_sha256": meta["weights_sha256"],
                "tokenizer_sha256": meta["tokenizer_sha256"],
            }
        ),
        lm.ref,
    )
    try:
        cfg = layout.kv_config(meta)
    except (ValueError, TypeError, RecursionError) as err:
        raise CacheCorrupt(
            f"The cache of '{entry.name}' is corrupt (its KV config is invalid: {err}); {rebuild_hint(entry)}."
        ) from None
    want = preset.to_json()
    built = {k: cfg.get(k) for k in want}
    if built != want:
        diff = ", ".join(f"{k} {built[k]!r} vs {want[k]!r}" for k in want if built[k] != want[k])
        raise CacheMismatch(
            f"The cache of '{entry.name}' was built with KV preset {cfg['name']!r}, which differs "
            f"from this longctx's preset {preset.name!r} ({diff}); {rebuild_hint(entry)}."
        )
    dims = kvcache.head_dims(lm.model)
    if cfg["head_dims"] != dims:
        raise CacheMismatch(
            f"The cache of '{entry.name}' was built for {len(cfg['head_dims'])} layers of head "
            f"dims {sorted(set(cfg['head_dims']))}, but {lm.ref.model_id} has {len(dims)} layers "
            f"of head dims {sorted(set(dims))}; {rebuild_hint(entry)}."
        )
    heads = kvcache.kv_heads(lm.model)
    if any(h is not None and h != f for h, f in zip(heads, cfg["kv_heads"])):
        raise CacheMismatch(
            f"The cache of '{entry.name}' was built for KV heads {cfg['kv_heads']}, but "
            f"{lm.ref.model_id} has {heads}; {rebuild_hint(entry)}."
        )
    from mlx_lm.models.cache import make_prompt_cache

    windows = kvcache.windows(make_prompt_cache(lm.model))
    if cfg.get("windows", [0] * len(dims)) != windows:
        raise CacheMismatch(
            f"The cache of '{entry.name}' was built with sliding windows "
            f"{cfg.get('windows', 'none')}, but {lm.ref.model_id} slides {windows}; "
            f"{rebuild_hint(entry)}."
        )


def restore(entry: Entry, lm: models.LoadedModel, store: Store, answering: bool = True) -> list:
    """Load an entry's cache file and rebuild the per-layer caches, checking it fits the model.

    With `answering` on the CPU, the compressed prefix is also decoded once for attention
    (`kvcache.decode_once`); GPUs read the packed cache directly.

    Raises:
        CacheCorrupt: the file is missing or damaged (nothing of it is used).
        CacheMismatch: it was built with another model, tokenizer or KV preset.
    """
    cache, pending = restore_verifying(entry, lm, store, answering)
    pending.wait()
    return cache


def restore_verifying(
    entry: Entry, lm: models.LoadedModel, store: Store, answering: bool = True, checks: str = CHECKS
) -> tuple[list, "PendingChecksums"]:
    """`restore`, returning while the file's checksums are still being computed on other
    threads: the caller starts the question at once and calls `wait()` on the second value
    (it raises CacheCorrupt) before showing anything computed from the cache (`ask` does,
    before its first answer token). Header, metadata and sizes are checked before this returns.
    `checks`: when the checksum threads start (`Store.load_verifying`)."""
    import mlx.core as mx

    try:
        preset = kvcache.get_preset(entry.kv_preset)
    except ConfigError:
        raise CacheMismatch(
            f"'{entry.name}' was ingested with KV preset {entry.kv_preset!r}, which this longctx "
            f"does not know; upgrade longctx, or {rebuild_hint(entry)}."
        ) from None
    arrays, meta, pending = store.load_verifying(entry, lambda m: _check_cache_fits(entry, m, lm, preset), checks)
    try:
        cache = kvcache.from_arrays(arrays, lm.model, preset, getattr(mx, lm.dtype))
        mx.eval([c.state for c in cache])
        if answering and mx.default_device().type == mx.DeviceType.cpu:
            kvcache.decode_once(cache)
    except BaseException:
        pending.wait()  # a damaged file explains a failure here better than the failure does
        raise
    return cache, pending


def question_suffix(lm: models.LoadedModel, entry: Entry, question: str) -> list[int]:
    """The tokens appended to `entry`'s cached prefix for `question` (ContextLengthError if the
    question does not fit after the prefix)."""
    if entry.question_suffix:
        lay = prompt.Layout(prefix_text="", suffix_text=entry.question_suffix)
    else:
        lay = prompt.layout(lm.tokenizer, entry.name, "")
    suffix = prompt.question_tokens(lm.tokenizer, lay, question)
    room = lm.context_length - entry.tokens
    if len(suffix) + 1 > room:
        raise ContextLengthError(
            f"The question is {len(suffix):,} tokens but only {room:,} of the model's "
            f"{lm.context_length:,}-token context are left after '{entry.name}'; shorten the "
            "question."
        )
    return suffix


def _all_ranks_kept(store: Store, entry: Entry) -> None:
    """Under mlx.launch: keep this rank's share only if every rank saved its own (none left
    behind by a failed peer)."""
    cleanup = (
        "from pathlib import Path\nfrom longctx.store import Store\n"
        f"s = Store(Path({str(store.root)!r}), cleanup=False); e = s.get({entry.id!r})\n"
        "e is not None and s.remove(e); s.close()"
    )
    if not distributed.agree(True, cleanup, f" while ingesting '{entry.name}'"):
        store.remove(entry)
        raise ResourceError(
            f"Another rank failed while ingesting '{entry.name}'; this rank's share was "
            "removed, so nothing of it is kept. Ingest it again."
        )


def _agree_reused() -> None:
    """Under mlx.launch: meet the other ranks' check (`_all_ranks_kept`) when this rank's share
    was there already."""
    distributed.agree(True)
