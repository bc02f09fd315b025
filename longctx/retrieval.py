"""Choosing the segments of a long document (or collection) that hold a question's answer.

Two rankers:
- `bm25`: lexical, over each segment's text (bm25s, numpy only; English stopwords, a light
  plural/verb suffix folding so "licenses" finds "license"). Instant, needs no model.
- `model`: the model itself reranks BM25's best few (`RERANK` by default; all when there are
  fewer): each candidate's cache is restored and the question is run over it; candidates are
  ordered by the mean log-probability the model gives the question's own tokens after that
  segment (query likelihood: a segment that holds the answer makes the question less surprising,
  even when the question's words do not appear in it). It costs one restore and one
  question-length prefill per candidate.
- `attention`: the same candidates, ordered by attention mass: the question is run over each
  candidate's cache and, in every compressed layer, its queries are scored against the
  segment's (decoded) keys; the share of the question's attention that lands on the segment's
  text (not the prompt template, nor the question itself), for the head where it is largest,
  averaged over the question's tokens and the layers. A segment that answers the question draws
  the attention of the heads that look for it.

`cite` names the page (or file) of a segment that best matches a question and its answer.
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Sequence

RANKERS = ("bm25", "model", "attention")
RERANK = 4
_WORD = re.compile(r"[A-Za-z0-9]+(?:['\u2019][A-Za-z]+)?")
_PAGE = re.compile(r"^\[Page (\d+)\]$", re.MULTILINE)
_FILE = re.compile(r"^\[File (.+)\]$", re.MULTILINE)


def _fold(word: str) -> str:
    """A light stemmer: lower case, then plural, -ing/-ed and final -e folded off, so that
    "licenses", "license" and "licensed" meet (numbers and words of 4 letters or fewer stay)."""
    w = word.lower()
    if w.isdigit() or len(w) <= 4:
        return w
    if w.endswith(("ies", "ied")):
        w = w[:-3] + "y"
    elif w.endswith("sses"):
        w = w[:-2]
    elif w.endswith("s") and not w.endswith("ss"):
        w = w[:-1]
    for suf in ("ing", "ed"):
        if w.endswith(suf) and len(w) - len(suf) >= 4:
            w = w[: -len(suf)]
            break
    return w[:-1] if w.endswith("e") and len(w) > 4 else w


def words(text: str) -> list[str]:
    """BM25 terms of `text`: folded words without English stopwords."""
    stop = _stopwords()
    return [_fold(w) for w in _WORD.findall(text) if w.lower() not in stop]


@functools.lru_cache(maxsize=1)
def _stopwords() -> frozenset:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def bm25_scores(query: str, texts: Sequence[str]) -> list[float]:
    """BM25 score of each text for `query` (higher is better)."""
    import bm25s

    corpus = [words(t) or ["\u2205"] for t in texts]
    vocab = {w: i for i, w in enumerate(sorted({w for doc in corpus for w in doc}))}
    tokenized = bm25s.tokenization.Tokenized(ids=[[vocab[w] for w in doc] for doc in corpus], vocab=vocab)
    retriever = bm25s.BM25()
    retriever.index(tokenized, show_progress=False)
    terms = [w for w in words(query) if w in vocab]
    if not terms:
        return [0.0] * len(texts)
    return [float(s) for s in retriever.get_scores(terms)]


def rank_bm25(query: str, texts: Sequence[str]) -> list[int]:
    """Indices of `texts`, best first (ties keep document order)."""
    scores = bm25_scores(query, texts)
    return sorted(range(len(texts)), key=lambda i: (-scores[i], i))


def rank(
    query: str,
    texts: Sequence[str],
    ranker: str = "bm25",
    model_score: Callable[[int], float] | None = None,
    rerank: int = RERANK,
) -> list[int]:
    """Segment indices, best first.

    Args:
        query: the question.
        texts: each segment's text.
        ranker: "bm25" or "model".
        model_score: for "model": the model's score of segment i (higher is better).
        rerank: how many of BM25's best the model reranks.
    """
    order = rank_bm25(query, texts)
    if ranker == "bm25" or len(texts) == 1:
        return order
    if ranker not in ("model", "attention") or model_score is None:
        raise ValueError(f"unknown ranker {ranker!r}")
    head = order[: max(1, rerank)]
    scored = {i: model_score(i) for i in head}
    return sorted(head, key=lambda i: (-scored[i], head.index(i))) + order[len(head) :]


def pages(text: str) -> list[tuple[str, str, str]]:
    """A segment's text cut at its `[File …]` and `[Page N]` lines: (file, page, text) pieces
    (file "" when the segment is of one document; page "" for text files)."""
    marks = sorted(
        [(m.start(), m.end(), "file", m.group(1)) for m in _FILE.finditer(text)]
        + [(m.start(), m.end(), "page", m.group(1)) for m in _PAGE.finditer(text)]
    )
    out, file, page, pos = [], "", "", 0
    for start, end, what, value in marks + [(len(text), len(text), "end", "")]:
        body = text[pos:start]
        if body.strip():
            out.append((file, page, body))
        if what == "file":
            file, page = value, ""
        elif what == "page":
            page = value
        pos = end
    return out or [("", "", text)]


def cite(segment_text: str, query: str, default_file: str) -> str:
    """The file and page of the part of a segment that best matches `query` (question + answer),
    e.g. "report.pdf p. 12" or "notes.md"."""
    parts = pages(segment_text)
    if len(parts) == 1:
        best = 0
    else:
        scores = bm25_scores(query, [p[2] for p in parts])
        best = max(range(len(parts)), key=lambda i: (scores[i], -i))
    file, page, _ = parts[best]
    file = file or default_file
    return f"{file} p. {page}" if page else file
