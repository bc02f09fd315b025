"""Import a GGUF file (llama.cpp, Ollama, LM Studio) into an mlx-lm model directory.

Architectures: llama (Llama-2/3, Mistral, SmolLM2), qwen2, qwen3, gemma2, gemma3 (text), phi3.
Tensors are read and dequantized with the `gguf` package (F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0
and the K-quants Q2_K...Q6_K), then written either as fp32 (the CPU, where quantized and half
matmuls are slow) or re-quantized into MLX's affine layout with the bits the GGUF type implies
(GPUs: `bits_for`). The tokenizer is rebuilt from the metadata (`gguf_tokenizer`).

What llama.cpp's converter changed, undone here:
- llama: q/k projection rows permuted for interleaved rope; un-permuted (`_unpermute`), so the
  model runs mlx-lm's default rope like the Hugging Face original.
- Gemma 2/3: RMSNorm weights stored as `1 + w` (mlx-lm's Gemma norms add the 1 back).
- Facts llama.cpp hard-codes rather than stores: Gemma-3's every 6th layer global with local rope
  base 10000, Gemma's query scale 1/sqrt(head_dim) (hidden/heads for the 27B models).
- Phi-3: fused `attn_qkv` / `ffn_up` (gate and up) map to mlx-lm's fused `qkv_proj` /
  `gate_up_proj`; long-context rope factors become `rope_scaling`.
- Llama-3.1: the `rope_freqs` tensor is the "llama3" rope scaling of mlx-lm, refitted.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

from longctx.errors import ModelError
from longctx.runtime.gguf_tokenizer import tokenizer_files
from longctx.runtime.modeldir import write_model_dir

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class Arch:
    """How one GGUF architecture maps onto an mlx-lm model type."""

    model_type: str
    unpermute_qk: bool = False  # llama.cpp permuted q/k rows (llama only)
    norm_plus_one: bool = False  # norms stored as 1 + w (Gemma)
    renames: dict = field(default_factory=dict)  # GGUF layer part -> mlx-lm name, where it differs


_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm"}
ARCHITECTURES = {
    "llama": Arch("llama", unpermute_qk=True),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3"),
    "gemma2": Arch("gemma2", norm_plus_one=True, renames=_GEMMA_NORMS),
    "gemma3": Arch("gemma3_text", norm_plus_one=True, renames=_GEMMA_NORMS),
    "phi3": Arch("phi3", renames={"ffn_up": "mlp.gate_up_proj"}),
}
# GGUF tensor type name -> MLX affine bits when kept quantized on a GPU (group size 64; 32 below 5 bits)
_BITS = {
    "Q2_K": 3,
    "Q3_K": 4,
    "Q4_0": 4,
    "Q4_1": 4,
    "Q4_K": 4,
    "Q5_0": 5,
    "Q5_1": 5,
    "Q5_K": 5,
    "Q6_K": 6,
    "Q8_0": 8,
    "Q8_1": 8,
    "Q8_K": 8,
}
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def bits_for(type_name: str) -> int | None:
    """MLX bits for a GGUF tensor type kept quantized (None: a float type, kept as floats)."""
    if type_name in _FLOAT_TYPES:
        return None
    if type_name not in _BITS:
        raise ModelError(
            f"GGUF tensor type {type_name} is not supported (known: {', '.join(list(_FLOAT_TYPES) + sorted(_BITS))})."
        )
    return _BITS[type_name]


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_gguf(path: Path):
    """(reader, metadata) of a GGUF file; metadata values as plain Python values."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError, IndexError) as err:
        raise ModelError(f"Cannot read GGUF file {path}: {err}") from err
    meta = {}
    for key, f in reader.fields.items():
        try:
            meta[key] = f.contents()
        except (ValueError, IndexError, TypeError):
            continue
    return reader, meta


def _mlx_name(gguf_name: str, arch: Arch) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        name = arch.renames.get(part) or _LAYER_NAMES.get(part)
        if name:
            return f"model.layers.{layer}.{name}.{suffix}"
    elif base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    elif base in ("rope_freqs", "rope_factors_long", "rope_factors_short"):
        return None  # folded into the config
    raise ModelError(f"GGUF tensor '{gguf_name}' is not known to the {arch.model_type} importer.")


def _unpermute(w, heads: int):
    """Undo llama.cpp's q/k row permutation (interleaved rope -> rotate-half)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope(freqs, theta: float, dims: int, context: int) -> dict:
    """mlx-lm's "llama3" rope scaling whose frequencies equal llama.cpp's `rope_freqs` factors."""
    import numpy as np

    factors = np.asarray(freqs, dtype=np.float64)
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    wavelen = 2 * math.pi * theta ** (np.arange(0, dims, 2) / dims)
    low, high = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    want = np.where(
        wavelen < high, 1.0, np.where(wavelen > low, scaling["factor"], 1.0 / ((1 - smooth) / scaling["factor"] + smooth))
    )
    if factors.shape != want.shape or not np.allclose(factors, want, rtol=1e-3):
        raise ModelError("This GGUF's rope_freqs do not match Llama-3's rope scaling; use an mlx-lm model directory instead.")
    return scaling


def _config(meta: dict, arch_name: str, tensors: dict, vocab: int) -> dict:
    arch = ARCHITECTURES[arch_name]
    p = arch_name + "."
    hidden = int(meta[p + "embedding_length"])
    heads = int(meta[p + "attention.head_count"])
    head_dim = int(meta.get(p + "attention.key_length") or hidden // heads)
    layers = int(meta[p + "block_count"])
    context = int(meta.get(p + "context_length") or 4096)
    theta = float(meta.get(p + "rope.freq_base", 10000.0))
    config = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": vocab,
        "rope_theta": theta,
        "max_position_embeddings": context,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
    }
    if arch_name == "llama" and "model.layers.0.self_attn.q_proj.bias" in tensors:
        config["attention_bias"] = True
    if "rope_freqs.weight" in tensors:
        rope_dims = int(meta.get(p + "rope.dimension_count") or head_dim)
        config["rope_scaling"] = _llama3_rope(tensors["rope_freqs.weight"], theta, rope_dims, context)
    if arch_name.startswith("gemma"):
        # llama.cpp: 1/sqrt(hidden/heads) for the 27B models, else 1/sqrt(head_dim)
        big = (arch_name == "gemma3" and layers == 62) or (arch_name == "gemma2" and layers == 46)
        config["query_pre_attn_scalar"] = hidden // heads if big else head_dim
    if arch_name == "gemma2":
        config["attn_logit_softcapping"] = float(meta.get(p + "attn_logit_softcapping", 50.0))
        config["final_logit_softcapping"] = float(meta.get(p + "final_logit_softcapping", 30.0))
    if arch_name == "gemma3":
        config.update(
            rope_local_base_freq=10000.0,
            sliding_window_pattern=6,
            sliding_window=int(meta.get(p + "attention.sliding_window", 512)),
        )
        kind, factor = meta.get(p + "rope.scaling.type"), meta.get(p + "rope.scaling.factor")
        if kind and kind != "none" and factor:
            config["rope_scaling"] = {"rope_type": str(kind), "factor": float(factor)}
    if arch_name == "phi3":
        rope_dims = int(meta.get(p + "rope.dimension_count") or head_dim)
        config["partial_rotary_factor"] = rope_dims / head_dim
        original = int(meta.get(p + "rope.scaling.original_context_length") or context)
        config["original_max_position_embeddings"] = original
        if "rope_factors_long.weight" in tensors:
            config["rope_scaling"] = {
                "type": "longrope",
                "long_factor": [float(x) for x in tensors["rope_factors_long.weight"]],
                "short_factor": [float(x) for x in tensors["rope_factors_short.weight"]],
            }
    return config


def _dequantized(t):
    import numpy as np
    from gguf.quants import dequantize

    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)


def import_gguf(
    gguf_path: Path, out_dir: Path, model_id: str, weights_sha256: str, quantized: bool = False, progress=None
) -> Path:
    """Convert `gguf_path` into an mlx-lm model directory at `out_dir` (atomically).

    Args:
        gguf_path: a GGUF of one of ARCHITECTURES with any tensor type `bits_for` knows.
        out_dir: destination; created by renaming a finished temp directory into place.
        model_id: the id recorded in `longctx.json`.
        weights_sha256: the GGUF's sha256, recorded as the model's weights hash.
        quantized: keep quantized tensors quantized (MLX affine, `bits_for`), float ones in
            bfloat16 (for GPUs); else every tensor in fp32 (for the CPU).
        progress: optional `progress(done, total)` over the tensors.

    Returns:
        `out_dir`.
    """
    import mlx.core as mx

    reader, meta = read_gguf(gguf_path)
    arch_name = str(meta.get("general.architecture"))
    if arch_name not in ARCHITECTURES:
        raise ModelError(
            f"GGUF architecture '{arch_name}' is not supported by the importer (known: "
            f"{', '.join(ARCHITECTURES)}); pass an mlx-lm model directory or a Hugging "
            "Face id with --model instead."
        )
    arch = ARCHITECTURES[arch_name]
    for t in reader.tensors:
        bits_for(t.tensor_type.name)  # refuse an unknown type before any work
    context = int(meta.get(f"{arch_name}.context_length") or 4096)
    tokenizer_json, tokenizer_config, eos = tokenizer_files(meta, context)
    heads = int(meta[f"{arch_name}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch_name}.attention.head_count_kv") or heads)
    report = progress or (lambda done, total: None)
    weights, extras, quant = {}, {}, {}
    total = len(reader.tensors)
    for n, t in enumerate(reader.tensors):
        name = _mlx_name(t.name, arch)
        w = _dequantized(t)
        if name is None:
            extras[t.name] = w
            continue
        if arch.unpermute_qk and ".self_attn.q_proj." in name:
            w = _unpermute(w, heads)
        elif arch.unpermute_qk and ".self_attn.k_proj." in name:
            w = _unpermute(w, kv_heads)
        if arch.norm_plus_one and name.endswith("norm.weight"):
            w = w - 1.0
        bits = bits_for(t.tensor_type.name) if quantized and w.ndim == 2 else None
        if bits is not None and w.shape[-1] % 64 == 0:
            group = 32 if bits < 5 else 64
            wq, scales, biases = mx.quantize(mx.array(w).astype(mx.bfloat16), group_size=group, bits=bits)
            base = name[: -len(".weight")]
            added = {name: wq, base + ".scales": scales, base + ".biases": biases}
            quant[base] = {"group_size": group, "bits": bits}
        else:
            added = {name: mx.array(w).astype(mx.bfloat16 if quantized else mx.float32)}
        mx.eval(list(added.values()))  # the numpy copy can go now
        weights.update(added)
        del w
        report(n + 1, total + 1)
    config = _config(meta, arch_name, {**weights, **extras}, len(tokenizer_json["model"]["vocab"]))
    config.update(eos_token_id=eos if len(eos) > 1 else eos[0])
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if quant:
        config["quantization"] = {"group_size": 64, "bits": 4, **quant}
    write_model_dir(
        out_dir,
        weights,
        {
            "config.json": config,
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": tokenizer_config,
            "longctx.json": {
                "model_id": model_id,
                "source": str(gguf_path),
                "weights_sha256": weights_sha256,
                "dtype": "quantized" if quantized else "float32",
            },
        },
    )
    report(total + 1, total + 1)
    return out_dir
