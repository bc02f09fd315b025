"""Resolve `--model` to an mlx-lm model directory and load it with the backend's dtype policy.

A model spec is one of: an mlx-lm model directory, a `.gguf` file (imported once into an mlx-lm
directory under the data dir: `gguf_import`), a Hugging Face repo id (downloaded by mlx-lm; needs
internet), or a packaged model (`packaged`): the default `qwen2.5-coder-1.5b`, the 135M demo
`smollm2`, `gemma3-270m`.
Any of them may end in `#rope=KIND:F`, KIND linear, ntk-by-parts or yarn (`with_rope_scale`): the same weights with
RoPE scaled by F to run past the trained context, as a model of its own (own id and hash, so its
caches never mix with the unscaled model's).

Dtype policy: on the CPU, quantized and half-precision matmuls are very slow, so weights are
dequantized to fp32; on GPU backends the quantized weights are kept as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from longctx import config
from longctx.errors import ConfigError, ModelError
from longctx.paths import subdir
from longctx.runtime import packaged
from longctx.runtime.gguf_import import file_sha256
from longctx.runtime.modeldir import write_model_dir
from longctx.runtime.packaged import on_cpu, stamped_sha256
from longctx.runtime import light
from longctx.runtime import distributed

DEFAULT_MODEL = packaged.QWEN.spec
DEMO_MODEL = packaged.SMOLLM2.spec
GEMMA_MODEL = packaged.GEMMA.spec
_LOADED: dict | None = None  # memo of `load` inside `reuse_loaded()`


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: where its mlx-lm directory is and how to identify it."""

    model_id: str
    path: Path
    weights_sha256: str
    tokenizer_sha256: str
    spec: str  # what resolves to this model again: "smollm2", a path, or a repo id


@dataclass
class LoadedModel:
    """A model ready to run: mlx-lm module, tokenizer wrapper and its facts."""

    ref: ModelRef
    model: object
    tokenizer: object
    config: dict
    context_length: int
    dtype: str
    extras: dict = field(default_factory=dict)


def _dir_sha256(path: Path) -> str:
    """sha256 over the weight files of an mlx-lm directory."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"No .safetensors weights in {path}; is it an mlx-lm model directory?")

    def compute() -> str:
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode() + b"\0" + bytes.fromhex(file_sha256(f)))
        return digest.hexdigest()

    return stamped_sha256(files, compute)


def _tokenizer_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja"):
        if (path / name).exists():
            digest.update(name.encode() + b"\0" + (path / name).read_bytes())
    return digest.hexdigest()


def _ref_for_dir(path: Path, spec: str, model_id: str | None = None) -> ModelRef:
    if not (path / "config.json").exists():
        raise ModelError(f"{path} has no config.json; pass an mlx-lm model directory.")
    meta_file = path / "longctx.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    sha = meta.get("weights_sha256") or _dir_sha256(path)
    return ModelRef(
        model_id=model_id or meta.get("model_id") or path.name,
        path=path,
        weights_sha256=sha,
        tokenizer_sha256=_tokenizer_sha256(path),
        spec=spec,
    )


# linear: position interpolation. yarn: mlx-lm's YaRN (NTK-by-parts frequencies and the attention
# temperature 0.1 ln F + 1 on queries and keys). ntk-by-parts: YaRN's frequencies without the
# temperature (on SmolLM2-135M the temperature alone turns a short chat answer into nonsense).
ROPE_TYPES = ("linear", "ntk-by-parts", "yarn")
_ROPE_TAG = "#rope="


def with_rope_scale(spec: str | None, factor: float, kind: str = "ntk-by-parts") -> str:
    """The model spec of `spec` (None: the default) with RoPE scaled by `factor` (`kind`: one of
    ROPE_TYPES)."""
    if kind not in ROPE_TYPES:
        raise ConfigError(f"Unknown RoPE scaling '{kind}'; choose one of: {', '.join(ROPE_TYPES)}.")
    if not 1.0 < factor <= 64.0:
        raise ConfigError(f"The RoPE scale must be above 1 and at most 64, not {factor:g}.")
    base = spec or config.get("model") or DEFAULT_MODEL
    return f"{base.split(_ROPE_TAG)[0]}{_ROPE_TAG}{kind}:{factor:g}"


def _rope_ref(base: ModelRef, spec: str, option: str) -> ModelRef:
    """A model directory sharing `base`'s files (symlinks) with RoPE scaling in its config."""
    kind, _, factor = option.partition(":")
    try:
        with_rope_scale(None, float(factor), kind)
        scale = float(factor)
    except ValueError:
        raise ConfigError(f"Cannot read '{_ROPE_TAG}{option}'; write e.g. {_ROPE_TAG}linear:2.") from None
    config = json.loads((base.path / "config.json").read_text())
    if config.get("rope_scaling") or "text_config" in config:
        raise ModelError(
            f"{base.model_id} already scales RoPE (or nests its config); longctx does not stack another scaling on it."
        )
    trained = int(config.get("max_position_embeddings") or 2048)
    mlx_kind = "linear" if kind == "linear" else "yarn"
    config["rope_scaling"] = {"type": mlx_kind, "rope_type": mlx_kind, "factor": scale}
    if mlx_kind == "yarn":
        config["rope_scaling"]["original_max_position_embeddings"] = trained
    if kind == "ntk-by-parts":
        config["rope_scaling"]["mscale"] = 0  # attention factor 1: no temperature
    config["max_position_embeddings"] = int(trained * scale)
    tag = f"{kind}x{scale:g}"
    sha = hashlib.sha256(f"{base.weights_sha256}|rope|{kind}|{scale!r}".encode()).hexdigest()
    meta = {
        "model_id": f"{base.model_id}+{tag}",
        "weights_sha256": sha,
        "base": str(base.path),
        "rope_scaling": {"kind": kind, **config["rope_scaling"]},
        "trained_context": trained,
    }
    out = subdir("models") / f"{base.path.name}-{tag}"
    if not (out / "longctx.json").exists() or json.loads((out / "longctx.json").read_text()) != meta:
        tmp = Path(tempfile.mkdtemp(prefix=".rope-", dir=out.parent))
        try:
            for f in base.path.iterdir():
                if f.name not in ("config.json", "longctx.json") and not f.name.startswith("."):
                    (tmp / f.name).symlink_to(f.resolve())
            (tmp / "config.json").write_text(json.dumps(config, indent=1))
            (tmp / "longctx.json").write_text(json.dumps(meta, indent=1))
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return _ref_for_dir(out, spec)


def rope_scaling(ref: ModelRef) -> dict | None:
    """The RoPE scaling a model directory was made with by `with_rope_scale` (None: none)."""
    try:
        return json.loads((ref.path / "longctx.json").read_text()).get("rope_scaling")
    except (OSError, ValueError):
        return None


def resolve(spec: str | None = None, progress=None) -> ModelRef:
    """Turn a `--model` value (or None for `$LONGCTX_MODEL` / the default) into a ModelRef.

    Args:
        spec: directory, .gguf file, Hugging Face repo id, or None; optionally ending in
            `#rope=KIND:F` (see `with_rope_scale`).
        progress: `progress(done, total)` for a first-time GGUF import.
    """
    spec = spec or config.get("model") or DEFAULT_MODEL
    if _ROPE_TAG in spec:
        base_spec, _, option = spec.partition(_ROPE_TAG)
        return _rope_ref(resolve(base_spec or None, progress), spec, option)
    if spec in packaged.PACKAGED:
        path, model_id = packaged.model_dir(spec, progress)
        return _ref_for_dir(path, spec, model_id)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        sha = stamped_sha256([path], lambda: file_sha256(path))
        return _ref_for_dir(packaged.import_once(path, path.stem, sha, progress), str(path.resolve()))
    if path.is_dir():
        return _ref_for_dir(path, str(path.resolve()))
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelError(f"Model '{spec}' is neither an mlx-lm directory, a .gguf file nor a Hugging Face id (owner/name).")
    try:
        from mlx_lm.utils import _download

        local = Path(_download(spec))
    except Exception as err:  # hub errors come in many types; all mean "cannot fetch"
        raise ModelError(f"Cannot download '{spec}' from Hugging Face: {err}") from err
    return _ref_for_dir(local, spec, spec)


def _cpu_variant_dir(ref: ModelRef) -> Path:
    safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in ref.model_id)
    return subdir("models") / f"{safe_id}-{ref.weights_sha256[:12]}-cpu-f32"


def _cpu_ready(ref: ModelRef) -> Path | None:
    """The model's fp32 directory if one exists: a GGUF imported on the CPU, or a built copy."""
    try:
        if json.loads((ref.path / "longctx.json").read_text()).get("dtype") == "float32":
            return ref.path
    except (OSError, ValueError):
        pass
    out = _cpu_variant_dir(ref)
    return out if (out / "model.safetensors").exists() else None


def _cpu_variant(ref: ModelRef) -> Path:
    """An fp32, dequantized copy of the model for the CPU, built once (loads in ~0.3 s after).

    `mx.dequantize` and half-to-float casts are slow on the CPU (~5 s for 135M parameters), and
    quantized or half matmuls are slower still, so the CPU path keeps its own fp32 directory.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, load_model

    ready = _cpu_ready(ref)
    if ready is not None:
        return ready
    out = _cpu_variant_dir(ref)
    model, config = load_model(ref.path, lazy=True)
    dequantize_model(model)
    weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tree_flatten(model.parameters())}
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    extras = tuple(
        f
        for f in ref.path.iterdir()
        if f.suffix in (".json", ".jinja", ".model", ".txt", ".tiktoken") and f.name != "config.json"
    )
    write_model_dir(out, weights, {"config.json": config}, extras)
    return out


@contextmanager
def reuse_loaded():
    """Within this block `load` returns the same LoadedModel for the same ModelRef (benchmarks
    that ingest and ask many times in one process load each model once)."""
    global _LOADED
    outer = _LOADED
    _LOADED = {} if outer is None else outer
    try:
        yield
    finally:
        _LOADED = outer


def tokenizer(ref: ModelRef):
    """The model's tokenizer (mlx-lm wrapper); inside `reuse_loaded()`, the loaded model's."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import load_config

    if _LOADED is not None and ref in _LOADED:
        return _LOADED[ref].tokenizer
    # The EOS ids mlx-lm's `load` gives the model's tokenizer (config / generation config).
    return load_tokenizer(ref.path, eos_token_ids=load_config(ref.path).get("eos_token_id"))


def load(ref: ModelRef) -> LoadedModel:
    """Load the model and tokenizer through mlx-lm, applying the backend's dtype policy."""
    if _LOADED is not None:
        if ref not in _LOADED:
            _LOADED[ref] = _load(ref)
        return _LOADED[ref]
    return _load(ref)


def load_light(ref: ModelRef) -> LoadedModel | None:
    """Load for answering without transformers (`runtime.light`): the mlx-lm model class and a
    `tokenizers` tokenizer (no chat template). None where that path does not apply (no built
    CPU copy yet, a config mlx-lm must load itself, no tokenizer.json); then use `load`."""
    if _LOADED is not None and ref in _LOADED:
        return _LOADED[ref]
    cpu = on_cpu()
    path = _cpu_ready(ref) if cpu else ref.path
    if path is None:
        return None
    if not (ref.path / "tokenizer.json").is_file():
        return None
    # The tokenizer builds (in Rust) on a second thread while the weights load.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(light.TextTokenizer.load, ref.path)
        try:
            loaded = light.load_model(path)
        except (OSError, ValueError, KeyError) as err:
            raise ModelError(f"Cannot load model from {path}: {err}") from err
        tokenizer = pending.result()
    if loaded is None or tokenizer is None:
        return None
    model, config = loaded
    if not cpu:
        _check_gpu_kernels(model)
    return _loaded(ref, model, tokenizer, config, cpu)


def _loaded(ref: ModelRef, model, tokenizer, config: dict, cpu: bool) -> LoadedModel:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    distributed.split(model, config)  # under mlx.launch: this rank's share (heads or layers)

    dtypes = {p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)}
    dtype = "float32" if cpu else ("bfloat16" if mx.bfloat16 in dtypes else "float16")
    text_cfg = config.get("text_config", config)
    ctx = int(text_cfg.get("max_position_embeddings") or getattr(tokenizer, "model_max_length", 0) or 2048)
    return LoadedModel(ref=ref, model=model, tokenizer=tokenizer, config=config, context_length=ctx, dtype=dtype)


def _check_gpu_kernels(model) -> None:
    """Run one token; if the backend lacks a quantized-matmul kernel for these weights (MLX's CUDA
    backend has none for some group sizes), dequantize to fp16 instead of failing mid-ingest."""
    import mlx.core as mx
    from mlx.utils import tree_map

    try:
        mx.eval(model(mx.array([[1]], dtype=mx.int32)))
    except RuntimeError as err:
        if "No implementation" not in str(err):
            raise
        from mlx_lm.utils import dequantize_model

        dequantize_model(model)
        model.update(tree_map(lambda p: p.astype(mx.float16) if p.dtype == mx.float32 else p, model.parameters()))
        mx.eval(model.parameters())


def _load(ref: ModelRef) -> LoadedModel:
    from mlx_lm.utils import load as mlx_load

    cpu = on_cpu()
    try:
        path = _cpu_variant(ref) if cpu else ref.path
        # under mlx.launch weights stay lazy until split: a rank reads only its share
        model, tokenizer, config = mlx_load(str(path), return_config=True, lazy=distributed.launched())
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"Cannot load model from {ref.path}: {err}") from err
    if not cpu:
        _check_gpu_kernels(model)
    return _loaded(ref, model, tokenizer, config, cpu)
