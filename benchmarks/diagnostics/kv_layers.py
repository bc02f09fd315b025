"""Where a 3-bit cache loses its answers: per-layer key sensitivity on the default model.

One exact prefill of `--tokens` tokens of benchmarks/kv_quality.py's license haystack (saved to
`--save` as safetensors and reused by later runs); then, at each of `--lengths` (a truncation of
that prefix), answer KL(fp16 || config) over the last `--answer` tokens as kv_quality.py measures
it, for: the base presets, and the base preset with one layer's keys at `--hi-bits` (the gain of
giving that layer more bits). Also per layer: how much of the keys' centred energy a pre-RoPE
centring would remove (KVQuant's pre-RoPE keys; the cache holds post-RoPE keys), and, simulated on
the CPU's decoded prefix (`compressed_pre_rope`), the answer KL of keys centred before RoPE
(`--pre-rope`) or per block of `--block` positions (`--block-means`, an fp16 mean per block).

Usage: python benchmarks/diagnostics/kv_layers.py [--tokens 16384] [--lengths 8192 16384]
Output: --out JSON (read, not committed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kv_quality  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from longctx import kvcache, prompt  # noqa: E402
from longctx.bench import niah, quality  # noqa: E402
from longctx.runtime import models  # noqa: E402


def prefix_ids(tok, n: int, essays, seed: int = 0) -> list[int]:
    case = niah.make_case(
        "single", n, [0.0, 0.25, 0.5, 0.75, 1.0], 0, seed, tok, essays, n, lambda s: len(tok.encode(s, add_special_tokens=False))
    )
    return prompt.prefix_tokens(tok, prompt.layout(tok, niah.DOC_NAME, case.text))


def exact_cache(lm, ids: list[int], save: Path) -> list:
    """The uncompressed cache of `ids`, from `save` when it holds one of the same tokens."""
    cache = kvcache.make(lm.model, kvcache.get_preset("fp16"))
    if save.exists():
        arrays = mx.load(str(save))
        if np.array_equal(np.array(arrays["ids"]), np.array(ids)):
            for i, c in enumerate(cache):
                c.update_and_fetch(arrays[f"k{i}"], arrays[f"v{i}"])
            mx.eval([c.state for c in cache])
            print(f"exact cache from {save}", file=sys.stderr, flush=True)
            return cache
    t0 = time.perf_counter()
    cache, _ = quality.prefill_exact(
        lm.model, ids, progress=lambda d, t: print(f"  prefill {d}/{t}", file=sys.stderr, flush=True)
    )
    arrays = {"ids": mx.array(ids)}
    for i, c in enumerate(cache):
        arrays[f"k{i}"], arrays[f"v{i}"] = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    mx.save_safetensors(str(save), arrays)
    print(f"prefilled {len(ids)} in {time.perf_counter() - t0:.0f} s; saved {save}", file=sys.stderr, flush=True)
    return cache


def unrope(lm, c, n: int):
    """(post-RoPE keys (H, n, D), the same before RoPE, cos, sin (n, D/2)) of the first n keys of
    layer cache `c` (mlx-lm's non-traditional RoPE: halves rotated; positions from 0)."""
    theta = float(getattr(lm.model.args, "rope_theta", 10000.0))
    k = np.array(c.keys[0, :, :n, :].astype(mx.float32))
    d = k.shape[-1]
    ang = np.arange(n)[:, None] * (theta ** (-np.arange(0, d, 2) / d))[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = k[..., : d // 2], k[..., d // 2 :]
    return k, np.concatenate([a * cos + b * sin, b * cos - a * sin], axis=-1), cos, sin  # R(-pos) k


def pre_rope_gain(lm, cache: list, n: int) -> list[dict]:
    """Per layer: centred key energy post-RoPE (what the codec sees) vs pre-RoPE centring."""
    out = []
    for c in cache:
        k, pre, _, _ = unrope(lm, c, n)
        post_c = k - k.mean(1, keepdims=True)
        pre_c = pre - pre.mean(1, keepdims=True)
        out.append(
            {
                "post_centred": float((post_c**2).sum(-1).mean()),
                "pre_centred": float((pre_c**2).sum(-1).mean()),
                "raw": float((k**2).sum(-1).mean()),
            }
        )
    return out


def pre_rope_offsets(lm, cache: list, n: int) -> list:
    """Per layer, (1, H, n, D) float32: R(pos) mu, mu the mean of the first n keys before RoPE."""
    out = []
    for c in cache:
        _, pre, cos, sin = unrope(lm, c, n)
        mu = pre.mean(1, keepdims=True)  # (H, 1, D)
        ma, mb = np.split(mu, 2, axis=-1)
        out.append(mx.array(np.concatenate([ma * cos - mb * sin, ma * sin + mb * cos], axis=-1)[None].astype(np.float32)))
    return out


def block_offsets(cache: list, n: int, block: int) -> list:
    """Per layer, (1, H, n, D) float32: each key's block mean (blocks of `block` positions,
    post-RoPE, rounded to fp16 as a cache would store it)."""
    out = []
    for c in cache:
        k = c.keys[..., :n, :].astype(mx.float32)
        pad = (-n) % block
        kp = mx.pad(k, [(0, 0), (0, 0), (0, pad), (0, 0)])
        nb = kp.shape[2] // block
        counts = mx.array([min(block, n - b * block) for b in range(nb)], dtype=mx.float32)[None, None, :, None]
        means = (kp.reshape(1, k.shape[1], nb, block, -1).sum(3) / counts).astype(mx.float16).astype(mx.float32)
        out.append(mx.repeat(means, block, axis=2)[:, :, :n, :])
    return out


def compressed_pre_rope(lm, exact: list, preset, head: int, block: int = 0) -> list:
    """`quality.compressed` of keys centred before RoPE (KVQuant's pre-RoPE keys, simulated on
    the CPU's decoded prefix): the codec stores k - R(pos) mu and the decoded keys get R(pos) mu
    back, exactly, as a kernel adding q . R(pos) mu to each score would."""
    offsets = block_offsets(exact, head, block) if block else pre_rope_offsets(lm, exact, head)
    shifted = kvcache.make(lm.model, kvcache.get_preset("fp16"))
    for src, dst, off in zip(exact, shifted, offsets):
        k = src.keys[..., :head, :]
        dst.update_and_fetch((k.astype(mx.float32) - off).astype(k.dtype), src.values[..., :head, :])
    cache = quality.compressed(lm.model, shifted, preset, upto=head)
    for c, off in zip(cache, offsets):
        dk, dv = c.dense_prefix
        assert dk.shape[-2] == head, (dk.shape, head)
        c.dense_prefix = (dk + c.codecs()[0].rotate(off), dv)
    return cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--base", nargs="+", default=["tq3", "tq4k3v"])
    ap.add_argument("--sweep", default="tq3", help="the preset whose layers are swept")
    ap.add_argument("--hi-bits", type=int, default=4)
    ap.add_argument("--layers", type=int, nargs="*", default=None)
    ap.add_argument("--combo", type=int, nargs="+", action="append", default=[], help="layers given --hi-bits keys together")
    ap.add_argument("--pre-rope", nargs="*", default=[], help="presets also measured with pre-RoPE centred keys")
    ap.add_argument("--block-means", nargs="*", default=[], help="presets also measured with keys centred per block")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--answer", type=int, default=256)
    ap.add_argument("--save", type=Path, default=Path("/tmp/lc/exact16k.safetensors"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/lc/kv_layers.json"))
    args = ap.parse_args()

    lm = models.load(models.resolve(None))
    with tempfile.TemporaryDirectory() as folder:
        ids = prefix_ids(lm.tokenizer, args.tokens, kv_quality.license_corpus(Path(folder)))
    exact = exact_cache(lm, ids, args.save)
    n_layers = len(exact)
    data = {"tokens": len(ids), "pre_rope": pre_rope_gain(lm, exact, min(len(ids), 8192)), "runs": {}}
    base = kvcache.get_preset(args.sweep)
    configs = {p: kvcache.get_preset(p) for p in ["fp16", *args.base]}
    for layer in args.layers if args.layers is not None else range(n_layers):
        name = f"{base.name}+L{layer}k{args.hi_bits}"
        configs[name] = dataclasses.replace(base, name=name, key_bits_layers=((layer, args.hi_bits),))
    for p in args.pre_rope:
        configs[f"{p}+prerope"] = kvcache.get_preset(p)
    for p in args.block_means:
        configs[f"{p}+block{args.block}"] = kvcache.get_preset(p)
    for combo in args.combo:
        name = f"{base.name}+L{'.'.join(map(str, combo))}k{args.hi_bits}"
        configs[name] = dataclasses.replace(base, name=name, key_bits_layers=tuple((i, args.hi_bits) for i in combo))
    for n in args.lengths:
        head = min(n, len(ids)) - args.answer
        inputs, targets = ids[head - 1 : head + args.answer - 1], mx.array(ids[head : head + args.answer])
        row, ref = {}, None
        for name, p in configs.items():
            t0 = time.perf_counter()
            if name.endswith("+prerope"):
                fork = kvcache.fork(compressed_pre_rope(lm, exact, p, head))
            elif "+block" in name:
                fork = kvcache.fork(compressed_pre_rope(lm, exact, p, head, int(name.split("+block")[1])))
            else:
                fork = kvcache.fork(quality.compressed(lm.model, exact, p, upto=head))
            logps = []
            for lo in range(0, len(inputs), 16):  # as quality.answer_scores: steps of 16
                logits = lm.model(mx.array(inputs[lo : lo + 16])[None], cache=fork)[0].astype(mx.float32)
                logps.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
                mx.eval(logps[-1])
            logp = mx.concatenate(logps)
            ref = logp if ref is None else ref
            kl = float((mx.exp(ref) * (ref - logp)).sum(-1).mean())
            nll = float(-mx.take_along_axis(logp, targets[:, None], axis=-1).mean())
            top1 = float((ref.argmax(-1) == logp.argmax(-1)).mean())
            row[name] = {"kl": kl, "nll": nll, "top1": top1}
            print(
                f"[{n}] {name:>14} KL {kl:.5f} nll {nll:.4f} top1 {top1:.3f} ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            del fork
            data["runs"][str(n)] = row
            args.out.write_text(json.dumps(data, indent=1))
            mx.clear_cache()


if __name__ == "__main__":
    main()
