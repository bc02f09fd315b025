"""Where an answer token's time goes on a CUDA GPU: host graph building, kernels, idle GPU.

`answer_shapes.py` times answers from the host. This script records the GPU's own timeline of
answer tokens after a long cached prefix (torch's profiler: CUPTI sees MLX's kernels), fp16
cache vs compressed, on a random-weight model of a real shape, and reports per token:

- wall_ms: the token's wall time in a decode loop that queues each token's successor before
  reading it (`engine.token_stream`'s loop);
- build_ms: host time of the model call (graph building; the rest of the host's time is MLX's
  evaluation: encoding the launches);
- gpu_busy_ms: the union of kernel intervals (the rest of wall is idle GPU: the host bounds it);
- launches per token and, per kernel name, launches per token and mean duration (top 30).

The prefix is prefilled and, for compressed caches, sealed, rebuilt from its arrays and forked,
as `ask` runs; then a 16-token question and the profiled tokens.

The timeline needs torch with CUDA; without it (a CPU machine) the rows hold wall and build only.
Usage:
    python benchmarks/diagnostics/answer_timeline.py [--shape llama-3.1-8b] [--bits 4] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import write  # noqa: E402  (imports longctx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402
from answer_shapes import prefilled  # noqa: E402
from shapes import random_model  # noqa: E402
from step_timeline import summary, trace_kernels  # noqa: E402

from longctx import kvcache  # noqa: E402

QUESTION = 16


def decode(model, cache, question: list[int], n: int) -> tuple[float, float]:
    """(wall s, model-call s) of n answer tokens after the question, each queued before the
    previous one is read (the question's own pass is not counted)."""

    def step(ids):
        return mx.argmax(model(ids, cache=cache)[:, -1, :], axis=-1)

    build = 0.0
    y = step(mx.array(question, dtype=mx.int32)[None])
    mx.async_eval(y)
    mx.eval(y)
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        nxt = step(y.reshape(1, 1))
        build += time.perf_counter() - t
        mx.async_eval(nxt)
        y.item()
        y = nxt
    y.item()
    return time.perf_counter() - t0, build


def _profiler():
    """(start, stop -> summary of n tokens) of torch's CUDA profiler, or None without torch."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    state = {}

    def start():
        torch.cuda.synchronize()
        state["p"] = profile(activities=[ProfilerActivity.CUDA])
        state["p"].__enter__()

    def stop(n):
        torch.cuda.synchronize()
        state["p"].__exit__(None, None, None)
        return summary(trace_kernels(state["p"]), n)

    return start, stop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768])
    ap.add_argument("--kv", nargs="+", default=["fp16", "tq4"])
    ap.add_argument("--answer", type=int, default=32, help="profiled tokens per row")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument(
        "--host-profile", action="store_true", help="also cProfile the model calls of one more answer (top 25 by own time)"
    )
    ap.add_argument("--name", default="answer_timeline_h200")
    args = ap.parse_args()
    model, _ = random_model(args.shape, bits=args.bits)
    profiler = _profiler()
    rows = []
    for n in args.tokens:
        ids = mx.random.randint(0, 32000, (n,)).tolist()
        question = mx.random.randint(0, 32000, (QUESTION,)).tolist()
        for kv in args.kv:
            cache, _ = prefilled(model, ids, kv)
            for _ in range(2):  # first use (traces, kernel builds), then a warm unprofiled pass
                fork = kvcache.fork(cache)
                wall0, build0 = decode(model, fork, question, args.answer)
                del fork
            fork = kvcache.fork(cache)
            s = {"gpu_busy_ms": float("nan"), "launches_per_call": float("nan"), "kernels": {}}
            if profiler:
                profiler[0]()
            wall, build = decode(model, fork, question, args.answer)
            if profiler:
                s = profiler[1](args.answer)
            s["kernels"] = dict(list(s["kernels"].items())[: args.top])
            if args.host_profile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                decode(model, kvcache.fork(cache), question, args.answer)
                prof.disable()
                print(f"-- host profile: {kv}, {n} cached tokens", flush=True)
                pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
            row = {
                "shape": args.shape,
                "weights": f"{args.bits}-bit" if args.bits else "bf16",
                "tokens": n,
                "kv": kv,
                "answer_tokens": args.answer,
                "tok_s_unprofiled": args.answer / wall0,
                "unprofiled_wall_ms": 1e3 * wall0 / args.answer,
                "unprofiled_build_ms": 1e3 * build0 / args.answer,
                "wall_ms": 1e3 * wall / args.answer,
                "build_ms": 1e3 * build / args.answer,
                **s,
            }
            rows.append(row)
            print(
                f"{n:>6} {kv:>6}: {row['tok_s_unprofiled']:6.1f} tok/s; per token wall "
                f"{row['wall_ms']:.2f} build {row['build_ms']:.2f} gpu busy "
                f"{row['gpu_busy_ms']:.2f} ms, {row['launches_per_call']:.0f} launches",
                flush=True,
            )
            for name, k in list(s["kernels"].items())[:15]:
                print(f"      {k['per_call']:>6.1f} x {k['mean_us']:>8.1f} us  {name}")
            del cache, fork
            gc.collect()
            mx.clear_cache()
    print(f"wrote {write(args.name, {'question_tokens': QUESTION, 'rows': rows})}")


if __name__ == "__main__":
    main()
