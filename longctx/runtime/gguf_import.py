"""Import a llama-architecture GGUF file into an mlx-lm model directory.

`mx.load` reads GGUF tensors of type F32/F16/Q4_0/Q4_1/Q8_0; the quantized ones come back in MLX's
affine layout (uint32 words + fp16 scales/biases, group size 32), so they are written unchanged and
mlx-lm rebuilds `QuantizedLinear`/`QuantizedEmbedding` layers from the `quantization` config.
llama.cpp permutes the q/k projection rows for interleaved ("GPT-J") rope, so the config sets
`rope_traditional: true` instead of un-permuting them. The tokenizer (byte-level BPE) and chat
template are rebuilt from the GGUF metadata with `tokenizers`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from longctx.errors import ModelError
from longctx.runtime.modeldir import write_model_dir

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_GROUP_SIZE = 32
# Token types in GGUF metadata (llama.cpp): 3 = control, 4 = user-defined.
_SPECIAL_TYPES = (3, 4)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if hasattr(value, "item"):
        return value.item()
    return value


def _mlx_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight | scales | biases
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise ModelError(f"Unsupported GGUF tensor '{gguf_name}' for the llama importer.")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if base not in _TOP_NAMES:
        raise ModelError(f"Unsupported GGUF tensor '{gguf_name}' for the llama importer.")
    return f"{_TOP_NAMES[base]}.{suffix}"


def _config(meta: dict, weights: dict) -> dict:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ModelError(
            f"GGUF architecture '{arch}' is not supported by the importer (only 'llama'); "
            "pass an mlx-lm model directory or a Hugging Face id with --model instead."
        )
    n_heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv", n_heads)),
        "head_dim": int(_scalar(meta, "llama.rope.dimension_count", hidden // n_heads)),
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(_scalar(meta, "llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id", 2)),
    }
    # Per-layer bit widths: Q4_x and Q8_0 may be mixed in one file.
    quant = {"group_size": GGUF_GROUP_SIZE, "bits": 4}
    for name, w in weights.items():
        if name.endswith(".scales"):
            base = name[: -len(".scales")]
            in_features = w.shape[-1] * GGUF_GROUP_SIZE
            bits = weights[base + ".weight"].shape[-1] * 32 // in_features
            if bits != 4:
                quant[base] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
    if any(n.endswith(".scales") for n in weights):
        config["quantization"] = quant
    return config


def _tokenizer_files(meta: dict) -> tuple[dict, dict]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if _scalar(meta, "tokenizer.ggml.model") != "gpt2":
        raise ModelError("Only byte-level BPE ('gpt2') GGUF tokenizers can be imported.")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else [1] * len(tokens)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok = Tokenizer(bpe)
    # llama.cpp's "smollm"/"starcoder" pre-tokenizer: single digits, then the GPT-2 regex.
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if _scalar(meta, "tokenizer.ggml.pre", "gpt2") in ("smollm", "starcoder", "refact"):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in _SPECIAL_TYPES]
    )

    def token(key: str):
        idx = _scalar(meta, key)
        return tokens[int(idx)] if idx is not None else None

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        tok_config["chat_template"] = str(meta["tokenizer.chat_template"])
    return json.loads(tok.to_str()), {k: v for k, v in tok_config.items() if v is not None}


def import_gguf(gguf_path: Path, out_dir: Path, model_id: str, progress=None) -> Path:
    """Convert `gguf_path` into an mlx-lm model directory at `out_dir` (atomically).

    Args:
        gguf_path: a llama-architecture GGUF with F32/F16/Q4_0/Q4_1/Q8_0 tensors.
        out_dir: destination; created by renaming a finished temp directory into place.
        model_id: the id recorded in `longctx.json` (e.g. "SmolLM2-135M-Instruct").
        progress: optional `progress(done, total)` over the import steps.

    Returns:
        `out_dir`.
    """
    import mlx.core as mx

    steps = 4
    report = progress or (lambda done, total: None)
    try:
        weights, meta = mx.load(str(gguf_path), return_metadata=True)
    except (RuntimeError, ValueError) as err:
        raise ModelError(f"Cannot read GGUF file {gguf_path}: {err}") from err
    report(1, steps)
    weights = {_mlx_name(k): v for k, v in weights.items()}
    config = _config(meta, weights)
    tokenizer_json, tokenizer_config = _tokenizer_files(meta)
    report(2, steps)
    sha = file_sha256(gguf_path)
    report(3, steps)
    write_model_dir(out_dir, weights, {
        "config.json": config,
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": tokenizer_config,
        "longctx.json": {"model_id": model_id, "source": str(gguf_path), "weights_sha256": sha},
    })
    report(4, steps)
    return out_dir
