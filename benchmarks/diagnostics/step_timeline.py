"""Where one decode step's time goes on a CUDA GPU: host graph building, kernels, gaps.

`attend.py` times a step from the host. This script records the GPU's own timeline of the same
pipelined bursts (30 steps issued back to back, one final eval) through torch's profiler (CUPTI
sees every kernel of the process, MLX's included), and reports per method and length:

- wall_ms: the burst's wall time per step (what `attend.py` calls pipelined);
- build_ms: host time per step to build the step's graph (the Python call, no evaluation);
- gpu_busy_ms: the union of kernel intervals per step (GPU work; the rest of wall is idle GPU,
  i.e. the host or launch latency bounds the step);
- kernels: per kernel name, launches per step and mean duration.

Methods: fp16 SDPA (MLX), the tq4 step (tensor-core kernel), the tq4 step with the portable
kernel; and `layers32_*`: 32 layer-like calls per evaluation (what one token of a 32-layer model
issues), per call; `answer_*`: a layer's step while answering (cache update and attention).

CUDA only (torch with CUDA on the machine). Usage:
    python benchmarks/diagnostics/step_timeline.py [--lengths 4096 32768 131072]
        [--methods fp16_sdpa fused_tq4 answer_fp16 answer_tq4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import write  # noqa: E402  (imports longctx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402

import attend  # noqa: E402
from longctx.kvcache.attention import compressed_attention  # noqa: E402


def _short(name: str) -> str:
    for tag in ("lc_decode_attend_mma", "lc_decode_attend", "lc_decode_finish"):
        if tag in name:
            return tag
    return name.split("(")[0][:60]


def timeline(fn, steps: int, per_eval: int = 1) -> dict:
    """One profiled burst of `steps` evaluations of `per_eval` calls of fn each."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def burst():
        outs = []
        t = time.perf_counter()
        for _ in range(steps):
            o = [fn() for _ in range(per_eval)]
            mx.async_eval(o)
            outs.append(o)
        mx.eval(outs)
        return time.perf_counter() - t

    for _ in range(3):
        burst()
    t = time.perf_counter()
    for _ in range(steps * per_eval):
        fn()
    build = (time.perf_counter() - t) / (steps * per_eval)
    mx.eval(fn())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = burst()
        torch.cuda.synchronize()
    ks = trace_kernels(prof)
    calls = steps * per_eval
    return {"wall_ms": 1e3 * wall / calls, "build_ms": 1e3 * build, **summary(ks, calls)}


def answer_step(kind, k, v, q, scale, portable=False):
    """A layer's decode step while answering (its cache update, then attention) after a prefix
    of k / v's tokens and a 16-token question, on a cache of its own: mlx-lm's fp16 KVCache +
    SDPA ("fp16"), or tq4 as `ask` holds it ("tq4": sealed, rebuilt from its arrays, forked;
    its window takes the question and the answer); `portable`: tq4 with the portable kernel."""
    from mlx_lm.models.cache import KVCache

    from longctx.kvcache.presets import get_preset
    from longctx.kvcache.turbo import TurboQuantCache

    question = mx.random.normal((1, k.shape[1], 16, k.shape[3]), key=mx.random.key(1))
    question = question.astype(k.dtype)
    one = mx.random.normal((1, k.shape[1], 1, k.shape[3]), key=mx.random.key(2)).astype(k.dtype)
    if kind == "fp16":
        fp16 = KVCache()
        fp16.update_and_fetch(k, v)
        fp16.update_and_fetch(question, question)
        mx.eval(fp16.state, one)

        def fp16_step():
            keys, values = fp16.update_and_fetch(one, one)
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)

        return fp16_step
    preset = get_preset(kind)
    c = TurboQuantCache(preset, 0)
    c.update_and_fetch(k, v)
    c.seal()
    tq = TurboQuantCache.from_arrays(preset, 0, c.arrays(), k.shape[3]).fork(exact_new=1024)
    tq.update_and_fetch(question, question)
    mx.eval(tq.state, one)
    del c

    def tq_step():
        view, _ = tq.update_and_fetch(one, one)
        return (attend._portable if portable else compressed_attention)(q, view, scale)

    return tq_step


def trace_kernels(prof) -> list:
    """[(start us, end us, short name)] of every GPU kernel a torch profiler recorded, in order."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return sorted((e["ts"], e["ts"] + e["dur"], _short(e["name"])) for e in events if e.get("cat") == "kernel" and "dur" in e)


def summary(ks: list, calls: int) -> dict:
    """GPU busy time (the union of kernel intervals), span and per-kernel counts and mean
    durations, per call, of `trace_kernels`' list."""
    busy, end = 0.0, -1.0
    for a, b, _ in ks:
        if b > end:
            busy += b - max(a, end)
            end = b
    names: dict = {}
    for a, b, n in ks:
        c, tot = names.get(n, (0, 0.0))
        names[n] = (c + 1, tot + (b - a))
    return {
        "gpu_busy_ms": busy / 1e3 / calls,
        "gpu_span_ms": (ks[-1][1] - ks[0][0]) / 1e3 / calls if ks else 0.0,
        "launches_per_call": len(ks) / calls,
        "kernels": {
            n: {"per_call": c / calls, "mean_us": tot / c} for n, (c, tot) in sorted(names.items(), key=lambda x: -x[1][1])
        },
    }


def host_profile(fn, calls: int = 3000) -> None:
    import cProfile
    import pstats

    mx.eval(fn())
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 32768, 131072])
    ap.add_argument(
        "--host-profile", action="store_true", help="also cProfile the host's graph building of the tq4 step (top 20)"
    )
    ap.add_argument(
        "--methods",
        nargs="*",
        default=None,
        help="only these rows (e.g. fp16_sdpa fused_tq4 answer_fp16 answer_tq4; each also as its layers32_ row where it has one)",
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--name", default="step_timeline_h200")
    args = ap.parse_args()
    rows = []
    for s in args.lengths:
        env = attend.setup(s, presets=("tq4",), affine=False)
        q, k, v, view, scale = env["q"], env["k"], env["v"], env["tq4"], attend.D**-0.5
        methods = [
            ("fp16_sdpa", lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)),
            ("fused_tq4", lambda: compressed_attention(q, view, scale)),
            ("fused_tq4_portable", lambda: attend._portable(q, view, scale)),
        ]
        # as a model's layer steps while answering: the cache update (one token into the window
        # after a 16-token question) and attention, fp16 vs tq4 (one layer; no layers32 row),
        # each on a cache of its own (its window grows by the calls' tokens); tq4 also with the
        # portable kernel (Metal's)
        methods += [("answer_fp16", ("fp16", False)), ("answer_tq4", ("tq4", False)), ("answer_tq4_portable", ("tq4", True))]
        if args.methods is not None:
            methods = [m for m in methods if m[0] in args.methods]
        for label, fn in methods:
            if isinstance(fn, tuple):
                fn = answer_step(fn[0], k, v, q, scale, portable=fn[1])
            for per_eval, tag in ((1, ""),) + (() if label.startswith("answer_") else ((32, "layers32_"),)):
                r = timeline(fn, args.steps if per_eval == 1 else 4, per_eval)
                rows.append({"S": s, "method": tag + label, **r})
                print(
                    f"S={s:>6} {tag + label:<30} wall {r['wall_ms']:.4f} build "
                    f"{r['build_ms']:.4f} gpu {r['gpu_busy_ms']:.4f} ms  "
                    + ", ".join(f"{n} {x['per_call']:.0f}x{x['mean_us']:.1f}us" for n, x in r["kernels"].items()),
                    flush=True,
                )
        if args.host_profile:
            host_profile(lambda: compressed_attention(q, view, scale))
        del env
    print(f"wrote {write(args.name, {'steps': args.steps, 'rows': rows})}")


if __name__ == "__main__":
    main()
