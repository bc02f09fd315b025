"""Where one layer's prefill chunk spends its time on a GPU: compressed (tq4) vs fp16 cache.

One attention layer of a real shape (benchmarks/diagnostics/shapes.py), a cache already holding L tokens and
a chunk of 512 new ones, each part timed alone (median of `reps` synchronized runs of `steps`
back-to-back calls, ms per call):
  fp16_append   mlx-lm's KVCache.update_and_fetch of the chunk (what the fp16 path pays)
  fp16_sdpa     mx.fast.scaled_dot_product_attention over the L + 512 fp16 keys
  encode_fused  VectorCodec.encode of the chunk's keys through the fused kernel (GPU)
  encode_mlx    the same through MLX ops (the CPU / RVQ / QJL path)
  dequant       kernels/dequant.py of the compressed keys and values (+ sink and window rows)
  sdpa_fp16_rot the SDPA over the dequantized rows
  dense_attn    kvcache.dense_gpu.attention (rotations, dequant, SDPA, value mean)
  tq4_append    TurboQuantCache.update_and_fetch of the chunk (window, encode, tail writes)

Usage: python benchmarks/diagnostics/prefill_profile.py [--shapes llama-3.1-8b smollm2-135m] [--lengths 8192 32768]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import write  # noqa: E402  (imports longctx first)

import mlx.core as mx  # noqa: E402
from shapes import SHAPES  # noqa: E402

from longctx.kvcache import dense_gpu, get_preset  # noqa: E402
from longctx.kvcache.attention import kernel_table  # noqa: E402
from longctx.kvcache.turbo import TurboQuantCache  # noqa: E402
from longctx.quant import codec as codec_mod  # noqa: E402

CHUNK = 512


def timed(fn, steps=10, reps=5) -> float:
    mx.eval(fn())
    out = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval([fn() for _ in range(steps)])
        mx.synchronize()
        out.append((time.perf_counter() - t) / steps)
    return 1e3 * statistics.median(out)


def profile(shape: str, length: int) -> dict:
    from mlx_lm.models.cache import KVCache

    cfg = SHAPES[shape]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    dt = mx.bfloat16
    mx.random.seed(0)
    k = mx.random.normal((1, hkv, length, d)).astype(dt)
    v = mx.random.normal((1, hkv, length, d)).astype(dt)
    kn = mx.random.normal((1, hkv, CHUNK, d)).astype(dt)
    vn = mx.random.normal((1, hkv, CHUNK, d)).astype(dt)
    q = mx.random.normal((1, hq, CHUNK, d)).astype(dt)
    scale = d**-0.5
    res = {}

    fp16 = KVCache()
    fp16.update_and_fetch(k, v)
    mx.eval(fp16.keys, fp16.values)

    def fp16_append():
        c = KVCache()
        c.keys, c.values, c.offset = fp16.keys, fp16.values, fp16.offset
        return c.update_and_fetch(kn, vn)

    res["fp16_append"] = timed(fp16_append)
    kk, vv = fp16_append()
    mx.eval(kk, vv)
    res["fp16_sdpa"] = timed(lambda: mx.fast.scaled_dot_product_attention(q, kk, vv, scale=scale, mask="causal"))

    tq = TurboQuantCache(get_preset("tq4"), layer=0)
    for lo in range(0, length, 4096):
        tq.update_and_fetch(k[:, :, lo : lo + 4096], v[:, :, lo : lo + 4096])
        mx.eval(tq.state)
    kc, vc = tq.codecs()
    x = kn.astype(mx.float32)
    res["encode_fused" if kc.fused_encode() else "encode_kernel_unavailable"] = timed(lambda: kc.encode(x))
    saved = codec_mod.VectorCodec.fused_encode
    codec_mod.VectorCodec.fused_encode = lambda self: False
    res["encode_mlx"] = timed(lambda: kc.encode(x))
    codec_mod.VectorCodec.fused_encode = saved

    view = tq.view()
    seg_k, seg_v, _ = view.segments[0]
    from longctx.kernels.dequant import dequant

    sink_k = kc.rotate(view.sink[0].astype(mx.float32)).astype(mx.float16)
    win_k = kc.rotate(view.window[0].astype(mx.float32)).astype(mx.float16)
    res["dequant"] = timed(
        lambda: [
            dequant(seg_k, kernel_table(kc), bits=4, p=kc.padded_dim, head=sink_k, after=win_k),
            dequant(seg_v, kernel_table(vc), bits=4, p=vc.padded_dim, head=sink_k, after=win_k),
        ]
    )
    dk = dequant(seg_k, kernel_table(kc), bits=4, p=kc.padded_dim, head=sink_k, after=win_k)
    dv = dequant(seg_v, kernel_table(vc), bits=4, p=vc.padded_dim, head=sink_k, after=win_k)
    qr = q.astype(mx.float16)
    mx.eval(dk, dv, qr)
    res["sdpa_fp16_rot"] = timed(lambda: mx.fast.scaled_dot_product_attention(qr, dk, dv, scale=scale, mask="causal"))
    res["dense_attn"] = timed(lambda: dense_gpu.attention(q, view, scale, "causal"))

    def tq4_append():
        c = TurboQuantCache(get_preset("tq4"), layer=0)
        c.head_dim, c.means, c.sink, c.window = tq.head_dim, tq.means, tq.sink, tq.window
        c.tail, c.tail_len = tq.tail, tq.tail_len
        c.update_and_fetch(kn, vn)
        return c.state

    res["tq4_append"] = timed(tq4_append, steps=5, reps=3)
    res["tq4_total"] = res["tq4_append"] + res["dense_attn"]
    res["fp16_total"] = res["fp16_append"] + res["fp16_sdpa"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "smollm2-135m"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--name", default="prefill_profile_gpu")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        for n in args.lengths:
            r = profile(shape, n)
            rows.append({"shape": shape, "cached_tokens": n, "chunk": CHUNK, "ms": r})
            print(f"{shape} L={n}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    print(f"wrote {write(args.name, {'rows': rows})}")


if __name__ == "__main__":
    main()
