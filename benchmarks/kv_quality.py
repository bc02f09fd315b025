"""KV cache quality per preset on real text: perplexity and KL(fp16 || preset), two ways.

- `prefill`: teacher-forced over all N tokens in chunks of 512, every preset in lockstep (how
  ingest runs: each chunk attends to itself exactly and to earlier chunks through the cache).
- `answer`: the product path. The first N - A tokens are prefilled and sealed (every token
  compressed, as a restored cache is), then the last A tokens are teacher-forced in steps of 16
  from an answering fork (`kvcache.fork`: it keeps up to `--answer-exact` new tokens
  uncompressed, as `longctx ask` does), like a question and its answer; KL and perplexity over
  those A tokens only. `--answer-exact 128` reproduces the earlier path that kept only the
  preset's 128-token window exact.

Usage: python benchmarks/kv_quality.py [--tokens 2048] [--answer 256] [--presets ...]
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

from longctx import engine, kvcache  # noqa: E402
from longctx.kvcache.presets import bits_per_channel  # noqa: E402
from longctx.runtime import models  # noqa: E402


def _logp(model, tokens: list[int], cache: list) -> mx.array:
    logits = model(mx.array(tokens)[None], cache=cache)[0].astype(mx.float32)  # (T, V)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _score(ref: mx.array, logp: mx.array, targets: mx.array) -> tuple[float, float, int]:
    nll = float(-mx.take_along_axis(logp, targets[:, None], axis=-1).sum())
    kl = float((mx.exp(ref) * (ref - logp)).sum())
    top1 = int((ref.argmax(-1) == logp.argmax(-1)).sum())
    return nll, kl, top1


def prefill_metric(lm, ids: list[int], presets: list[str], chunk: int) -> dict:
    inputs, targets = ids[:-1], mx.array(ids[1:])
    caches = {p: kvcache.make(lm.model, kvcache.get_preset(p)) for p in presets}
    tot = {p: [0.0, 0.0, 0] for p in presets}
    for lo in range(0, len(inputs), chunk):
        ref = None
        for p in presets:
            logp = _logp(lm.model, inputs[lo : lo + chunk], caches[p])
            ref = logp if ref is None else ref
            for i, v in enumerate(_score(ref, logp, targets[lo : lo + chunk])):
                tot[p][i] += v
        print(f"  prefill metric: {min(lo + chunk, len(inputs))}/{len(inputs)}", file=sys.stderr)
    n = len(inputs)
    return {p: {"ppl": math.exp(t[0] / n), "kl": t[1] / n, "top1": t[2] / n} for p, t in tot.items()}


def answer_metric(lm, ids: list[int], presets: list[str], answer: int, step: int,
                  exact: int = kvcache.ANSWER_EXACT) -> dict:
    prefix, rest = ids[: -answer - 1], ids[-answer - 1 :]
    inputs, targets = rest[:-1], mx.array(rest[1:])
    out, ref_logps = {}, []
    for p in presets:
        cache = kvcache.make(lm.model, kvcache.get_preset(p))
        engine.prefill(lm.model, prefix, cache)
        kvcache.seal(cache)
        cache = kvcache.fork(cache, exact_new=exact)
        nll = kl = 0.0
        top1 = 0
        start = time.perf_counter()
        for j, lo in enumerate(range(0, len(inputs), step)):
            logp = _logp(lm.model, inputs[lo : lo + step], cache)
            mx.eval(logp)
            if p == presets[0]:
                ref_logps.append(logp)
            a, b, c = _score(ref_logps[j], logp, targets[lo : lo + step])
            nll, kl, top1 = nll + a, kl + b, top1 + c
        out[p] = {"ppl": math.exp(nll / len(inputs)), "kl": kl / len(inputs), "top1": top1 / len(inputs),
                  "answer_seconds": time.perf_counter() - start}
        print(f"  answer metric: {p} done", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--answer", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--step", type=int, default=16)
    ap.add_argument("--presets", nargs="+", default=list(kvcache.PRESETS))
    ap.add_argument("--answer-exact", type=int, default=kvcache.ANSWER_EXACT,
                    help="new tokens an answering fork keeps uncompressed (the product's default)")
    ap.add_argument("--skip-prefill-metric", action="store_true")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()

    lm = models.load(models.resolve(None))
    ids = lm.tokenizer.encode(prose(args.tokens * 6))[: args.tokens + 1]
    presets = ["fp16"] + [p for p in args.presets if p != "fp16"]
    if lm.dtype != "float32":  # mlx-lm's quantized SDPA has no CUDA kernel for head_dim 64 (ANCHORS.md)
        skipped = [p for p in presets if kvcache.get_preset(p).kind == "affine"]
        presets = [p for p in presets if p not in skipped]
        print(f"skipping {skipped} on this backend", file=sys.stderr)
    nan = {"ppl": float("nan"), "kl": float("nan"), "top1": float("nan")}
    pre = ({p: dict(nan) for p in presets} if args.skip_prefill_metric
           else prefill_metric(lm, ids, presets, args.chunk))
    ans = answer_metric(lm, ids, presets, args.answer, args.step, args.answer_exact)
    head_dim = kvcache.head_dims(lm.model)[0]
    rows = []
    print(f"{'preset':>9} {'bits/ch':>8} | {'ppl':>7} {'Δppl%':>6} {'KL':>8} {'top1%':>6} | "
          f"{'ans ppl':>7} {'Δppl%':>6} {'ans KL':>8} {'top1%':>6}")
    for p in presets:
        a, b = pre[p], ans[p]
        row = {"preset": p, "bits_per_channel": bits_per_channel(kvcache.get_preset(p), head_dim, args.tokens),
               "prefill": {**a, "ppl_delta_pct": 100 * (a["ppl"] / pre["fp16"]["ppl"] - 1)},
               "answer": {**b, "ppl_delta_pct": 100 * (b["ppl"] / ans["fp16"]["ppl"] - 1)}}
        rows.append(row)
        print(f"{p:>9} {row['bits_per_channel']:>8.3f} | {a['ppl']:>7.3f} {row['prefill']['ppl_delta_pct']:>6.2f} "
              f"{a['kl']:>8.5f} {100 * a['top1']:>6.2f} | {b['ppl']:>7.3f} {row['answer']['ppl_delta_pct']:>6.2f} "
              f"{b['kl']:>8.5f} {100 * b['top1']:>6.2f}")
    device = "cpu" if lm.dtype == "float32" else "gpu"
    out = write(args.name or f"kv_quality_{device}_{args.tokens}",
                {"model": lm.ref.model_id, "dtype": lm.dtype, "tokens": args.tokens, "answer_tokens": args.answer,
                 "chunk": args.chunk, "answer_step": args.step, "answer_exact": args.answer_exact,
                 "text": "samples/report.pdf + samples/notes.md + GPL-3 (if present) + samples/haystack (real prose)", "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
