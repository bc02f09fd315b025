"""How the number of arrays in a safetensors file changes `mx.load` and the arrays' first use.

Synthetic files of the byte sizes of an 8k-token tq4 cache of SmolLM2-135M (30 layers, 3 KV heads,
d = 64: ~0.76 MB of packed indices per layer and tag, ~48 KB of norms, plus means and sinks) in
several layouts: format 2's 240 arrays, format 3's 66 (indices per layer, small parts stacked),
and coarser ones. Per layout: `mx.load` + eval (best and median of --repeat), then a first pass
over every array (`astype(float32).sum()`; on CUDA that is where managed memory migrates to the
GPU). Written to benchmarks/results/<name>.json.

Usage: python benchmarks/diagnostics/mxload_layouts.py [--repeat 9] [--name mxload_layouts_cpu]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import write  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

L, N, H = 30, 7928, 3
IDX = N * H * 64 * 4 // 8  # bytes of one layer's 4-bit indices, keys or values
NORM = N * H * 2
MU, SINK = H * 64 * 4, 4 * H * 64 * 2


def layouts(rng) -> dict:
    def arr(nbytes: int) -> mx.array:
        return mx.array(rng.integers(0, 255, size=nbytes, dtype=np.uint8))

    per_layer_tag = MU + SINK + IDX + NORM
    return {
        "format2_240": lambda: {
            f"{i}.{t}.{p}": arr(n)
            for i in range(L)
            for t in "kv"
            for p, n in (("mu", MU), ("sink", SINK), ("idx", IDX), ("norm", NORM))
        },
        "format3_66": lambda: {
            **{f"{i}.{t}.idx": arr(IDX) for i in range(L) for t in "kv"},
            **{f"turbo.{t}.{p}": arr(L * n) for t in "kv" for p, n in (("mu", MU), ("sink", SINK), ("norm", NORM))},
        },
        "per_layer_tag_60": lambda: {f"{i}.{t}": arr(per_layer_tag) for i in range(L) for t in "kv"},
        "per_layer_30": lambda: {f"{i}": arr(2 * per_layer_tag) for i in range(L)},
        "chunks_16": lambda: {f"c{j}": arr(2 * L * per_layer_tag // 16) for j in range(16)},
        "one_array": lambda: {"all": arr(2 * L * per_layer_tag)},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in layouts(rng).items():
            path = str(Path(tmp) / f"{name}.safetensors")
            arrays = make()
            n, nbytes = len(arrays), sum(a.nbytes for a in arrays.values())
            mx.save_safetensors(path, arrays)
            del arrays
            load, first = [], []
            for _ in range(args.repeat):
                t = time.perf_counter()
                d = mx.load(path)
                mx.eval(list(d.values()))
                t1 = time.perf_counter()
                mx.eval([a.astype(mx.float32).sum() for a in d.values()])
                load.append(t1 - t)
                first.append(time.perf_counter() - t1)
                del d
            row = {
                "layout": name,
                "arrays": n,
                "bytes": nbytes,
                "load_ms": 1e3 * min(load),
                "load_median_ms": 1e3 * sorted(load)[len(load) // 2],
                "first_pass_ms": 1e3 * min(first),
            }
            rows.append(row)
            print(
                f"{name:>18} {n:4d} arrays: load {row['load_ms']:.2f} ms (median "
                f"{row['load_median_ms']:.2f}), first pass {row['first_pass_ms']:.2f} ms",
                flush=True,
            )
    device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
    print("wrote", write(args.name or f"mxload_layouts_{device}", {"rows": rows}))


if __name__ == "__main__":
    main()
