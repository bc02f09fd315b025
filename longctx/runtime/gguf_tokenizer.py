"""Rebuild a Hugging Face `tokenizers` tokenizer (tokenizer.json + tokenizer_config.json) from a
GGUF file's metadata, as llama.cpp's vocabulary code reads it.

Two vocabulary kinds:
- `gpt2`: byte-level BPE (Llama-3, Qwen2/3, SmolLM2, Phi-4, ...). Tokens and merges are stored;
  what is not stored is the pre-tokenizer, named by `tokenizer.ggml.pre`: each known name maps to
  the split regex llama.cpp uses for it (`llama-vocab.cpp`). An unknown name is refused: a wrong
  split would silently tokenize differently from the model's training.
- `llama`: SentencePiece BPE with byte fallback (Llama-2, Mistral, Gemma, Phi-3). GGUF keeps the
  pieces, their scores and types but no merges; merges are rebuilt from the scores (a piece's
  score is minus its merge rank), as `transformers`' SentencePiece extractor does; user-defined
  pieces are matched whole before BPE, as SentencePiece does.
"""

from __future__ import annotations

import json

from longctx.errors import ModelError

_SPIECE_SPACE = "\u2581"
# Token types as GGUF stores them (llama.cpp / SentencePiece).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> (split regex or None for GPT-2's own, digits one by one, NFC first)
PRE_TOKENIZERS = {
    "default": (None, False, False),
    "gpt-2": (None, False, False),
    "gpt2": (None, False, False),
    "phi-2": (None, False, False),
    "smollm": (None, True, False),
    "starcoder": (None, True, False),
    "refact": (None, True, False),
    "llama-bpe": (_LLAMA3, False, False),
    "llama3": (_LLAMA3, False, False),
    "smaug-bpe": (_LLAMA3, False, False),
    "falcon3": (_LLAMA3, False, False),
    "qwen2": (_QWEN2, False, True),
    "deepseek-r1-qwen": (_QWEN2, False, True),
    "gpt-4o": (_GPT4O, False, False),
}
# Pieces that end a chat turn, added to the model's EOS ids when the vocabulary has them.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "<|eom_id|>")


def _bpe_tokenizer(meta: dict, tokens: list[str], types: list[int]):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise ModelError(
            f"GGUF pre-tokenizer '{pre}' is not supported (known: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}); use an mlx-lm model directory instead."
        )
    regex, digits, nfc = PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=regex is _LLAMA3)
    )  # llama.cpp: Llama-3 only
    if nfc:
        tok.normalizer = normalizers.NFC()
    if regex is None:
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if digits:
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    else:
        steps = [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok, False


def _merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by SentencePiece scores: for each normal piece (best score first), every
    split into two normal pieces, ordered as `transformers`' SentencePieceExtractor orders them."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    found = []
    for piece, i in vocab.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((-float(scores[i]), i, n, lr) for n, lr in enumerate(local))
    found.sort(key=lambda x: x[:3])
    return [lr for *_, lr in found]


def _spm_tokenizer(meta: dict, tokens: list[str], types: list[int]):
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
    unk = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    bpe = BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=_merges(tokens, scores, types),
        unk_token=tokens[unk],
        byte_fallback=True,
        fuse_unk=True,
    )
    tok = Tokenizer(bpe)
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPIECE_SPACE), normalizers.Replace(" ", _SPIECE_SPACE)])
    else:
        tok.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    # User-defined pieces (as llama.cpp wrote them, spaces and all) match whole in the raw text.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    return tok, True


def tokenizer_files(meta: dict, context_length: int) -> tuple[dict, dict, list[int]]:
    """(tokenizer.json, tokenizer_config.json, EOS ids) for a GGUF's vocabulary.

    Args:
        meta: the GGUF metadata, arrays included (`tokenizer.ggml.tokens`, `token_type`,
            `merges` or `scores`), as plain Python values.
        context_length: the model's trained context, recorded as `model_max_length`.
    """
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)]
    if kind == "gpt2":
        tok, spm = _bpe_tokenizer(meta, tokens, types)
    elif kind == "llama":
        tok, spm = _spm_tokenizer(meta, tokens, types)
    else:
        raise ModelError(
            f"GGUF tokenizer '{kind}' is not supported (only byte-level BPE 'gpt2' "
            "and SentencePiece 'llama'); use an mlx-lm model directory instead."
        )
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    special = [
        i for i, k in enumerate(types) if k == CONTROL or (not spm and k == USER_DEFINED) or (unk is not None and i == int(unk))
    ]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", spm)) and bos is not None
    if add_bos:
        name = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{name} $A", pair=f"{name} $A $B", special_tokens=[(name, int(bos))]
        )

    def name(key: str):
        idx = meta.get(key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = str(meta["tokenizer.chat_template"])
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    index = {t: i for i, t in enumerate(tokens)}
    eos += [index[t] for t in END_OF_TURN if t in index and types[index[t]] == CONTROL]
    eos = list(dict.fromkeys(eos))
    return json.loads(tok.to_str()), {k: v for k, v in config.items() if v is not None}, eos
