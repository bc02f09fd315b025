"""Time to the first answer token for an N-token document, three ways, in one run:

(a) full re-prefill of document + question;
(b) mlx-lm's own prompt cache: `save_prompt_cache` / `load_prompt_cache` (the model's native cache
    dtype, fp32 on the CPU, and mlx-lm's affine8), then the question through mlx-lm's own
    `generate_step` (what `mlx_lm.generate --prompt-cache-file` runs: the question but its last
    token is one forward pass, the last token a second one); `b_*_engine_s` is the same file
    answered through longctx's decode loop (one forward pass for the whole question), which
    separates the cache format from the answering loop;
(c) longctx: restore the stored cache of each preset, then the question.

Every timed variant runs --repeat times, the variants interleaved; the best time is reported (and
the median). In-process times exclude model loading (the same for all three); the whole `longctx
ask` process (python start, imports, model load, restore, question, first token on stdout) is timed
separately.
On the CPU, (c) includes decoding the compressed prefix once (`kvcache.decode_once`).

Usage: python benchmarks/restore.py [--tokens 1024 4096] [--presets fp16 tq4 ...]
       [--checks overlap after] (A/B of when the checksum threads start, interleaved)
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import document_of, write  # noqa: E402

from longctx.runtime.blas import tune_malloc  # noqa: E402

tune_malloc()  # as the `longctx` process does (cli.main); the same process runs (a), (b) and (c)

import mlx.core as mx  # noqa: E402

from longctx import engine, kvcache, session  # noqa: E402
from longctx.runtime import models  # noqa: E402
from longctx.store import Store  # noqa: E402
from longctx.store.format import CHECKS  # noqa: E402

QUESTION = "What does the document say about the chief engineer?"


def first_token_after(lm, cache: list, tokens: list[int]) -> float:
    """Seconds to prefill `tokens` into `cache` and produce the first answer token."""
    start = time.perf_counter()
    engine.greedy_tokens(lm.model, tokens, cache, 1)
    return time.perf_counter() - start


def stock_first_token(lm, cache: list, tokens: list[int]) -> float:
    """Seconds for mlx-lm's `generate_step` to produce the first answer token from `cache`."""
    from mlx_lm.generate import generate_step

    start = time.perf_counter()
    token, _ = next(generate_step(mx.array(tokens), lm.model, prompt_cache=cache))
    int(token)  # evaluated (generate_step yields a Python int already; kept explicit)
    return time.perf_counter() - start


def process_first_token(home: Path, doc: str) -> float:
    """Wall time from starting `longctx ask` to its first answer byte on stdout."""
    env = {**os.environ, "LONGCTX_HOME": str(home)}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "longctx", "ask", QUESTION, "--doc", doc, "--max-tokens", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    proc.stdout.read(1)
    elapsed = time.perf_counter() - start
    proc.stdout.read()
    proc.wait()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--presets", nargs="+", default=["fp16", "tq4", "tq4k3v", "tq3"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--process", action="store_true", help="also time whole `longctx ask` processes")
    ap.add_argument("--name", default=None)
    ap.add_argument(
        "--model",
        default=None,
        help="model spec (default: the default model); e.g. a `#rope=ntk-by-parts:4` spec to time contexts past the model's own",
    )
    ap.add_argument("--no-reprefill", action="store_true", help="skip (a)")
    ap.add_argument(
        "--checks",
        nargs="+",
        default=None,
        choices=["overlap", "after"],
        help="time (c) with the checksum threads started at each of these points "
        "(longctx.store.format.CHECKS; default: the shipped one); variants after the "
        "first are named c_<preset>@<checks>",
    )
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="longctx-bench-"))
    os.environ["LONGCTX_HOME"] = str(home)
    lm = models.load(models.resolve(args.model))
    rows = []
    for n in args.tokens:
        doc, prefix, question = document_of(lm, home, n, QUESTION)
        row = {"tokens": len(prefix)}
        runs = {}  # timed variant -> a function returning its seconds

        # (a) full re-prefill, once (it is the slow one)
        if not args.no_reprefill:
            fresh = kvcache.make(lm.model, kvcache.get_preset("fp16"))
            row["a_reprefill_s"] = first_token_after(lm, fresh, prefix + question)

        # (b) mlx-lm prompt cache files
        from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

        base = make_prompt_cache(lm.model)
        engine.prefill(lm.model, prefix, base)
        # mlx-lm's quantized SDPA has no CUDA kernel for head_dim 64 (ANCHORS.md): native only there
        mlxlm_kinds = [("native", 0), ("affine8", 8)] if lm.dtype == "float32" else [("native", 0)]
        native = base[0].state[0].dtype
        if native != mx.float16 and all(type(c) is KVCache for c in base):
            # The model's own keys/values are wider than fp16 (fp32 activations: the CPU policy,
            # or quantized weights with fp32 scales on a GPU): also time the same cache in fp16,
            # the anchor the 2x target names.
            mlxlm_kinds.append(("fp16", 16))
        for label, bits in mlxlm_kinds:
            if bits == 16:
                cache = []
                for c in base:
                    half = KVCache()
                    keys, values, offset = c.state
                    half.state = (keys.astype(mx.float16), values.astype(mx.float16), offset)
                    cache.append(half)
            else:
                cache = base if not bits else [c.to_quantized(group_size=64, bits=bits) for c in base]
            path = home / f"mlxlm-{n}-{label}.safetensors"
            save_prompt_cache(str(path), cache)

            def run_b(path=path, answer=stock_first_token):
                start = time.perf_counter()
                loaded = load_prompt_cache(str(path))
                return time.perf_counter() - start + answer(lm, loaded, question)

            runs[f"b_{label}_s"] = run_b
            runs[f"b_{label}_engine_s"] = lambda run_b=run_b: run_b(answer=first_token_after)
            row[f"b_{label}_bytes"] = path.stat().st_size

        # (c) longctx restore per preset
        for name in args.presets:
            entry = session.ingest(doc, model=args.model, preset=name).entry

            def run_c(entry=entry, checks=CHECKS):  # when the checksum threads start
                start = time.perf_counter()
                store = Store(cleanup=False)  # as `ask` opens it
                cache, pending = session.restore_verifying(entry, lm, store, checks=checks)  # as `ask` does
                store.close()
                first_token_after(lm, kvcache.fork(cache), question)
                pending.wait()  # checksums overlap the question; the token waits for them
                return time.perf_counter() - start

            checks = args.checks or [CHECKS]
            runs[f"c_{name}_s"] = functools.partial(run_c, checks=checks[0])
            for when in checks[1:]:
                runs[f"c_{name}@{when}_s"] = functools.partial(run_c, checks=when)
            row[f"c_{name}_bytes"] = entry.bytes
            row[f"c_{name}_bits_per_channel"] = entry.bits_per_channel
            if args.process:
                row[f"c_{name}_process_s"] = min(process_first_token(home, entry.id) for _ in range(2))
        # Repetitions interleave every (b) and (c) variant, so that a machine whose speed drifts
        # during the run (the lent GPU VM does, by 20-50% over minutes) favours none of them.
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.repeat):
            for key, fn in runs.items():
                times[key].append(fn())
        for key, ts in times.items():
            row[key] = min(ts)
            row[key[:-2] + "_median_s"] = sorted(ts)[len(ts) // 2]
        row["all_s"] = times
        rows.append(row)
        b8 = f", affine8 {row['b_affine8_s']:.3f}s ({row['b_affine8_bytes'] / 2**20:.1f} MiB)" if "b_affine8_s" in row else ""
        b8 += f", fp16 {row['b_fp16_s']:.3f}s ({row['b_fp16_bytes'] / 2**20:.1f} MiB)" if "b_fp16_s" in row else ""
        a = row.get("a_reprefill_s", float("nan"))
        print(
            f"N={row['tokens']}: re-prefill {a:.2f}s | mlx-lm native {row['b_native_s']:.3f}s "
            f"(its file through longctx's loop {row['b_native_engine_s']:.3f}s; "
            f"{row['b_native_bytes'] / 2**20:.1f} MiB){b8}"
        )
        for name in args.presets:
            for when in (args.checks or [None])[1:]:
                print(
                    f"   longctx {name} checks {when}: {row[f'c_{name}@{when}_s']:.3f}s "
                    f"(median {row[f'c_{name}@{when}_median_s']:.3f}s)"
                )
            c = row[f"c_{name}_s"]
            print(
                f"   (medians: b_fp16 {row.get('b_fp16_median_s', float('nan')):.3f}s, c_{name} {row[f'c_{name}_median_s']:.3f}s)"
            )
            proc = f", process {row[f'c_{name}_process_s']:.2f}s" if args.process else ""
            print(
                f"   longctx {name:>8}: {c:.3f}s ({row[f'c_{name}_bytes'] / 2**20:.1f} MiB, "
                f"{row[f'c_{name}_bits_per_channel']:.2f} b/ch) a/c {a / c:.0f}x, "
                f"b_native/c {row['b_native_s'] / c:.2f}x (engine {row['b_native_engine_s'] / c:.2f}x)"
                + (f", b_affine8/c {row['b_affine8_s'] / c:.2f}x" if "b_affine8_s" in row else "")
                + (f", b_fp16/c {row['b_fp16_s'] / c:.2f}x" if "b_fp16_s" in row else "")
                + proc
            )
    device = "cpu" if lm.dtype == "float32" else "gpu"
    out = write(
        args.name or f"restore_{device}",
        {"model": lm.ref.model_id, "model_spec": args.model, "dtype": lm.dtype, "question": QUESTION, "rows": rows},
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
