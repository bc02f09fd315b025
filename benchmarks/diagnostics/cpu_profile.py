"""What bounds the default model on this CPU: a prefill chunk's cost against its context, and a
fresh `ask`'s parts (model load, the question's prefill over a long prefix).

Uses kv_layers.py's saved exact prefix (`--save`, fp32 keys and values of the license haystack)
so that no long prefill is needed: a chunk of `--chunk` new tokens is run through the model with
a cache of the first N tokens of that prefix, for each N of `--contexts`, and timed (best of
`--reps`): the growth over context 0 is the attention's share. Prints one line per measurement
(read, not committed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

from longctx import kvcache
from longctx.runtime import models


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", type=Path, default=Path("/tmp/lc/exact16k.safetensors"))
    ap.add_argument("--contexts", type=int, nargs="+", default=[0, 4096, 8192, 16000])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--question", type=int, default=40)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    t = time.perf_counter()
    lm = models.load(models.resolve(None))
    mx.eval(lm.model.parameters())
    print(f"model load (weights in memory): {time.perf_counter() - t:.2f} s", flush=True)
    arrays = mx.load(str(args.save))
    ids = [int(x) for x in arrays["ids"].tolist()]
    layers = len(lm.model.layers)
    for n_tokens in (args.chunk, args.question):
        for ctx in args.contexts:

            def run(ctx=ctx, n_tokens=n_tokens):
                cache = kvcache.make(lm.model, kvcache.get_preset("fp16"))
                if ctx:
                    for i, c in enumerate(cache):
                        c.update_and_fetch(arrays[f"k{i}"][..., :ctx, :], arrays[f"v{i}"][..., :ctx, :])
                    mx.eval([c.state for c in cache])
                t0 = time.perf_counter()
                out = lm.model(mx.array(ids[ctx : ctx + n_tokens])[None], cache=cache)
                mx.eval(out)
                run.seconds = time.perf_counter() - t0

            best = min((run(), run.seconds)[1] for _ in range(args.reps))
            print(
                f"{n_tokens:4d} new tokens after {ctx:6d}: {best:6.2f} s ({n_tokens / best:5.1f} tok/s, {layers} layers)",
                file=sys.stdout,
                flush=True,
            )


if __name__ == "__main__":
    main()
