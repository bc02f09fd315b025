"""Shared fixtures: an isolated data dir for every test and a tiny random-weight llama model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import os

import longctx  # noqa: F401  (loads OpenBLAS before mlx)

# The 135M demo for every test and the processes they start (module-scoped fixtures included):
# the default model (1.5B) is for the product and its benchmarks, not CI.
os.environ["LONGCTX_MODEL"] = "smollm2"

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(autouse=True)
def longctx_home(tmp_path, monkeypatch):
    home = tmp_path / "longctx-home"
    monkeypatch.setenv("LONGCTX_HOME", str(home))
    # The 135M demo: the default model (1.5B) is for the product and its benchmarks, not CI.
    monkeypatch.setenv("LONGCTX_MODEL", "smollm2")
    return home


def _byte_tokenizer() -> tuple[dict, dict]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    return json.loads(tok.to_str()), config


def make_tiny_model(
    path: Path,
    seed: int = 0,
    context: int = 4096,
    n_kv_heads: int = 2,
    head_dim: int = 32,
    layers: int = 2,
    model_type: str = "llama",
    attn_gain: float = 1.0,
    embed_std: float = 0.5,
    **extra,
) -> Path:
    """Write a random-weight mlx-lm directory (default: a GQA llama) with a byte-level tokenizer;
    `extra` adds or overrides config entries of other architectures (tests/families.py).

    `attn_gain` scales every linear projection of the attention modules: scores grow by its
    square (where no QK norm renormalizes them) and outputs by its square, so attention is peaked
    instead of the near-uniform average of a default init, and what a layer reads from the cache
    shows in the model's outputs. `embed_std`: the embeddings' standard deviation."""
    import importlib

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_lm.utils import MODEL_REMAPPING

    arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    tok_json, tok_config = _byte_tokenizer()
    vocab = len(tok_json["model"]["vocab"])
    config = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": context,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        **extra,
    }
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # Larger-than-default embeddings make the random model's greedy choices well separated.
    embed = next(m for _, m in model.named_modules() if isinstance(m, nn.Embedding))
    embed.weight = mx.random.normal(embed.weight.shape) * embed_std
    if attn_gain != 1.0:
        from longctx.kvcache.support import attention_module

        for layer in model.layers:
            for _, m in attention_module(layer).named_modules():
                if isinstance(m, nn.Linear):
                    m.weight = m.weight * attn_gain
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(json.dumps(tok_json))
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_model_other(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-b", seed=1)


@pytest.fixture
def text_doc(tmp_path) -> Path:
    doc = tmp_path / "facts.txt"
    doc.write_text("The lighthouse keeper is Ada Quill.\nThe island has 412 sheep.\n" * 6)
    return doc
