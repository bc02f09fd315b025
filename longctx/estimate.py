"""What an ingest will cost, told before the work: cache file size, peak memory, whether it fits.

The file size is exact up to the header's offset digits: the arrays a cache of T tokens holds follow
from the preset and the model's per-layer head dims, KV heads and windows (`store.layout.expected`,
the same function that checks files on restore), and the header is laid out as `store.format`
writes it. The model's shapes come from its mlx-lm class built without loading weights (MLX
allocates parameters lazily, so nothing of the model's size is materialized).

Peak memory is an estimate: weights as they are held (fp32 on the CPU), plus the cache being
built (the preset's bits per channel, plus the exact window), plus a chunk's working set: on the
CPU the attention scores (chunk x query heads x tokens, fp32), on a GPU what the layers queued
ahead of it hold (`peak_bytes`). Against the measured peaks (tests/test_multidoc.py) it is within
25% on the CPU (benchmarks/results/prefill_cpu.json); on a GPU it is close for 8B shapes and
over-estimates small models, whose queued work the GPU keeps up with (prefill_h200.json,
product_path_h200.json at 128k), and the tests allow it never more than 20% under. The same holds
for the layer-major GPU prefill's (`layer_major_transient`) with its in-flight bound (the
comparison row by row: docs/performance.md, "The estimate").
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

from longctx import kvcache
from longctx.chunking import (
    ACTIVATIONS,
    FUSED_SDPA_DIMS,
    GROUP_TOKENS,
    INFLIGHT,
    LAYER_CALL_TOKENS,
    LAYER_INFLIGHT,
    ORDER,
    chunk_at,
)
from longctx.kvcache.presets import Preset, bits_per_channel
from longctx.store import format as fmt
from longctx.store import layout
from longctx.units import human_bytes
from longctx.runtime.models import on_cpu
from longctx.errors import ResourceError


@dataclass(frozen=True)
class Shapes:
    """A model's facts that shape its cache and its prefill."""

    head_dims: list[int]
    kv_heads: list[int]
    windows: list[int]
    q_heads: int
    hidden: int
    intermediate: int
    parameters: int  # parameter count of the unquantized architecture


def shapes(config: dict) -> Shapes:
    """The cache-relevant shapes of the model `config` describes (no weights are read)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import _get_classes

    cfg = {k: v for k, v in config.items() if k != "quantization"}
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))  # lazy: nothing is allocated
    text = config.get("text_config", config)
    heads = kvcache.kv_heads(model)
    n_kv = int(text.get("num_key_value_heads") or text["num_attention_heads"])
    params = sum(p.size for _, p in tree_flatten(model.parameters()))
    return Shapes(
        head_dims=kvcache.head_dims(model),
        kv_heads=[h or n_kv for h in heads],
        windows=kvcache.windows(make_prompt_cache(model)),
        q_heads=int(text["num_attention_heads"]),
        hidden=int(text["hidden_size"]),
        intermediate=int(text.get("intermediate_size") or 4 * text["hidden_size"]),
        parameters=int(params),
    )


def cache_file_bytes(s: Shapes, preset: Preset, tokens: int, metadata: dict[str, str], float_dtype: str = "F16") -> int:
    """Bytes of the cache file of `tokens` tokens (`metadata` as `session.build_entry` writes it,
    without kv_config, which is filled in here)."""
    windows = {"windows": s.windows} if any(s.windows) else {}
    kv_config = {**preset.to_json(), "head_dims": s.head_dims, "kv_heads": s.kv_heads, **windows}
    meta = {**metadata, "tokens": str(tokens), "kv_config": json.dumps(kv_config), "format_version": fmt.FORMAT_VERSION}
    specs = {}
    for name, (dtypes, shape) in layout.expected(meta).items():
        specs[name] = (float_dtype if float_dtype in dtypes else dtypes[0], shape)
    return fmt.predicted_size(specs, {k: v for k, v in meta.items() if k != "format_version"})


def peak_bytes(
    s: Shapes,
    preset: Preset,
    tokens: int,
    weights_bytes: int,
    cpu: bool,
    chunk: int,
    *,
    pairs: int = 0,
    order: str = ORDER,
    inflight: int = INFLIGHT,
    layer_inflight: int = LAYER_INFLIGHT,
    group_tokens: int = GROUP_TOKENS,
    layer_call_tokens: int = LAYER_CALL_TOKENS,
) -> int:
    """Estimated peak memory of prefilling `tokens` tokens with `chunk`-token passes (the keyword
    arguments: `engine.prefill`'s, with which the prefill runs).

    Weights, the cache being built and one chunk's working set. The working set depends on the
    backend:
    - CPU: attention scores are materialized (chunk x query heads x tokens, fp32).
    - GPU (Metal, CUDA): the fused SDPA keeps no scores at the usual head dims. Instead a
      chunk's graph runs ahead of the GPU, and MLX keeps what each layer's operations read until
      their command buffer completes. For the fp16 cache that is mlx-lm's reallocation of every
      layer's buffer (about one more cache, as measured on a GPU). For a compressed cache it is
      the dequantized rows of the layers in flight, which `inflight` bounds, plus the
      layer being run; or, filled layer by layer (`layer_major`), `layer_major_transient`.
    """
    elem = 4 if cpu else 2  # the CPU computes in fp32
    dims = s.head_dims
    fp16_token = sum(2 * h * d for h, d in zip(s.kv_heads, dims)) * elem
    window_token = sum(2 * h * d for h, d, w in zip(s.kv_heads, dims, s.windows) if w) * elem
    if preset.kind == "fp16":
        cache = fp16_token * tokens
    else:
        full = fp16_token - window_token
        cache = full * tokens * bits_per_channel(preset, dims[0], tokens) / (8 * elem)
        cache += window_token * min(tokens, max(s.windows or [0]))
        cache += full * (preset.window + chunk) if preset.kind == "turbo" else 0
    last = min(chunk_at(max(0, tokens - chunk), chunk, pairs), tokens)  # the chunks shrink at length
    activations = last * (8 * s.hidden + 4 * s.intermediate) * 4
    scores = s.q_heads * last * tokens * 4
    if cpu:
        return int(weights_bytes + cache + scores + activations)
    if layer_major(s, preset, order):
        unfused = any(d not in FUSED_SDPA_DIMS for d in dims)
        transient = layer_major_transient(
            s,
            tokens,
            chunk,
            fp16_token,
            scores if unfused else 0,
            layer_inflight=layer_inflight,
            group_tokens=group_tokens,
            layer_call_tokens=layer_call_tokens,
        )
    elif any(d not in FUSED_SDPA_DIMS for d in dims):
        transient = scores
    elif preset.kind == "fp16":
        transient = fp16_token * tokens
    else:  # the dequantized fp16 rows of every layer are fp16_token x tokens in all
        rows = fp16_token * tokens
        transient = min(inflight or rows, rows) + rows / max(1, len(dims))
    return int(weights_bytes + cache + transient + activations)


def layer_major(s: Shapes, preset: Preset, order: str = ORDER) -> bool:
    """Whether a GPU prefill of an empty cache runs layer by layer (`prefill_layers.applies`:
    every layer compressed, i.e. none sliding, and the prefill's `order`)."""
    return preset.kind == "turbo" and not any(s.windows) and order != "token"


def layer_major_transient(
    s: Shapes,
    tokens: int,
    chunk: int,
    fp16_token: int,
    scores: float = 0,
    *,
    layer_inflight: int = LAYER_INFLIGHT,
    group_tokens: int = GROUP_TOKENS,
    layer_call_tokens: int = LAYER_CALL_TOKENS,
) -> float:
    """A layer-major prefill's working set on a GPU (`longctx.prefill_layers`): the hidden states
    of two layers (the one read, the one written), one layer's staging keys and values, and the
    queued layer-chunks (`chunk_bytes` each: the staging buffer it reads and its activations)
    plus one (a layer-chunk: one call, a run of chunks with `layer_call_tokens`). The
    host waits only once `layer_inflight` bytes are queued, and a group (up to
    `group_tokens`, or half the bound) is queued before the oldest is waited for: so up
    to the bound plus a group is in flight, whatever the group size (a measured peak did not
    change with the group size: docs/performance.md), at most the whole prompt's
    layer-chunks; with no bound, two groups' worth (as measured before the bound). `scores`: a
    chunk's materialized attention scores (head dims the GPUs' SDPA does not fuse), which
    every queued chunk holds."""
    elem = 2
    hidden = 2 * tokens * s.hidden * elem
    layers = max(1, len(s.head_dims))
    staging = fp16_token * tokens / layers
    runs = layer_call_tokens  # a call's tokens: runs of whole chunks
    call = max(chunk, runs // max(1, chunk) * chunk) if runs else chunk
    per_chunk = staging + (ACTIVATIONS * chunk * s.hidden * elem + scores) * call / max(1, chunk)
    group = max(1, group_tokens // max(1, call)) * per_chunk
    budget = layer_inflight
    if budget:
        everything = layers * -(-tokens // max(1, call)) * per_chunk
        queued = min(everything, budget + min(budget / 2, group))
    else:
        queued = 2 * group
    return hidden + staging + queued + per_chunk


def weights_bytes(path, s: Shapes, cpu: bool) -> int:
    """Bytes the loaded weights take: the files' size on a GPU, fp32 of every parameter on the
    CPU (where longctx runs a dequantized fp32 copy)."""
    if cpu:
        return 4 * s.parameters
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def machine_memory() -> int:
    """Physical memory of this machine in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class MemoryWarning(UserWarning):
    """An ingest's estimated peak memory is close to the machine's."""


WARN_FRACTION = 0.75  # warn when the estimate exceeds this share of the machine's memory


def verdict(peak: int, memory: int) -> str:
    """ "fits", "tight" (over WARN_FRACTION of memory) or "too large" (over all of it)."""
    if not memory:
        return "fits"
    if peak > memory:
        return "too large"
    return "tight" if peak > WARN_FRACTION * memory else "fits"


def describe(peak: int, memory: int) -> str:
    return f"it needs about {human_bytes(peak)} of memory at its peak and this machine has {human_bytes(memory)}"


def for_ingest(ref, preset: Preset, token_counts: list[int], name: str, chunk: int) -> dict:
    """Predicted file bytes (per segment and total), peak memory and the verdict for ingesting
    prompts of `token_counts` tokens (one per cache) with model `ref`."""
    from mlx_lm.utils import load_config

    config = load_config(ref.path)
    s = shapes(config)
    cpu = on_cpu()
    meta = {
        "model_id": ref.model_id,
        "weights_sha256": ref.weights_sha256,
        "tokenizer_sha256": ref.tokenizer_sha256,
        "document_sha256": "0" * 64,
        "document_name": name,
    }
    floats = "F32" if cpu else "F16"  # affine scales and biases are in the compute dtype
    files = [cache_file_bytes(s, preset, n, meta, floats) for n in token_counts]
    weights = weights_bytes(ref.path, s, cpu)
    peak = max(peak_bytes(s, preset, n, weights, cpu, chunk) for n in token_counts)
    memory = machine_memory()
    return {
        "cache_bytes": sum(files),
        "segment_cache_bytes": files,
        "peak_memory_bytes": peak,
        "machine_memory_bytes": memory,
        "memory": verdict(peak, memory),
    }


def check(ref, preset: Preset, token_counts: list[int], name: str, chunk: int) -> None:
    """Refuse (`ResourceError`) an ingest whose estimated peak exceeds this machine's memory;
    warn when it comes close."""
    try:
        est = for_ingest(ref, preset, token_counts, name, chunk)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        return  # a model whose shapes the estimate cannot read: ingest's own checks speak
    if est["memory"] == "too large":
        raise ResourceError(
            f"'{name}' cannot be ingested here: {describe(est['peak_memory_bytes'], est['machine_memory_bytes'])}; "
            "use a smaller model, a compressed --kv preset, or a machine with more memory."
        )
    if est["memory"] == "tight":
        warnings.warn(
            f"'{name}' may not fit: {describe(est['peak_memory_bytes'], est['machine_memory_bytes'])}.",
            MemoryWarning,
            stacklevel=2,
        )
