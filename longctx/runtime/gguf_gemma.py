"""Import a Gemma-3 (text) GGUF file into an mlx-lm `gemma3_text` model directory.

llama.cpp stores Gemma-3 as K-quants (Q4_K, Q6_K) and Q5_0/Q8_0, which `mx.load` cannot read, so
tensors are dequantized with the `gguf` package (`pip install gguf`) and written as bfloat16 (the
model's training dtype; the CPU path of `runtime.models` makes its own fp32 copy).

What the GGUF conversion changed, undone here:
- RMSNorm weights: Gemma computes `x * (1 + w)` and llama.cpp's converter stores `w + 1`, so 1 is
  subtracted from every `*norm.weight` (mlx-lm's `gemma3_text.RMSNorm` adds it back).
- No q/k row permutation for Gemma (NEOX-style rope): mlx-lm's default non-traditional rope.
- Facts llama.cpp hard-codes for `gemma3` rather than storing: every 6th layer is global, local
  (sliding) layers use rope base 10000, and queries are scaled by 1/sqrt(head_dim)
  (1/sqrt(hidden/heads) for the 27B model).
- Tokenizer: GGUF keeps SentencePiece pieces, scores and types (no merges). Gemma's model is
  SentencePiece BPE with byte fallback, so merges are rebuilt from the scores (a piece's score is
  minus its merge rank) the way `transformers`' SentencePiece extractor does; user-defined pieces
  (runs of spaces, newlines, tabs, HTML tags) are matched whole before BPE, as SentencePiece does,
  and llama.cpp wrote their '▁' as plain spaces.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from longctx.errors import ModelError
from longctx.runtime.modeldir import write_model_dir

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SLIDING_WINDOW_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for gemma3
LOCAL_ROPE_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3
_SPIECE_SPACE = "\u2581"
# SentencePiece piece types as GGUF stores them.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# GGUF metadata value types: struct formats of the scalars; 8 = string, 9 = array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def architecture(path: Path) -> str | None:
    """`general.architecture` of a GGUF file, read from its header alone (no tensors, no deps)."""
    with open(path, "rb") as f:
        def read(fmt: str):
            size = struct.calcsize("<" + fmt)
            data = f.read(size)
            if len(data) != size:
                raise EOFError
            return struct.unpack("<" + fmt, data)[0]

        def string() -> bytes:
            return f.read(read("Q"))

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(read("Q"), 1)
            elif kind == 9:
                inner, count = read("I"), read("Q")
                for _ in range(count):
                    skip(inner)
            elif kind in _GGUF_SCALARS:
                f.seek(struct.calcsize("<" + _GGUF_SCALARS[kind]), 1)
            else:
                raise ValueError(kind)

        try:
            if f.read(4) != b"GGUF":
                return None
            read("I")  # version
            read("Q")  # tensor count
            for _ in range(read("Q")):
                key, kind = string(), read("I")
                if key == b"general.architecture" and kind == 8:
                    return string().decode("utf-8", "replace")
                skip(kind)
        except (EOFError, ValueError, struct.error):
            return None
    return None


def _reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise ModelError("Importing a Gemma-3 GGUF needs the `gguf` package: "
                         "pip install 'longctx[gemma]' (or pip install gguf).") from None
    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError) as err:
        raise ModelError(f"Cannot read GGUF file {path}: {err}") from err


def _fields(reader) -> dict:
    """Scalar metadata (arrays of tokens/scores/types are read separately)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[1] in ("tokens", "scores", "token_type", "merges"):
            continue
        try:
            out[key] = field.contents()
        except (ValueError, IndexError, TypeError):
            continue
    return out


def _mlx_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    elif base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ModelError(f"Unsupported GGUF tensor '{gguf_name}' for the Gemma-3 importer.")


def _config(meta: dict, has_lm_head: bool) -> dict:
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise ModelError(f"GGUF architecture '{arch}' is not Gemma-3.")
    p = "gemma3."
    hidden = int(meta[p + "embedding_length"])
    heads = int(meta[p + "attention.head_count"])
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    layers = int(meta[p + "block_count"])
    config = {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": 0,  # filled from the tokenizer
        "rope_theta": float(meta.get(p + "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": LOCAL_ROPE_BASE,
        # llama.cpp: 1/sqrt(hidden/heads) for the 27B model (62 layers), else 1/sqrt(head_dim).
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "sliding_window": int(meta.get(p + "attention.sliding_window", 512)),
        "sliding_window_pattern": SLIDING_WINDOW_PATTERN,
        "max_position_embeddings": int(meta.get(p + "context_length", 32768)),
        "tie_word_embeddings": not has_lm_head,
    }
    kind = meta.get(p + "rope.scaling.type")
    factor = meta.get(p + "rope.scaling.factor")
    if kind and kind != "none" and factor:
        config["rope_scaling"] = {"rope_type": str(kind), "factor": float(factor)}
    return config


def _merges(tokens: list[str], scores, types) -> list[tuple[str, str]]:
    """BPE merges implied by SentencePiece scores: for each normal piece (best score first), every
    split into two normal pieces, ordered as `transformers`' SentencePieceExtractor orders them."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    found = []
    for piece, i in vocab.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((-float(scores[i]), i, n, lr) for n, lr in enumerate(local))
    found.sort(key=lambda x: x[:3])
    return [lr for *_, lr in found]


def _token_strings(reader) -> tuple[list[str], list[float], list[int]]:
    f = reader.fields
    tokens = [str(t) for t in f["tokenizer.ggml.tokens"].contents()]
    scores = [float(s) for s in f["tokenizer.ggml.scores"].contents()]
    types = [int(t) for t in f["tokenizer.ggml.token_type"].contents()]
    return tokens, scores, types


def _tokenizer_files(reader, meta: dict) -> tuple[dict, dict, int]:
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    if meta.get("tokenizer.ggml.model") != "llama":
        raise ModelError("The Gemma-3 importer expects a SentencePiece ('llama') GGUF tokenizer.")
    tokens, scores, types = _token_strings(reader)
    unk = int(meta.get("tokenizer.ggml.unknown_token_id", 3))
    bpe = BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_merges(tokens, scores, types),
              unk_token=tokens[unk], byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPIECE_SPACE),
                                               normalizers.Replace(" ", _SPIECE_SPACE)])
    else:
        tok.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    # User-defined pieces (kept as llama.cpp wrote them, spaces and all) are matched whole in the
    # raw text; control pieces are special. Both resolve to their ids in the BPE vocab.
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for i, (t, k) in enumerate(zip(tokens, types)) if k == CONTROL or i == unk])
    bos_id = int(meta.get("tokenizer.ggml.bos_token_id", 2))
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos_id]} $A", pair=f"{tokens[bos_id]} $A $B",
            special_tokens=[(tokens[bos_id], bos_id)])
    tok_json = json.loads(tok.to_str())

    def name(key: str):
        idx = meta.get(key)
        return tokens[int(idx)] if idx is not None else None

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": tokens[unk],
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("gemma3.context_length", 32768)),
    }
    if "tokenizer.chat_template" in meta:
        tok_config["chat_template"] = str(meta["tokenizer.chat_template"])
    return tok_json, {k: v for k, v in tok_config.items() if v is not None}, len(tokens)


def _weights(reader, progress, steps: int) -> dict:
    import mlx.core as mx
    import numpy as np
    from gguf.quants import dequantize

    weights = {}
    total = len(reader.tensors)
    for n, t in enumerate(reader.tensors):
        name = _mlx_name(t.name)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stored 1 + w
        weights[name] = mx.array(w).astype(mx.bfloat16)
        mx.eval(weights[name])
        progress(1 + (steps - 3) * (n + 1) // total, steps)
    return weights


def import_gemma3(gguf_path: Path, out_dir: Path, model_id: str, weights_sha256: str,
                  progress=None) -> Path:
    """Convert a Gemma-3 text GGUF into an mlx-lm `gemma3_text` directory at `out_dir` (atomically,
    safe against a concurrent import of the same file).

    Args:
        gguf_path: the GGUF file (any tensor types the `gguf` package can dequantize).
        out_dir: destination; created by renaming a finished temp directory into place.
        model_id: recorded in `longctx.json`.
        weights_sha256: the GGUF's sha256, recorded as the model's weights hash.
        progress: optional `progress(done, total)` over the import steps.

    Returns:
        `out_dir`.
    """
    steps = 20
    report = progress or (lambda done, total: None)
    reader = _reader(gguf_path)
    meta = _fields(reader)
    report(1, steps)
    has_head = any(t.name == "output.weight" for t in reader.tensors)
    config = _config(meta, has_head)
    weights = _weights(reader, report, steps)
    tokenizer_json, tokenizer_config, vocab = _tokenizer_files(reader, meta)
    config["vocab_size"] = vocab
    eos = [int(meta.get("tokenizer.ggml.eos_token_id", 1))]
    if "<end_of_turn>" in tokenizer_json["model"]["vocab"]:
        eos.append(tokenizer_json["model"]["vocab"]["<end_of_turn>"])
    config.update(bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 2)), eos_token_id=eos,
                  pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id", 0)))
    report(steps - 1, steps)
    write_model_dir(out_dir, weights, {
        "config.json": config,
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": tokenizer_config,
        "longctx.json": {"model_id": model_id, "source": str(gguf_path), "weights_sha256": weights_sha256},
    })
    report(steps, steps)
    return out_dir
