"""Split documents that do not fit one cache into segments that each do.

A document set (one long document, or several files of a collection) becomes a list of
`Segment`s: runs of whole units (PDF pages, markdown sections, paragraphs) packed greedily up to a
token budget, cut at a heading when a segment is already well filled. A unit too large for any
segment is split at lines, then sentences, then words. Each segment's prompt names the
document(s) and the pages or lines it holds, so the model (and the user) know what it reads.

Every segment's prompt is checked exactly with the model's tokenizer against the budget; token
counts of units are only used to plan the packing.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from longctx.documents import Document

_PAGE = re.compile(r"^\[Page (\d+)\]$", re.MULTILINE)
_HEADING = re.compile(r"^#{1,6}\s")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
HEADING_CUT = 0.6  # a heading starts a new segment once the current one is this full


@dataclass(frozen=True)
class Unit:
    """A piece of one file that is never split unless it alone exceeds the budget."""

    file: str  # the file's name
    first: int  # first page (PDF) or line (text), 1-based
    last: int
    text: str
    pdf: bool


@dataclass(frozen=True)
class Span:
    """The part of one file a segment holds: pages (PDF) or lines (text), inclusive."""

    file: str
    first: int
    last: int
    pdf: bool

    def label(self) -> str:
        what = "p." if self.pdf else "lines"
        if self.first == self.last:
            return f"{self.file} {what} {self.first}"
        return f"{self.file} {what} {self.first}\u2013{self.last}"

    def to_json(self) -> list:
        return [self.file, self.first, self.last, self.pdf]

    @classmethod
    def from_json(cls, value: list) -> "Span":
        return cls(str(value[0]), int(value[1]), int(value[2]), bool(value[3]))


@dataclass(frozen=True)
class Segment:
    """One cache's worth of a document set."""

    index: int
    spans: tuple[Span, ...]
    text: str  # what the model reads (file headers for collections, `[Page N]` lines kept)
    title: str  # the name shown to the model in the prompt's document tag

    @property
    def label(self) -> str:
        return "; ".join(s.label() for s in self.spans)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(f"{self.title}\0{self.text}".encode()).hexdigest()


def units(doc: Document) -> list[Unit]:
    """A document's units: its pages (PDF) or its paragraphs (text, markdown), in order."""
    if doc.kind == "pdf":
        marks = list(_PAGE.finditer(doc.text))
        out = []
        for i, m in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(doc.text)
            body = doc.text[m.start() : end].strip()
            page = int(m.group(1))
            out.append(Unit(doc.name, page, page, body, True))
        if not marks and doc.text.strip():
            out.append(Unit(doc.name, 1, doc.pages or 1, doc.text.strip(), True))
        return out
    out, line, buf, start = [], 1, [], 1
    for raw in doc.text.split("\n"):
        if raw.strip():
            if not buf:
                start = line
            buf.append(raw)
        elif buf:
            out.append(Unit(doc.name, start, line - 1, "\n".join(buf), False))
            buf = []
        line += 1
    if buf:
        out.append(Unit(doc.name, start, line - 1, "\n".join(buf), False))
    return out


def _split_unit(unit: Unit, count: Callable[[str], int], budget: int) -> list[Unit]:
    """`unit` cut into pieces of at most `budget` tokens: at lines, then sentences, then words."""
    if count(unit.text) <= budget:
        return [unit]
    for sep, splitter in (("\n", lambda t: t.split("\n")), (" ", _SENTENCE.split), (" ", lambda t: t.split(" "))):
        parts = [p for p in splitter(unit.text) if p.strip()]
        if len(parts) > 1:
            break
    else:  # one unbroken run of characters: cut by characters
        step = max(1, len(unit.text) * budget // max(1, count(unit.text)))
        parts = [unit.text[i : i + step] for i in range(0, len(unit.text), step)]
    out: list[Unit] = []
    buf: list[str] = []
    line = unit.first
    for part in parts:
        trial = sep.join(buf + [part])
        if buf and count(trial) > budget:
            out.extend(_split_unit(_piece(unit, sep.join(buf), line), count, budget))
            if not unit.pdf:
                line += sep.join(buf).count("\n") + (1 if sep == "\n" else 0)
            buf = [part]
        else:
            buf.append(part)
    if buf:
        out.extend(_split_unit(_piece(unit, sep.join(buf), line), count, budget))
    return out


def _piece(unit: Unit, text: str, line: int) -> Unit:
    if unit.pdf:
        return Unit(unit.file, unit.first, unit.last, text, True)
    last = min(unit.last, line + text.count("\n"))
    return Unit(unit.file, line, max(line, last), text, False)


def _spans(group: Sequence[Unit]) -> tuple[Span, ...]:
    spans: list[Span] = []
    for u in group:
        if spans and spans[-1].file == u.file:
            s = spans[-1]
            spans[-1] = Span(s.file, min(s.first, u.first), max(s.last, u.last), s.pdf)
        else:
            spans.append(Span(u.file, u.first, u.last, u.pdf))
    return tuple(spans)


def _render(group: Sequence[Unit], collection: bool) -> str:
    """A segment's text: units in order; collections get a `[File NAME]` line per file."""
    parts, current = [], None
    for u in group:
        if collection and u.file != current:
            parts.append(f"[File {u.file}]")
            current = u.file
        parts.append(u.text)
    return "\n\n".join(parts)


def _title(name: str, spans: tuple[Span, ...], whole: bool) -> str:
    if whole:
        return name
    return f"{name} ({'; '.join(s.label() for s in spans)})"


def split(
    docs: Sequence[Document], name: str, count: Callable[[str], int], prompt_tokens: Callable[[str, str], int], budget: int
) -> list[Segment]:
    """Pack `docs` into segments whose prompts are at most `budget` tokens.

    Args:
        docs: the documents, in order (one long document, or a collection's files).
        name: the document set's name (the file name, or the collection's `--name`).
        count: tokens of a piece of text (the model's tokenizer, no special tokens).
        prompt_tokens: exact tokens of the cached prefix for (title, text).
        budget: the most prefix tokens one segment may have.

    Returns:
        the segments, in document order; one segment holding everything if it all fits.

    Raises:
        ValueError: the budget leaves no room for text (the prompt template alone fills it).
    """
    collection = len(docs) > 1
    every = [u for d in docs for u in units(d)]
    whole = _render(every, collection)
    if prompt_tokens(name, whole) <= budget:
        return [Segment(0, _spans(every), whole, name)]
    overhead = prompt_tokens(f"{name} (x.pdf p. 99999\u201399999)", "") + 16
    room = budget - overhead
    if room < 32:
        raise ValueError(f"a segment budget of {budget} tokens leaves no room for text")
    room = int(room * 0.97)  # units' counts are planned apart; their joins add a few tokens
    pieces = [p for u in every for p in _split_unit(u, count, room)]
    groups: list[list[Unit]] = []
    cur: list[Unit] = []
    used = 0
    for u in pieces:
        n = count(u.text) + 2
        heading = _HEADING.match(u.text) is not None
        if cur and (used + n > room or (heading and used > HEADING_CUT * room)):
            groups.append(cur)
            cur, used = [], 0
        cur.append(u)
        used += n
    if cur:
        groups.append(cur)
    out: list[Segment] = []
    queue = list(groups)
    while queue:
        g = queue.pop(0)
        spans = _spans(g)
        seg = Segment(len(out), spans, _render(g, collection), _title(name, spans, False))
        if prompt_tokens(seg.title, seg.text) > budget and len(g) > 1:
            half = len(g) // 2
            queue[:0] = [g[:half], g[half:]]
            continue
        out.append(seg)
    return out
