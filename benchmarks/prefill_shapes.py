"""GPU prefill of random-weight models of real shapes: fp16 cache vs compressed, side by side.

For each shape (benchmarks/diagnostics/shapes.py) and length: `engine.prefill` into the fp16
cache and into each compressed preset, tokens/s and MLX peak memory, plus the longest single
evaluation (one chunk; the Metal watchdog kills command buffers that run too long). `--blocked` also times the
compressed preset with the dense GPU prefill path switched off (the blocked MLX path: what ran
before `kvcache.dense_gpu`); `--sync-ab` with no bound on the layers a chunk keeps in flight
(`prefill_inflight` 0, as before the bound: every layer queued at once) and with a wait at every
layer (a 1-byte budget), both token-major; `--orders token` the token-major loop beside the default
(layer-major on a GPU, `longctx.prefill_layers`); `--inflight 512` the layer-major prefill with
that many MiB queued at most (`prefill_layer_inflight`).

Usage: python benchmarks/prefill_shapes.py [--shapes smollm2-135m llama-3.1-8b] [--tokens 8192 32768]
       [--kv fp16 tq4] [--bits 0] [--blocked] [--sync-ab] [--queue-every 4 8]
       [--group-tokens 16384] [--orders token] [--inflight 512] [--layer-calls 2048 0:1024]
       [--fp16-chunks 2048] [--host-profile] [--repeat 3] [--name prefill_gpu]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write  # noqa: E402  (imports longctx first)

import mlx.core as mx  # noqa: E402
from diagnostics.shapes import random_model  # noqa: E402  (the random-weight models of real shapes)

from longctx import chunking, engine, kvcache  # noqa: E402
from longctx.kvcache import turbo  # noqa: E402


class _Timed:
    """The model, with the host seconds spent inside its calls counted (graph building; a
    layer-major prefill's calls end in its stand-in's exception, counted too)."""

    def __init__(self, model):
        self.model, self.seconds = model, 0.0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.model(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


def prefill_once(model, ids, preset, chunk, settings: dict | None = None):
    """(seconds, peak bytes, longest evaluation s, host s inside the model calls) of one
    `engine.prefill` (which fills an empty compressed cache layer by layer on a GPU, its
    `order`), under a row's `settings` (`prefill_<name>`: `engine.prefill`'s argument <name>;
    `dense_gpu`: the caches' `turbo.Paths.dense_gpu`)."""
    settings = dict(settings or {})
    paths = turbo.Paths(dense_gpu=settings.pop("dense_gpu", turbo.DEFAULT_PATHS.dense_gpu))
    args = {k.removeprefix("prefill_"): v for k, v in settings.items()}
    cache = kvcache.make(model, preset, paths)
    timed = _Timed(model)
    mx.synchronize()
    stats = engine.prefill(timed, ids, cache, chunk=chunk, **{"pairs": 0, **args})
    del cache
    gc.collect()
    mx.clear_cache()
    return stats.seconds, stats.peak_bytes, stats.max_eval_seconds, timed.seconds


def split_chunk(settings: dict, default: int) -> tuple[int, dict]:
    """A row's prefill chunk (its `chunk`, not a setting: `engine.prefill`'s argument; else
    `default`) and its other settings (`prefill_once`)."""
    return (settings.get("chunk", default), {k: v for k, v in settings.items() if k != "chunk"})


def host_profile(model, ids, preset, chunk, label, settings) -> None:
    """Print the cProfile of one more (steady) prefill: the host's time by function."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    prefill_once(model, ids, preset, chunk, settings)
    prof.disable()
    print(f"--- host profile: {label}, {len(ids)} tokens")
    pstats.Stats(prof).sort_stats("tottime").print_stats(35)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-3.1-8b"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--kv", nargs="+", default=["fp16", "tq4"])
    ap.add_argument("--bits", type=int, default=0, help="quantize the weights (0: bf16)")
    ap.add_argument("--chunk", type=int, default=engine.DEFAULT_CHUNK)
    ap.add_argument("--blocked", action="store_true")
    ap.add_argument(
        "--sync-ab",
        action="store_true",
        help="also each compressed preset with no bound on the layers in flight "
        "(prefill_inflight 0) and with a wait at every layer (1 byte)",
    )
    ap.add_argument(
        "--queue-every",
        type=int,
        nargs="*",
        default=[],
        help="also each compressed preset queueing its graph every k layers (prefill_queue_every k), e.g. 4 8 30",
    )
    ap.add_argument(
        "--group-tokens",
        type=int,
        nargs="*",
        default=[],
        help="also each compressed preset, layer-major, queueing every g tokens of "
        "a layer (prefill_group_tokens), e.g. 2048 16384",
    )
    ap.add_argument(
        "--orders",
        nargs="*",
        default=[],
        choices=["layer", "token"],
        help="also each compressed preset in this prefill order (prefill_order)",
    )
    ap.add_argument(
        "--inflight",
        type=int,
        nargs="*",
        default=[],
        help="also the layer-major prefill at these prefill_layer_inflight MiB, e.g. 512",
    )
    ap.add_argument(
        "--layer-calls",
        nargs="*",
        default=[],
        help="also the layer-major prefill calling each layer on runs of chunks of "
        "up to these many tokens (prefill_layer_call_tokens), e.g. 2048 4096; "
        "T:M also bounds what is queued at M MiB (prefill_layer_inflight), e.g. "
        "2048:256",
    )
    ap.add_argument(
        "--fp16-chunks",
        type=int,
        nargs="*",
        default=[],
        help="also the fp16 prefill in chunks of these many tokens (an anchor: mlx-lm's own prefill step is 2048), e.g. 2048",
    )
    ap.add_argument(
        "--once",
        action="store_true",
        help="run the layer-major A/B rows (--group-tokens, --inflight) once each (the "
        "--kv rows before them have met every chunk's shapes: their one run is "
        "steady; first_run_* then repeat it)",
    )
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="also one more prefill per compressed preset under cProfile (printed: "
        "where the host's time goes, evaluation included)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="steady runs per variant after its first, in alternating rounds (the median is reported)",
    )
    ap.add_argument("--name", default="prefill_gpu")
    args = ap.parse_args()

    rows = []
    print(f"{'shape':>14} {'kv':>12} {'tokens':>7} {'s':>7} {'tok/s':>8} {'peak GiB':>9} {'max eval s':>10}")
    for shape in args.shapes:
        model, _ = random_model(shape, bits=args.bits)
        weights = mx.get_active_memory()
        for n in args.tokens:
            ids = mx.random.randint(0, 32000, (n,)).tolist()
            prefill_once(model, ids[:1024], kvcache.get_preset("fp16"), args.chunk)  # warm-up
            # (label, settings): the default, then the A/B rows asked for
            variants = [(kv, {}) for kv in args.kv]
            # the fp16 prefill in longer chunks (`chunk`, not a setting: engine.prefill's argument)
            variants += [(f"fp16:chunk{c}", {"chunk": c}) for c in args.fp16_chunks]
            compressed = [kv for kv in args.kv if kv != "fp16"]
            if args.blocked:
                variants += [(kv + ":blocked", {"dense_gpu": False, "prefill_order": "token"}) for kv in compressed]
            if args.sync_ab:
                variants += [
                    (kv + suffix, {"prefill_inflight": budget, "prefill_order": "token"})
                    for kv in compressed
                    for suffix, budget in ((":unbounded", 0), (":everylayer", 1), (":4gib", 4 * 2**30))
                ]
            # token-major, queueing the graph every k layers (`prefill_queue_every`)
            variants += [
                (f"{kv}:queue{k}", {"prefill_queue_every": k, "prefill_order": "token"})
                for kv in compressed
                for k in args.queue_every
            ]
            # a layer-major prefill queueing every g tokens of a layer (`prefill_group_tokens`)
            variants += [(f"{kv}:group{g}", {"prefill_group_tokens": g}) for kv in compressed for g in args.group_tokens]
            # the other prefill order (`prefill_order`; the default on a GPU is layer)
            variants += [(f"{kv}:{order}", {"prefill_order": order}) for kv in compressed for order in args.orders]
            variants += [(f"{kv}:inflight{m}", {"prefill_layer_inflight": m * 2**20}) for kv in compressed for m in args.inflight]
            # layer-major calls over runs of chunks (`prefill_layer_call_tokens`)
            for spec in args.layer_calls:
                t, _, m = spec.partition(":")
                settings = {"prefill_layer_call_tokens": int(t)}
                if m:
                    settings["prefill_layer_inflight"] = int(m) * 2**20
                variants += [(f"{kv}:calls{t}" + (f"/inflight{m}" if m else ""), dict(settings)) for kv in compressed]
            # every variant's first run (it meets every chunk's shapes for the first time: MLX
            # kernels, cuDNN graphs keyed by shape and strides, as one ingest does), then
            # --repeat rounds over the variants in turn (alternating, so drift in the machine's
            # state falls on all of them alike); the steady rate is the median round
            first, steady = {}, {label: [] for label, _ in variants}
            presets = {label: kvcache.get_preset(label.split(":")[0]) for label, _ in variants}

            def once(label, settings):
                chunk, settings = split_chunk(settings, args.chunk)
                return prefill_once(model, ids, presets[label], chunk, settings)  # noqa: F821 (the loop's model, deleted after it)

            for label, settings in variants:
                first[label] = once(label, settings)
            for _ in range(args.repeat):
                for label, settings in variants:
                    # --once: the layer-major A/B rows, whose shapes the default rows have met
                    if args.once and label.split(":")[-1].startswith(("group", "inflight")):
                        continue
                    steady[label].append(once(label, settings))
            for label, settings in variants:
                s0, peak0, longest0, _ = first[label]
                runs = steady[label] or [first[label]]
                s = statistics.median(r[0] for r in runs)
                peak = max(r[1] for r in runs)
                longest = max(r[2] for r in runs)
                rows.append(
                    {
                        "shape": shape,
                        "kv": label,
                        "settings": settings,
                        "runs": len(steady[label]),
                        "tokens": n,
                        "seconds": s,
                        "runs_seconds": [r[0] for r in runs],
                        "tokens_per_second": n / s,
                        "peak_bytes": peak,
                        "weights_bytes": weights,
                        "longest_eval_seconds": longest,
                        "first_run_seconds": s0,
                        "first_run_tokens_per_second": n / s0,
                        "first_run_peak_bytes": peak0,
                        "first_run_longest_eval_seconds": longest0,
                    }
                )
                print(
                    f"{shape:>14} {label:>16} {n:>7} {s:>7.3f} {n / s:>8.0f} "
                    f"{peak / 2**30:>9.2f} {longest:>10.3f}  first run {s0:.2f} s, runs " + " ".join(f"{r[0]:.3f}" for r in runs),
                    flush=True,
                )
                if args.host_profile:
                    chunk, rest = split_chunk(settings, args.chunk)
                    host_profile(model, ids, presets[label], chunk, label, rest)
        del model
        gc.collect()
        mx.clear_cache()
    ratios = {}
    for r in rows:
        base = next(b for b in rows if b["shape"] == r["shape"] and b["tokens"] == r["tokens"] and b["kv"] == "fp16")
        ratios[f"{r['shape']} {r['kv']} {r['tokens']}"] = {
            "speed_vs_fp16": round(r["tokens_per_second"] / base["tokens_per_second"], 3),
            "first_run_speed_vs_fp16": round(r["first_run_tokens_per_second"] / base["first_run_tokens_per_second"], 3),
            "peak_vs_fp16": round(r["peak_bytes"] / base["peak_bytes"], 3),
        }
    for k, v in ratios.items():
        print(
            f"{k:>40}: {v['speed_vs_fp16']:.2f}x speed (first run "
            f"{v['first_run_speed_vs_fp16']:.2f}x), {v['peak_vs_fp16']:.2f}x peak"
        )
    # the prefill settings the default rows ran under (a row's `settings` override them)
    defaults = {
        "prefill_order": chunking.ORDER,
        "prefill_inflight": chunking.INFLIGHT,
        "prefill_layer_inflight": chunking.LAYER_INFLIGHT,
        "prefill_group_tokens": chunking.GROUP_TOKENS,
        "prefill_layer_call_tokens": chunking.LAYER_CALL_TOKENS,
        "prefill_queue_every": chunking.QUEUE_EVERY,
        "prefill_pairs": 0,
    }
    out = write(
        args.name,
        {
            "chunk": args.chunk,
            "weights_bits": args.bits or 16,
            "repeat": args.repeat,
            "defaults": defaults,
            "rows": rows,
            "ratios": ratios,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
