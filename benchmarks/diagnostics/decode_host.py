"""Host time of a GPU decode step's cache work and attention, measured on any machine.

An answer token on a GPU is bound by the host (docs/performance.md, `answer_shapes.py`): per
layer, the compressed cache's update and its decode step's Python and launch calls against an
fp16 cache's slice update and one SDPA call. This script times exactly that host work, without a
GPU: the GPU code paths (backend reported as CUDA) with kernels that return zeros (no kernel
runs, nothing is evaluated inside the timed region; each launch's stand-in is one node over its
inputs, `mx.depends`, like the kernel it stands in for),
over the layers of a model shape, for decode steps after a restored and forked prefix and a
16-token question, as `ask` runs them. Rows, per layer and token, median over steps 5.. of each
pass, passes of the variants interleaved:

- fp16: mlx-lm's KVCache update plus `mx.fast.scaled_dot_product_attention` (the anchor);
- tq4: `TurboQuantCache.update_and_fetch` + `compressed_attention` (the compiled two-launch
  step, replayed through the layer's kept plan);
- tq4 no plan: the same with the plan's replay disabled (every step chooses its path and builds
  its trace key: the previous round's host path, with this round's cache update).

What it leaves out: MLX's encoding of the launches at evaluation and the model's own layers.
Usage:
    python benchmarks/diagnostics/decode_host.py [--shapes smollm2-135m llama-3.1-8b] [--prefix 2048]
"""

from __future__ import annotations

import argparse
import gc
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
from longctx.kvcache import attend_step  # noqa: E402
from longctx.kvcache.attention import compressed_attention  # noqa: E402
from longctx.kvcache.presets import get_preset  # noqa: E402
from longctx.kvcache.turbo import Paths, TurboQuantCache  # noqa: E402

STEPS, SKIP, PASSES, QUESTION = 60, 5, 5, 16


def _zeros(spec, launch):
    """A launch's stand-in: zeros of its outputs' shapes, as one node over its inputs (MLX's
    `depends`: n inputs, m outputs, like the kernel's node)."""
    zeros = [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]
    return mx.depends(zeros, list(launch.inputs))


def _steps(caches, step, hkv: int, hq: int, d: int) -> list[float]:
    """µs per layer of each of STEPS decode steps through `caches` (outputs kept, unevaluated)."""
    k = mx.ones((1, hkv, 1, d), dtype=mx.bfloat16)
    q = mx.ones((1, hq, 1, d), dtype=mx.bfloat16)
    mx.eval(k, q)
    keep, per = [], []
    gc.disable()
    try:
        for _ in range(STEPS):
            t0 = time.perf_counter()
            for cache in caches:
                keep.append(step(cache, k, q))
            per.append(1e6 * (time.perf_counter() - t0) / len(caches))
    finally:
        gc.enable()
    return per[SKIP:]


def _fp16(cache, k, q):
    keys, values = cache.update_and_fetch(k, k)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=q.shape[3] ** -0.5, mask=None)


def _tq(cache, k, q):
    view, _ = cache.update_and_fetch(k, k)
    return compressed_attention(q, view, q.shape[3] ** -0.5)


def _fp16_caches(layers, hkv, d, prefix):
    caches = [KVCache() for _ in range(layers)]
    kv = mx.ones((1, hkv, prefix + QUESTION, d), dtype=mx.bfloat16)
    for c in caches:
        c.update_and_fetch(kv, kv)
    mx.eval([c.state for c in caches])
    return caches


UNDER_EXECUTOR = Paths(compile_under_executor=True)


def _tq_caches(preset, layers, hkv, d, prefix):
    kv = mx.random.normal((1, hkv, prefix, d)).astype(mx.bfloat16)
    question = mx.random.normal((1, hkv, QUESTION, d)).astype(mx.bfloat16)
    caches = []
    for i in range(layers):
        c = TurboQuantCache(preset, i)
        c.update_and_fetch(kv, kv)
        c.seal()
        # compiled under the zero-output executor too (`Paths.compile_under_executor`)
        fork = TurboQuantCache.from_arrays(preset, i, c.arrays(), d, UNDER_EXECUTOR).fork(exact_new=1024)
        fork.update_and_fetch(question, question)
        caches.append(fork)
    mx.eval([c.state for c in caches])
    return caches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-3.1-8b"])
    ap.add_argument("--preset", default="tq4")
    ap.add_argument("--prefix", type=int, default=2048, help="cached tokens before the question")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    preset = get_preset(args.preset)
    rows = []
    replay = attend_step.replay
    for shape in args.shapes:
        cfg = SHAPES[shape]
        layers = cfg["num_hidden_layers"]
        d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        times = {"fp16": [], args.preset: [], f"{args.preset}_no_plan": []}
        with _prelude.executor(_zeros, as_backend="cuda"):
            for _ in range(PASSES):
                times["fp16"] += _steps(_fp16_caches(layers, hkv, d, args.prefix), _fp16, hkv, hq, d)
                for label, fn in ((args.preset, replay), (f"{args.preset}_no_plan", lambda *a: None)):
                    attend_step.replay = fn
                    try:
                        times[label] += _steps(_tq_caches(preset, layers, hkv, d, args.prefix), _tq, hkv, hq, d)
                    finally:
                        attend_step.replay = replay
        row = {
            "shape": shape,
            "layers": layers,
            "heads": [hq, hkv],
            "head_dim": d,
            **{f"{k}_us": statistics.median(v) for k, v in times.items()},
        }
        row["vs_fp16"] = row[f"{args.preset}_us"] / row["fp16_us"]
        row["no_plan_vs_fp16"] = row[f"{args.preset}_no_plan_us"] / row["fp16_us"]
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
    path = write(
        args.name or f"decode_host_{device_kind()}",
        {"preset": args.preset, "prefix": args.prefix, "question": QUESTION, "method": __doc__.split("\n\n")[1], "rows": rows},
    )
    print(path)


if __name__ == "__main__":
    main()
