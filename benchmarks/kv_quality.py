"""KV cache quality per preset: teacher-forced perplexity and mean KL(fp16 || preset).

All presets run in lockstep over the same real text, chunk by chunk (the way ingest prefills): each
chunk's next-token distributions under a preset's cache are compared with the fp16 cache's.

Usage: python benchmarks/kv_quality.py [--tokens 2048] [--chunk 512] [--presets ...]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import prose, write  # noqa: E402

import mlx.core as mx  # noqa: E402

from longctx import kvcache  # noqa: E402
from longctx.kvcache.presets import bits_per_channel  # noqa: E402
from longctx.runtime import models  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--presets", nargs="+", default=list(kvcache.PRESETS))
    ap.add_argument("--name", default=None)
    args = ap.parse_args()

    lm = models.load(models.resolve(None))
    ids = lm.tokenizer.encode(prose(args.tokens * 6))[: args.tokens + 1]
    inputs, targets = ids[:-1], mx.array(ids[1:])
    presets = ["fp16"] + [p for p in args.presets if p != "fp16"]
    caches = {p: kvcache.make(lm.model, kvcache.get_preset(p)) for p in presets}
    nll = {p: 0.0 for p in presets}
    kl = {p: 0.0 for p in presets}
    top1 = {p: 0 for p in presets}
    seconds = {p: 0.0 for p in presets}
    for lo in range(0, len(inputs), args.chunk):
        x = mx.array(inputs[lo : lo + args.chunk])[None]
        tgt = targets[lo : lo + args.chunk]
        ref = None
        for p in presets:
            t = time.perf_counter()
            logits = lm.model(x, cache=caches[p])[0].astype(mx.float32)  # (T, V)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            mx.eval(logp)
            seconds[p] += time.perf_counter() - t
            nll[p] += float(-mx.take_along_axis(logp, tgt[:, None], axis=-1).sum())
            if ref is None:
                ref = logp
            kl[p] += float((mx.exp(ref) * (ref - logp)).sum())
            top1[p] += int((ref.argmax(-1) == logp.argmax(-1)).sum())
        print(f"{min(lo + args.chunk, len(inputs))}/{len(inputs)} tokens", file=sys.stderr)
    n = len(inputs)
    head_dim = kvcache.head_dims(lm.model)[0]
    rows = []
    base_ppl = math.exp(nll["fp16"] / n)
    print(f"{'preset':>9} {'bits/ch':>8} {'ppl':>8} {'Δppl %':>7} {'KL nats':>9} {'top1 %':>7} {'s':>6}")
    for p in presets:
        ppl = math.exp(nll[p] / n)
        row = {"preset": p, "bits_per_channel": bits_per_channel(kvcache.get_preset(p), head_dim, n),
               "perplexity": ppl, "ppl_delta_pct": 100 * (ppl / base_ppl - 1), "kl_mean": kl[p] / n,
               "top1_agreement": top1[p] / n, "seconds": seconds[p]}
        rows.append(row)
        print(f"{p:>9} {row['bits_per_channel']:>8.3f} {ppl:>8.3f} {row['ppl_delta_pct']:>7.2f} "
              f"{row['kl_mean']:>9.5f} {100 * row['top1_agreement']:>7.2f} {seconds[p]:>6.1f}")
    out = write(args.name or f"kv_quality_{'cpu' if lm.dtype == 'float32' else 'gpu'}_{n}",
                {"model": lm.ref.model_id, "dtype": lm.dtype, "tokens": n, "chunk": args.chunk,
                 "text": "samples/report.pdf + samples/notes.md + GPL-3 (real prose)", "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
