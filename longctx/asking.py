"""Asking a stored document: the one answering entry point of the CLI's `ask` and `chat`, and of
the server's segmented documents. A document is an entry (answered as a conversation turn,
`conversation`) or a segmented group (answered from its best segments, `multidoc.ask_group`)."""

from __future__ import annotations

import time
from typing import Iterator

from longctx import conversation as talk
from longctx import multidoc
from longctx.conversation import answer_from
from longctx.errors import ConfigError, EntryNotFound
from longctx.runtime import models
from longctx.session import Answer, check_same_model, restore, restore_verifying
from longctx.store import Store


def ask(
    question: str,
    doc: str | None = None,
    model: str | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    seed: int | None = None,
    answer: Answer | None = None,
    ranker: str | None = None,
    segments: int = 1,
    conversation: str | None = None,
) -> Iterator[str]:
    """Answer `question` from a stored document's cache; yields the answer text as it streams.

    Args:
        question: the question.
        doc: document name or entry id (None: the most recently ingested).
        model: `--model`; must be the model the cache was built with (None: that model).
        max_tokens: the most answer tokens.
        temperature: 0 for greedy.
        seed: sampler seed when temperature > 0.
        answer: filled with timings, token ids and the full text while streaming.
        ranker: for a segmented document or collection, how segments are chosen ("bm25" or
            "model"; None: the `LONGCTX_RANKER` setting).
        segments: how many of the best-ranked segments to answer from (the answer the model
            scores highest is kept).
        conversation: continue a saved conversation: its id, or "last" (the latest one, of
            `doc` if given); the answer is its next turn and it is saved again.
    """
    answer = answer if answer is not None else Answer()
    start = time.perf_counter()
    store = Store(cleanup=False)  # read-only: crashed writers' leftovers go at the next ingest/list
    try:
        if conversation:
            store.close()
            yield from _continue(conversation, doc, question, model, max_tokens, temperature, seed, answer, start)
            return
        target = multidoc.find(store, doc)
        if isinstance(target, multidoc.Group):
            answer.group = target
            store.close()
            yield from multidoc.ask_group(
                target, question, model, max_tokens, temperature, seed, answer, start, ranker=ranker, segments=segments
            )
            return
        entry = target
        answer.entry = entry
        ref = models.resolve(model or entry.model_spec)
        check_same_model(entry, ref)
        # Caches whose question suffix was checked at ingest answer without transformers.
        lm = (models.load_light(ref) if entry.question_suffix else None) or models.load(ref)
        answer.model_seconds = time.perf_counter() - start
        # The checksums are computed while the question runs; checked before the first token.
        cache, pending = restore_verifying(entry, lm, store)
        store.record_use(entry.id)
    finally:
        store.close()
    answer.restore_seconds = time.perf_counter() - start
    yield from answer_from(lm, entry, cache, pending, question, max_tokens, temperature, seed, answer, start)


def open_conversation(doc: str | None = None, model: str | None = None, cid: str | None = None):
    """A conversation over a stored document, ready for questions (`Conversation.ask`).

    Args:
        doc: document name or entry id (None: the latest ingested, or the conversation's).
        model: must be the cache's model (None: that model).
        cid: continue this saved conversation, or "last" (the latest, of `doc` if given);
            None: a new conversation.
    """
    store = Store(cleanup=False)
    try:
        meta = None
        if cid == "last":
            entry_id = multidoc.find(store, doc).id if doc is not None else None
            found = talk.saved(entry_id)
            if not found:
                raise EntryNotFound("There is no earlier conversation to continue: ask a question first.")
            meta = found[0]
        elif cid:
            meta = talk.read(cid)
        if meta is not None:
            entry = store.get(meta["entry"])
            if entry is None:
                raise EntryNotFound(
                    f"The document of conversation {meta['id']} ('{meta['name']}') is no longer in the store; ingest it again."
                )
        else:
            entry = multidoc.find(store, doc)
            if isinstance(entry, multidoc.Group):
                raise ConfigError(
                    f"'{entry.name}' is split into {len(entry.segment_ids)} segments: a "
                    "conversation needs a document that fits the model's context; ask it "
                    "one question at a time with `longctx ask`."
                )
        ref = models.resolve(model or entry.model_spec)
        check_same_model(entry, ref)
        lm = models.load(ref)
        cache = restore(entry, lm, store)
        store.record_use(entry.id)
    finally:
        store.close()
    if meta is not None:
        return talk.Conversation.load(lm, entry, cache, meta["id"])
    return talk.Conversation(lm, entry, cache)


def _continue(
    cid: str,
    doc: str | None,
    question: str,
    model: str | None,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    answer: Answer,
    start: float,
) -> Iterator[str]:
    """`ask` as the next turn of a saved conversation."""
    conv = open_conversation(doc, model, cid)
    answer.entry = conv.entry
    answer.restore_seconds = time.perf_counter() - start
    yield from answer_from(
        conv.lm, conv.entry, conv.prefix, None, question, max_tokens, temperature, seed, answer, start, conversation=conv
    )
