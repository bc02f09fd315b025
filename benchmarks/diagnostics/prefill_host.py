"""Host time of a GPU prefill chunk's cache work, measured on any machine (the CPU included).

A compressed prefill chunk on a GPU is bound by the host's Python per layer (docs/performance.md,
`prefill_timeline.py`): the cache update and the dense attention build ~30 MLX operations and six
kernel launches per layer, where an fp16 cache builds two. This script times exactly that host
work, without a GPU: the GPU code paths run with a kernel executor whose launches return zeros
(no kernel runs, no array is evaluated inside the timed region; arrays freed by the update are
kept alive so that freeing large CPU buffers is not timed), over the layers of a model shape and
a few 512-token chunks. Rows, per layer-chunk, median of chunks 4..12 over three passes:

- fp16: mlx-lm's KVCache update plus `mx.fast.scaled_dot_product_attention` (the anchor);
- tq4 eager: `TurboQuantCache.update_and_fetch` + `compressed_attention`, `Paths.compile` "0";
- tq4 compiled: the same with the compiled fused-chunk update and dense attention (default).

What it leaves out: MLX's encoding of the launches at evaluation (a GPU cost of every path) and
the model's own layers. Usage:
    python benchmarks/diagnostics/prefill_host.py [--shapes smollm2-135m llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import device_kind, write  # noqa: E402  (imports longctx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402
from shapes import SHAPES  # noqa: E402

from longctx.kernels import _prelude  # noqa: E402
from longctx.kvcache.attention import compressed_attention  # noqa: E402
from longctx.kvcache.presets import get_preset  # noqa: E402
from longctx.kvcache.turbo import Paths, TurboQuantCache, drain  # noqa: E402

CHUNK, CHUNKS, PASSES, SKIP = 512, 12, 3, 3


def _zeros(spec, launch):
    return [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]


def _time(make, step, layers: int, hkv: int, hq: int, d: int) -> float:
    """Median µs per layer-chunk of `step(cache, keys, queries)` over chunks SKIP.. of PASSES."""
    keep, per = [], []
    keys = mx.zeros((1, hkv, CHUNK, d), dtype=mx.bfloat16) + 1
    queries = mx.zeros((1, hq, CHUNK, d), dtype=mx.bfloat16) + 1
    mx.eval(keys, queries)
    for _ in range(PASSES):
        caches = [make(i) for i in range(layers)]
        for c in range(CHUNKS):
            t = 0.0
            for cache in caches:
                keep.append(cache.state)
                t0 = time.perf_counter()
                keep.append(step(cache, keys, queries))
                t += time.perf_counter() - t0
            if c >= SKIP:
                per.append(t / layers)
            mx.eval([a for cache in caches for a in cache.state])
            drain()
        keep.clear()
    return 1e6 * statistics.median(per)


def _fp16(cache, keys, queries):
    k, v = cache.update_and_fetch(keys, keys)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=queries.shape[3] ** -0.5, mask="causal")


def _tq(cache, keys, queries):
    view, _ = cache.update_and_fetch(keys, keys)
    return compressed_attention(queries, view, queries.shape[3] ** -0.5, mask="causal")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-3.1-8b"])
    ap.add_argument("--preset", default="tq4")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    preset = get_preset(args.preset)
    rows = []
    for shape in args.shapes:
        cfg = SHAPES[shape]
        layers, d = cfg["num_hidden_layers"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        row = {
            "shape": shape,
            "layers": layers,
            "heads": [hq, hkv],
            "head_dim": d,
            "fp16_us": _time(lambda i: KVCache(), _fp16, layers, hkv, hq, d),
        }
        with _prelude.executor(_zeros, as_backend="cuda"):
            for label, setting in (("eager", "0"), ("compiled", "1")):
                paths = Paths(compile=setting, compile_under_executor=True)
                row[f"{args.preset}_{label}_us"] = _time(lambda i: TurboQuantCache(preset, i, paths), _tq, layers, hkv, hq, d)
        row["compiled_vs_eager"] = row[f"{args.preset}_eager_us"] / row[f"{args.preset}_compiled_us"]
        row["compiled_vs_fp16"] = row[f"{args.preset}_compiled_us"] / row["fp16_us"]
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
    path = write(
        args.name or f"prefill_host_{device_kind()}",
        {"chunk": CHUNK, "preset": args.preset, "method": __doc__.split("\n\n")[1], "rows": rows},
    )
    print(path)


if __name__ == "__main__":
    main()
