"""Portable decode-attend kernel variants side by side with fp16 SDPA (GPU; read, not committed).

Times, in alternating pipelined rounds (benchmarks/attend.py's `alternating`), per length:
fp16 SDPA, the portable kernel alone on the tq4 cache (the current source, and the committed
one as `decode_attend_old` where present), at each of `--min-blocks`.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attend  # noqa: E402

import mlx.core as mx  # noqa: E402

from longctx.kernels import decode_attend as da  # noqa: E402
from longctx.kvcache.attention import kernel_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--min-blocks", type=int, nargs="+", default=[5])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    try:
        old = importlib.import_module("longctx.kernels.decode_attend_old")
    except ImportError:
        old = None
    for s in args.lengths:
        env = attend.setup(s, presets=("tq4",), affine=False)
        q, k, v, view = env["q"], env["k"], env["v"], env["tq4"]
        scale = attend.D**-0.5
        kc, vc = view.key_codec, view.value_codec
        seg_k, seg_v, _ = view.segments[0]
        q_rot = kc.rotate(q.astype(mx.float32)).reshape(attend.B, attend.HKV, attend.HQ // attend.HKV, kc.padded_dim)
        kt, vt = kernel_table(kc), kernel_table(vc)
        kw = dict(key_bits=kc.spec.bits, value_bits=vc.spec.bits, scale=scale)
        fns = {"fp16_sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)}
        for mod, tag in ((da, "new"), (old, "old")):
            if mod is None:
                continue
            for mb in args.min_blocks:

                def fn(mod=mod, mb=mb):
                    mod.MIN_BLOCKS = mb
                    return mod.decode_attend(q_rot, seg_k, seg_v, kt, vt, **kw)

                fns[f"{tag}_mb{mb}"] = fn
        ref = fns["fp16_sdpa"]
        for name, fn in fns.items():
            mx.eval(fn())
            if name != "fp16_sdpa":
                a, b = fn(), da.decode_attend_reference(q_rot, seg_k, seg_v, kt, vt, **kw)
                err = float(mx.abs(a[2] - b[2]).max() / mx.abs(b[2]).max())
                print(f"S={s} {name}: max rel err vs reference {err:.2e}", flush=True)
        del ref
        times = attend.alternating(fns, args.rounds)
        med = {n: statistics.median(t) for n, t in times.items()}
        line = "  ".join(f"{n} {ms:.4f} ms ({med['fp16_sdpa'] / ms:.2f}x)" for n, ms in med.items())
        print(f"S={s}: {line}", flush=True)


if __name__ == "__main__":
    main()
