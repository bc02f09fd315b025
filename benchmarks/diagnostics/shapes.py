"""Random-weight mlx-lm models of real architectures' shapes, for speed and memory benchmarks.

Speed and memory depend on shapes, not weight values, so a random model of a real shape measures
them exactly (quality is measured on the shipped models only). Built in code, nothing downloaded.
"""

from __future__ import annotations

import mlx.core as mx

SHAPES = {
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        num_hidden_layers=28,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
}


def random_model(shape: str, dtype=mx.bfloat16, bits: int = 0, seed: int = 0, **overrides):
    """A random-weight mlx-lm model of `shape` in `dtype`; `bits` > 0 quantizes its linear layers
    (group 64) as mlx-community's 4-bit models are; `overrides` replace config entries (e.g.
    vocab_size). Returns (model, config)."""
    import importlib

    import mlx.nn as nn
    from mlx.utils import tree_map

    cfg = {**SHAPES[shape], "rms_norm_eps": 1e-5, **overrides}
    arch = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(cfg))
    model.update(tree_map(lambda p: (p * 0.02).astype(dtype) if p.ndim > 1 else p.astype(dtype), model.parameters()))
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    return model, cfg
