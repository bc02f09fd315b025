"""Prefill throughput (tokens/s) and peak memory of the default model at 1k and 4k tokens.

Usage: python benchmarks/prefill.py [--tokens 1024 4096] [--chunk 512] [--kv fp16]

Peak memory is MLX's (`mx.get_peak_memory`); on the CPU the compressed path's numpy softmax
temporaries (one score block at a time) are not in it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from _common import prose, write  # noqa: E402

from longctx.runtime.blas import tune_malloc  # noqa: E402

tune_malloc()  # as the `longctx` process does (cli.main)

from longctx import engine, kvcache  # noqa: E402
from longctx.runtime import models  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--chunk", type=int, default=engine.DEFAULT_CHUNK)
    ap.add_argument("--kv", nargs="+", default=["fp16"])
    ap.add_argument("--name", default=None)
    args = ap.parse_args()

    lm = models.load(models.resolve(None))
    ids = lm.tokenizer.encode(prose(max(args.tokens) * 6))
    rows = []
    print(f"{'kv':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'peak MiB':>9}")
    for kv in args.kv:
        preset = kvcache.get_preset(kv)
        for n in args.tokens:
            cache = kvcache.make(lm.model, preset)
            s = engine.prefill(lm.model, ids[:n], cache, chunk=args.chunk)
            rows.append(
                {
                    "kv": kv,
                    "tokens": n,
                    "seconds": s.seconds,
                    "tokens_per_second": s.tokens_per_second,
                    "peak_bytes": s.peak_bytes,
                }
            )
            print(f"{kv:>8} {n:>7} {s.seconds:>8.2f} {s.tokens_per_second:>7.0f} {s.peak_bytes / 2**20:>9.0f}")
    out = write(
        args.name or "prefill_cpu" if lm.dtype == "float32" else "prefill_gpu",
        {"model": lm.ref.model_id, "dtype": lm.dtype, "chunk": args.chunk, "rows": rows},
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
