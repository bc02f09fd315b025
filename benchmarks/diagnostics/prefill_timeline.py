"""Where a prefill chunk's time goes on a CUDA GPU: host graph building, kernels, idle GPU.

`prefill_shapes.py` times whole prefills from the host. This script records the GPU's own
timeline of a steady prefill (the second of two on the same tokens, as `prefill_shapes.py`'s
steady rate) through torch's profiler (CUPTI sees MLX's kernels), fp16 cache vs compressed, and
reports per chunk:

- wall_ms: the chunk's wall time (graph building + evaluation);
- build_ms: host time inside the model call (graph building, plus any wait `turbo.sync` makes);
- gpu_busy_ms: the union of kernel intervals (the rest of wall is GPU idle: the host bounds it);
- launches and, per kernel name, launches per chunk and mean duration (top 30 by total time).

CUDA only (torch with CUDA on the machine). Usage:
    python benchmarks/diagnostics/prefill_timeline.py [--shapes llama-3.1-8b] [--tokens 8192]
        [--kv fp16 tq4 tq4:token]   (tq4: the GPU's default order, layer-major; :token or
        :layer picks one, `prefill_order`)
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import write  # noqa: E402  (imports longctx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402
from prefill_shapes import prefill_once  # noqa: E402
from shapes import random_model  # noqa: E402
from step_timeline import summary, trace_kernels  # noqa: E402

from longctx import engine, kvcache  # noqa: E402


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "smollm2-135m"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--kv", nargs="+", default=["fp16", "tq4", "tq4:token"])
    ap.add_argument("--chunk", type=int, default=engine.DEFAULT_CHUNK)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--name", default="prefill_timeline_h200")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        model, _ = random_model(shape, bits=0)
        for n in args.tokens:
            ids = mx.random.randint(0, 32000, (n,)).tolist()
            chunks = -(-n // args.chunk)
            for kv in args.kv:
                preset = kvcache.get_preset(kv.split(":")[0])
                order = {"prefill_order": kv.split(":")[1] if ":" in kv else engine.ORDER}
                prefill_once(model, ids, preset, args.chunk, order)  # first run: kernels, cuDNN
                wall0, _, _, build0 = prefill_once(model, ids, preset, args.chunk, order)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    wall, _, _, build = prefill_once(model, ids, preset, args.chunk, order)
                    torch.cuda.synchronize()
                s = summary(trace_kernels(prof), chunks)
                s["kernels"] = dict(list(s["kernels"].items())[: args.top])
                row = {
                    "shape": shape,
                    "tokens": n,
                    "kv": kv,
                    "chunks": chunks,
                    "tokens_per_second_unprofiled": n / wall0,
                    "wall_ms": 1e3 * wall / chunks,
                    "build_ms": 1e3 * build / chunks,
                    "unprofiled_wall_ms": 1e3 * wall0 / chunks,
                    "unprofiled_build_ms": 1e3 * build0 / chunks,
                    **s,
                }
                rows.append(row)
                print(
                    f"{shape:>14} {n:>6} {kv:>6}: {n / wall0:>7.0f} tok/s; per chunk wall "
                    f"{row['wall_ms']:.2f} build {row['build_ms']:.2f} gpu busy "
                    f"{row['gpu_busy_ms']:.2f} ms, {row['launches_per_call']:.0f} launches",
                    flush=True,
                )
                for name, k in list(s["kernels"].items())[:15]:
                    print(f"      {k['per_call']:>6.0f} x {k['mean_us']:>8.1f} us  {name}")
        del model
        gc.collect()
        mx.clear_cache()
    print(f"wrote {write(args.name, {'chunk': args.chunk, 'rows': rows})}")


if __name__ == "__main__":
    main()
