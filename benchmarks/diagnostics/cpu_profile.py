"""Where the default model's time goes on the CPU: one ingest chunk as the prefix grows, and the
parts of a fresh `ask` (issue 55, item 5).

Ingest (the layer-major prefill: each layer attends an exact fp32 staging cache): one 512-token
chunk through the whole model with mlx-lm's KVCache already holding L tokens (random keys and
values: the cost does not depend on them), so `chunk(L) - chunk(0)` is what attention adds at L;
then one layer's attention alone at L, as the model runs it (MLX's SDPA, causal) and split into
its parts (score matmul, softmax, value matmul), and the softmax's exponentials in numpy.

Fresh ask: python + longctx import, model load, a compressed cache of L tokens decoded once
(`kvcache.decode_once`), the question's prefill (48 tokens) over it and one answer token.

Usage: python benchmarks/diagnostics/cpu_profile.py [--lengths 0 4096 16384] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from _common import environment  # noqa: E402  (imports longctx first)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from longctx.kvcache import attend_cpu, routing  # noqa: E402

CHUNK = 512


def timed(fn, reps: int = 3) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def fill(cache, length: int, hkv: int, d: int, seed: int = 0):
    for i, c in enumerate(cache):
        k = mx.random.normal((1, hkv, length, d), key=mx.random.key(seed + 2 * i))
        v = mx.random.normal((1, hkv, length, d), key=mx.random.key(seed + 2 * i + 1))
        c.update_and_fetch(k, v)
        mx.eval(c.state)


def attention_parts(length: int, hq: int, hkv: int, d: int) -> dict:
    """One layer's chunk attention at `length` cached tokens, fp32, timed in parts."""
    q = mx.random.normal((1, hq, CHUNK, d))
    k = mx.random.normal((1, hkv, length + CHUNK, d))
    v = mx.random.normal((1, hkv, length + CHUNK, d))
    mx.eval(q, k, v)
    scale = d**-0.5
    r = hq // hkv
    res = {"sdpa": timed(lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")))}
    qg = q.reshape(1, hkv, r * CHUNK, d)
    s = (qg * scale) @ k.swapaxes(-1, -2)
    mx.eval(s)
    res["scores_matmul"] = timed(lambda: mx.eval((qg * scale) @ k.swapaxes(-1, -2)))
    res["softmax_mlx"] = timed(lambda: mx.eval(mx.softmax(s, axis=-1)))
    res["exp_mlx"] = timed(lambda: mx.eval(mx.exp(s)))
    sn = np.array(s)
    buf = np.empty_like(sn)
    res["exp_numpy"] = timed(lambda: np.exp(sn, out=buf))
    p = mx.softmax(s, axis=-1)
    mx.eval(p)
    res["values_matmul"] = timed(lambda: mx.eval(p @ v))
    res["exact_numpy_attention"] = timed(lambda: mx.eval(attend_cpu.exact_attention(q, k, v, scale, "causal")))
    res["score_elements"] = int(s.size)
    return res


def fresh_ask_parts(model_ref, lm, length: int, preset_name: str) -> dict:
    from longctx import kvcache

    out = {}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import longctx.cli, mlx.core, mlx_lm"], check=True)
    out["import_seconds"] = time.perf_counter() - t
    from longctx.runtime import models

    t = time.perf_counter()
    light = models.load_light(model_ref)  # what `ask` loads (no transformers), file in the page cache
    out["model_load_seconds"] = time.perf_counter() - t
    out["model_load_path"] = "light" if light is not None else "mlx-lm"
    del light
    cfg = lm.model.args
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    preset = kvcache.get_preset(preset_name)
    cache = kvcache.make(lm.model, preset)
    fill(cache, length, hkv, d)
    kvcache.seal(cache)
    arrays = kvcache.to_arrays(cache, preset)  # as the store writes and `ask` restores it
    mx.eval(arrays)
    del cache
    t = time.perf_counter()
    cache = kvcache.from_arrays(arrays, lm.model, preset, mx.float32)
    mx.eval([c.state for c in cache])
    out["rebuild_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    out["decode_once_bytes"] = kvcache.decode_once(cache)
    out["decode_once_seconds"] = time.perf_counter() - t
    cache = kvcache.fork(cache)  # the question and answer stay exact in the fork's window
    question = list(range(1000, 1048))
    t = time.perf_counter()
    logits = lm.model(mx.array(question, dtype=mx.int32)[None], cache=cache)
    mx.eval(logits[:, -1])
    out["question_prefill_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    logits = lm.model(mx.array([[int(mx.argmax(logits[0, -1]))]], dtype=mx.int32), cache=cache)
    mx.eval(logits)
    out["answer_token_seconds"] = time.perf_counter() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="*", default=[0, 4096, 16384])
    ap.add_argument("--ask-length", type=int, default=20480)
    ap.add_argument("--kv", default="tq4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from mlx_lm.models.cache import KVCache

    from longctx.runtime import models

    ref = models.resolve(None)
    t = time.perf_counter()
    lm = models.load(ref)
    load_s = time.perf_counter() - t
    routing.install()  # as `kvcache.make` does for every cache the product makes
    cfg = lm.model.args
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    n_layers = len(lm.model.layers)
    ids = mx.array(list(range(2000, 2000 + CHUNK)), dtype=mx.int32)[None]
    rows = []
    for length in args.lengths:
        cache = [KVCache() for _ in range(n_layers)]
        if length:
            fill(cache, length, hkv, d)
        states = [(c.keys, c.values, c.offset) for c in cache]

        def chunk():
            for c, (k, v, o) in zip(cache, states):
                c.keys, c.values, c.offset = k, v, o
            lm.model(ids, cache=cache)
            mx.eval([c.state for c in cache])

        chunk()  # warm
        row = {"cached_tokens": length, "chunk_seconds": timed(chunk, reps=2)}
        saved = attend_cpu.EXACT_MIN_SCORES
        attend_cpu.EXACT_MIN_SCORES = 1 << 62  # MLX's own SDPA throughout (before issue 55's change)
        row["chunk_seconds_mlx_sdpa"] = timed(chunk, reps=1)
        attend_cpu.EXACT_MIN_SCORES = saved
        row["chunk_tok_s"] = CHUNK / row["chunk_seconds"]
        one = attention_parts(length, hq, hkv, d)
        row["attention_layer"] = one
        row["attention_all_layers_seconds"] = one["sdpa"] * n_layers
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["chunk_seconds"] if rows and rows[0]["cached_tokens"] == 0 else None
    for row in rows:
        if base:
            row["attention_added_seconds"] = row["chunk_seconds"] - base
    ask = fresh_ask_parts(ref, lm, args.ask_length, args.kv)
    print(json.dumps(ask), flush=True)
    result = {
        "environment": environment(),
        "model": ref.name if hasattr(ref, "name") else str(ref),
        "layers": n_layers,
        "model_load_seconds_first": load_s,
        "chunk": CHUNK,
        "ingest": rows,
        "fresh_ask": {"cached_tokens": args.ask_length, "kv": args.kv, **ask},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
