"""Answering after a long cached prefix on a GPU: fp16 cache vs tq4, random-weight models of real
shapes (benchmarks/diagnostics/shapes.py), side by side in one run.

For each weight format (bf16, 4-bit) and prefix length N: prefill N tokens (ingest's chunked
prefill; time and peak memory), then as `ask` does: fp16 answers from its cache as is; tq4 seals
the cache, rebuilds it from its arrays (what a restore from disk yields) and forks it. Then a
16-token question and 256 greedy answer tokens (ask's default): time to the first answer token
(the first question also pays first-use compilation: reported apart, as the difference to a
second, warm question) and decode tokens/s over the answer: the median of three warm answers
(all three are in the JSON).

Usage: python benchmarks/answer_shapes.py [--shape llama-3.1-8b] [--tokens 32768 131072]
       [--bits 0 4] [--variants tq4:portable] [--variants-at 32768 131072] [--host-profile]
       [--name answer_gpu]
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

from longctx import engine, kvcache  # noqa: E402

QUESTION, ANSWER = 16, 256  # ask's default answer length (--max-tokens)
REPEATS = 3  # warm answers per row, each on its own fork: the median rate is reported


def answer(model, cache, question, n):
    """(seconds to the first token, decode tokens/s after it)."""
    t0 = time.perf_counter()
    stream = engine.token_stream(model, question, cache, n)
    next(stream)
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    count = sum(1 for _ in stream)
    return first, count / (time.perf_counter() - t1)


def host_profile(model, cache, question, label, n) -> None:
    """Print where the host's time goes over one warm answer (cProfile, top 25 by own time)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    answer(model, cache, question, ANSWER)
    prof.disable()
    print(f"-- host profile: {label}, {n} cached tokens, {ANSWER} answer tokens", flush=True)
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)


def run(model, ids, label, rng, profile=False):
    """One row; `label` is a preset, or `tq4:nocompile` / `tq4:blocked` / `tq4:portable` (the
    fused decode path without mx.compile / the blocked MLX path instead of the fused kernel / the
    portable decode-attend kernel, the one Metal runs, instead of the tensor-core one: where time
    goes)."""
    from longctx.kvcache.turbo import Paths

    preset_name, _, variant = label.partition(":")
    # the caches' GPU paths for the whole row
    paths = {"nocompile": Paths(compile="0"), "blocked": Paths(fused_max_lq=0), "portable": Paths(tensor_cores=False)}.get(
        variant
    )
    return _run(model, ids, preset_name, rng, profile, paths) | {"kv": label}


def prefilled(model, ids, preset_name, paths=None):
    """(cache, prefill stats) after `ids`, as `ask` holds it: fp16 as prefilled; compressed
    presets sealed and rebuilt from their arrays (what a restore from disk yields)."""
    preset = kvcache.get_preset(preset_name)
    cache = kvcache.make(model, preset, paths)
    stats = engine.prefill(model, ids, cache)
    if preset.kind != "fp16":
        kvcache.seal(cache)
        arrays = kvcache.to_arrays(cache, preset)
        mx.eval(arrays)
        del cache
        cache = kvcache.from_arrays(arrays, model, preset, mx.bfloat16, paths)
        del arrays
    gc.collect()
    return cache, stats


def _run(model, ids, preset_name, rng, profile=False, paths=None):
    """`profile`: also cProfile one more warm answer (`host_profile`)."""
    cache, stats = prefilled(model, ids, preset_name, paths)
    stored = sum(c.nbytes for c in cache)
    out = {
        "kv": preset_name,
        "tokens": len(ids),
        "prefill_seconds": stats.seconds,
        "prefill_tok_s": stats.tokens_per_second,
        "prefill_peak_bytes": stats.peak_bytes,
        "cache_bytes": stored,
    }
    q1, *warm = [rng.randint(0, 32000, (QUESTION,)).tolist() for _ in range(1 + REPEATS)]
    mx.reset_peak_memory()
    first, _ = answer(model, kvcache.fork(cache), q1, 2)  # first use: traces, kernel builds
    # warm answers, each on its own fork: the median rate (one answer's rate moves with the host)
    runs = [answer(model, kvcache.fork(cache), q, ANSWER) for q in warm]
    warm_first = statistics.median(r[0] for r in runs)
    if profile:
        host_profile(model, kvcache.fork(cache), warm[0], preset_name, len(ids))
    tok_s = statistics.median(r[1] for r in runs)
    out.update(
        {
            "first_token_first_use_s": first,
            "first_token_warm_s": warm_first,
            "first_use_compile_s": max(0.0, first - warm_first),
            "decode_tok_s": tok_s,
            "decode_tok_s_runs": [r[1] for r in runs],
            "answer_peak_bytes": mx.get_peak_memory(),
        }
    )
    del cache
    gc.collect()
    mx.clear_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--bits", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--kv", nargs="+", default=["fp16", "tq4"])
    ap.add_argument("--variants", nargs="*", default=[], help="extra tq4 rows: tq4:nocompile tq4:blocked tq4:portable")
    ap.add_argument(
        "--variants-at", type=int, nargs="*", default=None, help="the lengths the --variants rows run at (default: the shortest)"
    )
    ap.add_argument(
        "--host-profile", action="store_true", help="cProfile one more warm answer per row and print its top functions"
    )
    ap.add_argument("--name", default="answer_gpu")
    args = ap.parse_args()
    rows = []
    for bits in args.bits:
        model, _ = random_model(args.shape, bits=bits)
        # warm-up: MLX's kernels build on first use (~50 s on a fresh machine), outside the rows
        for kv in ("fp16", "tq4"):
            _run(model, mx.random.randint(0, 32000, (1024,)).tolist(), kv, mx.random)
        for n in args.tokens:
            ids = mx.random.randint(0, 32000, (n,)).tolist()
            at = args.variants_at if args.variants_at is not None else [min(args.tokens)]
            for kv in args.kv + (args.variants if n in at else []):
                r = {
                    "shape": args.shape,
                    "weights": f"{bits}-bit" if bits else "bf16",
                    **run(model, ids, kv, mx.random, args.host_profile),
                }
                rows.append(r)
                print(
                    f"{r['weights']:>6} {kv:>5} N={n:>6}: prefill {r['prefill_tok_s']:7.0f} tok/s "
                    f"peak {r['prefill_peak_bytes'] / 2**30:6.2f} GiB | first token "
                    f"{r['first_token_warm_s']:.3f} s (first use +{r['first_use_compile_s']:.2f} s)"
                    f" | decode {r['decode_tok_s']:6.1f} tok/s | cache "
                    f"{r['cache_bytes'] / 2**30:.2f} GiB",
                    flush=True,
                )
        del model
        gc.collect()
        mx.clear_cache()
    ratios = {}
    for r in rows:
        if r["kv"] == "fp16":
            continue
        b = next((x for x in rows if x["kv"] == "fp16" and x["tokens"] == r["tokens"] and x["weights"] == r["weights"]), None)
        if b is None:  # no fp16 row to compare with (--kv without fp16)
            continue
        ratios[f"{r['weights']} {r['kv']} {r['tokens']}"] = {
            "decode_vs_fp16": round(r["decode_tok_s"] / b["decode_tok_s"], 3),
            "prefill_vs_fp16": round(r["prefill_tok_s"] / b["prefill_tok_s"], 3),
            "prefill_peak_vs_fp16": round(r["prefill_peak_bytes"] / b["prefill_peak_bytes"], 3),
            "first_token_vs_fp16": round(r["first_token_warm_s"] / b["first_token_warm_s"], 3),
        }
    for k, v in ratios.items():
        print(f"{k}: {v}")
    print(f"wrote {write(args.name, {'question_tokens': QUESTION, 'answer_tokens': ANSWER, 'rows': rows, 'ratios': ratios})}")


if __name__ == "__main__":
    main()
