"""Conversations over a document: follow-up questions on one fork of its restored prefix.

A conversation is a fork of the document's cache (`kvcache.fork`: the compressed prefix shared
read-only, never copied) plus its own tokens: the first question as `ask` lays it out, then each
answer and each follow-up turn in the model's chat template (`turn_text`). Asking again feeds only
the new turn. Its own tokens stay exact in the fork's window, so a conversation is kept on disk as
their keys and values (float16 safetensors + JSON under `conversations/`, pointing at the
document's entry): a later process restores the document, appends them and prefills nothing
already seen (`ask --continue`, `chat --resume`, the server's follow-ups).

When the next turn does not fit in the room left after the document (`room`), the oldest turns
are dropped: the fork is rebuilt from the prefix and the remaining turns fed again.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from longctx import engine, kvcache, prompt
from longctx.errors import ConfigError, ContextLengthError, EntryNotFound, LongctxError
from longctx.session import Answer, question_suffix
from longctx.paths import subdir
from longctx.runtime import models
from longctx.store import Entry

_log = logging.getLogger("longctx.conversation")
MAX_EXACT = 8192  # most conversation tokens kept exact in a fork (and persisted)
_A, _Q = "\u241eLONGCTX-ANSWER\u241e", "\u241eLONGCTX-FOLLOWUP\u241e"


@dataclass
class Turn:
    question: str
    answer: str = ""
    prompt_ids: list[int] = field(default_factory=list)  # the turn's layout around the question
    answer_ids: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


def turn_text(tokenizer) -> tuple[str, str]:
    """(text after an answer and before the next question, text after that question) in the
    model's chat template: e.g. Qwen's ("<|im_end|>\\n<|im_start|>user\\n", "<|im_end|>\\n<|im_start|>assistant\\n")."""
    if not getattr(tokenizer, "chat_template", None):
        return "\nQuestion: ", "\nAnswer:"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": _A}, {"role": "user", "content": _Q}],
        add_generation_prompt=True,
        tokenize=False,
    )
    if _A not in rendered or _Q not in rendered:
        raise ConfigError("This model's chat template drops earlier turns; it cannot hold a conversation.")
    after_answer = rendered[rendered.index(_A) + len(_A) : rendered.index(_Q)]
    return after_answer, rendered[rendered.index(_Q) + len(_Q) :]


def room(lm: models.LoadedModel, entry: Entry) -> int:
    """Tokens a conversation may hold after the document."""
    return max(0, min(lm.context_length - entry.tokens, MAX_EXACT))


def new_id() -> str:
    return secrets.token_hex(6)


class Conversation:
    """One conversation's fork and turns. Not thread-safe: one question at a time."""

    def __init__(self, lm: models.LoadedModel, entry: Entry, prefix: list, cid: str | None = None):
        self.lm, self.entry, self.prefix = lm, entry, prefix
        self.cid = cid or new_id()
        self.turns: list[Turn] = []
        self.dropped = 0  # turns dropped for room, in all
        self.cache = kvcache.fork(prefix, exact_new=max(kvcache.ANSWER_EXACT, room(lm, entry)))
        self._turn_text: tuple[str, str] | None = None  # the template's, read at the first follow-up

    @property
    def tokens(self) -> int:
        """Tokens of the conversation held after the document."""
        return sum(len(t.tokens) for t in self.turns)

    @property
    def room_left(self) -> int:
        """Tokens the conversation may still add after the document and its turns."""
        return room(self.lm, self.entry) - self.tokens

    def _prompt(self, question: str, first: bool) -> list[int]:
        if first:
            return question_suffix(self.lm, self.entry, question)
        if self._turn_text is None:
            self._turn_text = turn_text(self.lm.tokenizer)
        after_answer, after_question = self._turn_text
        text = after_answer + " ".join(question.split()) + after_question
        return prompt.encode(self.lm.tokenizer, text, first=False)

    def _rebuild(self, keep: list[Turn]) -> None:
        self.cache = kvcache.fork(self.prefix, exact_new=max(kvcache.ANSWER_EXACT, room(self.lm, self.entry)))
        ids = [t for turn in keep for t in turn.tokens]
        if ids:
            engine.prefill(self.lm.model, ids, self.cache)
        self.turns = keep

    def fits(self, question: str, max_tokens: int) -> tuple[list[int], int]:
        """The new turn's prompt tokens, after dropping the oldest turns that leave no room for
        it and `max_tokens` of answer; and how many turns were dropped."""
        limit = room(self.lm, self.entry)
        ids = self._prompt(question, not self.turns)
        dropped = 0
        while self.turns and self.tokens + len(ids) + max_tokens > limit:
            dropped += 1
            keep = self.turns[1:]
            if keep:  # the first kept turn now opens the conversation: laid out as a first question
                t = keep[0]
                keep[0] = Turn(t.question, t.answer, self._prompt(t.question, True), t.answer_ids)
            self.turns = keep
            ids = self._prompt(question, not self.turns)
        if len(ids) + 1 > limit:
            raise ContextLengthError(
                f"The question is {len(ids):,} tokens but only {limit:,} are left after "
                f"'{self.entry.name}'; shorten the question."
            )
        if dropped:
            self.dropped += dropped
            self._rebuild(self.turns)
        return ids, dropped

    def extend(self, history: list[tuple[str, str]]) -> None:
        """Feed earlier turns (question, answer) that this process did not answer (a client's
        message history): laid out as if answered here, prefilled in one go."""
        import mlx.core as mx

        for question, text in history:
            ids = self._prompt(question, not self.turns)
            answer_ids = prompt.encode(self.lm.tokenizer, text, first=False)
            self.turns.append(Turn(question, text, ids, answer_ids))
        fresh = [t for turn in self.turns[len(self.turns) - len(history) :] for t in turn.tokens]
        if self.tokens > room(self.lm, self.entry):
            raise ContextLengthError(
                f"The conversation is {self.tokens:,} tokens; only {room(self.lm, self.entry):,} fit after '{self.entry.name}'."
            )
        if fresh:
            engine.prefill(self.lm.model, fresh, self.cache)
            mx.eval([c.state for c in self.cache])

    def ask(
        self, question: str, max_tokens: int = 256, temperature: float = 0.0, seed: int | None = None, answer=None
    ) -> Iterator[str]:
        """Stream the answer to `question` as the conversation's next turn (`answer`, a
        `session.Answer`, gets the timings, the ids and the text)."""
        answer = answer if answer is not None else Answer(entry=self.entry)
        start = time.perf_counter()
        ids, _ = self.fits(question, max_tokens)
        base = self.cache[0].offset
        turn = Turn(question)
        max_tokens = max(1, min(max_tokens, self.room_left - len(ids)))
        if seed is not None:
            import mlx.core as mx

            mx.random.seed(seed)
        stop = frozenset(getattr(self.lm.tokenizer, "eos_token_ids", None) or ())
        out: list[int] = []
        shown = ""
        try:
            for token in engine.token_stream(self.lm.model, ids, self.cache, max_tokens, temperature, stop):
                out.append(token)
                text = self.lm.tokenizer.decode(out)
                if text.endswith("\ufffd") or not text.startswith(shown):
                    continue
                if len(text) > len(shown):
                    if not answer.text:
                        answer.first_token_seconds = time.perf_counter() - start
                    piece, shown = text[len(shown) :], text
                    answer.text += piece
                    yield piece
        finally:  # also when the caller stops early: the turn holds what was answered
            text = self.lm.tokenizer.decode(out)
            if text.startswith(shown) and len(text) > len(shown) and not answer.text.endswith(text[len(shown) :]):
                answer.text += text[len(shown) :]
            turn.answer, turn.prompt_ids, turn.answer_ids = text, ids, out
            answer.tokens = out
            self._settle(base, turn.tokens)
            self.turns.append(turn)

    def _settle(self, base: int, want: list[int]) -> None:
        """Make the fork hold exactly the turn's tokens after `base` (the decode loop feeds a stop
        token, and not the last token of an answer cut by max_tokens)."""
        import mlx.core as mx

        have = self.cache[0].offset - base
        if have > len(want):
            for c in self.cache:
                c.trim(have - len(want))
        elif have < len(want):
            self.lm.model(mx.array([want[have:]], dtype=mx.int32), cache=self.cache)
        mx.eval([c.state for c in self.cache])

    # ---- persistence -------------------------------------------------------------------------

    def save(self) -> Path:
        """Write the conversation (turns + their keys and values) under `conversations/`."""
        import mlx.core as mx

        folder = subdir("conversations")
        arrays = kvcache.new_tokens(self.cache, self.entry.tokens)
        meta = {
            "id": self.cid,
            "entry": self.entry.id,
            "name": self.entry.name,
            "model_id": self.lm.ref.model_id,
            "tokens": self.tokens,
            "updated": time.time(),
            "turns": [
                {"question": t.question, "answer": t.answer, "prompt_ids": t.prompt_ids, "answer_ids": t.answer_ids}
                for t in self.turns
            ],
        }
        fd, tmp = tempfile.mkstemp(prefix=".conv-", suffix=".safetensors", dir=folder)
        os.close(fd)
        mx.save_safetensors(tmp, arrays or {"empty": mx.zeros((1,))}, {"format": "longctx-conversation"})
        os.replace(tmp, folder / f"{self.cid}.safetensors")
        fd, tmp = tempfile.mkstemp(prefix=".conv-", suffix=".json", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / f"{self.cid}.json")
        return folder / f"{self.cid}.json"

    @classmethod
    def load(cls, lm: models.LoadedModel, entry: Entry, prefix: list, cid: str) -> "Conversation":
        """A saved conversation, its tokens appended to a fresh fork of `prefix` (nothing prefilled)."""
        import mlx.core as mx

        meta = read(cid)
        if meta["entry"] != entry.id:
            raise ConfigError(f"Conversation {cid} belongs to another document ('{meta['name']}').")
        conv = cls(lm, entry, prefix, cid)
        conv.turns = [Turn(t["question"], t["answer"], list(t["prompt_ids"]), list(t["answer_ids"])) for t in meta["turns"]]
        if conv.tokens:
            arrays = mx.load(str(subdir("conversations") / f"{cid}.safetensors"))
            kvcache.append(conv.cache, arrays, getattr(mx, lm.dtype))
        return conv


def read(cid: str) -> dict:
    """A saved conversation's JSON (EntryNotFound if there is none)."""
    path = subdir("conversations") / f"{cid}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        raise EntryNotFound(f"No conversation '{cid}'; `longctx list` shows the saved ones.") from None


def saved(entry_id: str | None = None) -> list[dict]:
    """Saved conversations, newest first (of one document's entry, or all)."""
    out = []
    for path in subdir("conversations").glob("*.json"):
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if entry_id is None or meta.get("entry") == entry_id:
            out.append(meta)
    return sorted(out, key=lambda m: m.get("updated", 0), reverse=True)


def remove(cid: str) -> None:
    for suffix in (".json", ".safetensors"):
        (subdir("conversations") / f"{cid}{suffix}").unlink(missing_ok=True)


def answer_from(
    lm: models.LoadedModel,
    entry: Entry,
    cache: list,
    pending,
    question: str,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    answer: Answer,
    start: float,
    conversation=None,
) -> Iterator[str]:
    """Stream the answer to `question` from a restored cache (shown only once `pending`, the
    cache file's checksums, has passed), as the next turn of `conversation` (None: a new one,
    saved afterwards so that `ask --continue` can follow up)."""
    try:
        conv = conversation or Conversation(lm, entry, cache)
        answer.conversation = conv
        turn = Answer(entry=entry)
        stream = conv.ask(question, max_tokens, temperature, seed, turn)
        # shown only once every checksum has passed (None: checked already)
        for piece in pending.guard(stream) if pending is not None else stream:
            if not answer.text:
                answer.first_token_seconds = time.perf_counter() - start
            answer.text += piece
            yield piece
        answer.tokens = turn.tokens
    finally:
        if pending is not None:
            pending.wait()  # an error before the answer starts still reports a damaged cache
    try:  # kept for `ask --continue`; an answer never fails for it
        conv.save()
    except (LongctxError, OSError) as err:
        _log.debug("conversation not kept: %s", err)
