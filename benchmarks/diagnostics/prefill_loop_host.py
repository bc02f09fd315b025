"""Host time of the layer-major prefill loop (`longctx.prefill_layers`), measured on any machine.

A short GPU prefill is bound by the host that builds its graphs (docs/performance.md: SmolLM2's
shape at 8k tokens, ~0.14 s on an H100). This script times that loop's graph building alone: the
GPU code paths run with kernels that return zeros (`decode_host._zeros`) and nothing is evaluated
(`mx.async_eval` / `mx.eval` are no-ops inside the timed region), over a random-weight model of a
real shape. Rows: the loop as it runs (the first layer's pass records each layer's arguments,
later passes call the layers directly: `prefill_layers.RECORD`) against every pass going through
the model's call; passes alternate, median reported.

Usage: python benchmarks/diagnostics/prefill_loop_host.py [--shapes smollm2-135m] [--tokens 8192]
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
from shapes import random_model  # noqa: E402

from longctx import kvcache, prefill_layers  # noqa: E402
from longctx.kernels import _prelude  # noqa: E402

CHUNK = 512


def once(model, tokens: list[int], record: bool) -> float:
    from decode_host import _zeros

    bounds = [(lo, min(lo + CHUNK, len(tokens))) for lo in range(0, len(tokens), CHUNK)]
    saved = (mx.async_eval, mx.eval, prefill_layers.RECORD)
    with _prelude.executor(_zeros, as_backend="cuda"):
        cache = kvcache.make(model, kvcache.get_preset("tq4"))
        mx.async_eval = mx.eval = lambda *a, **k: None
        prefill_layers.RECORD = record
        gc.disable()
        try:
            t = time.perf_counter()
            prefill_layers.prefill(model, tokens, cache, bounds)
            return time.perf_counter() - t
        finally:
            mx.async_eval, mx.eval, prefill_layers.RECORD = saved
            gc.enable()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        model, _ = random_model(shape, dtype=mx.float32)
        for n in args.tokens:
            tokens = list(range(1, n + 1))
            runs = {True: [], False: []}
            for p in range(args.passes + 1):
                for record in (True, False):
                    s = once(model, tokens, record)
                    if p:  # the first pass of each: warm-up
                        runs[record].append(s)
            rec, per_call = statistics.median(runs[True]), statistics.median(runs[False])
            rows.append(
                {
                    "shape": shape,
                    "tokens": n,
                    "recorded_s": rec,
                    "model_calls_s": per_call,
                    "recorded_runs": runs[True],
                    "model_calls_runs": runs[False],
                    "ratio": rec / per_call,
                }
            )
            print(
                f"{shape:>14} {n:>6}: recorded {rec * 1e3:.1f} ms, every pass through the "
                f"model's call {per_call * 1e3:.1f} ms ({rec / per_call:.2f}x)",
                flush=True,
            )
    write(args.name or f"prefill_loop_host_{device_kind()}", {"chunk": CHUNK, "rows": rows})


if __name__ == "__main__":
    main()
