"""Host time of a kept decode-step plan's call, part by part (GPU; the step's real graph).

A decode step that replays its layer's kept plan (`longctx.kvcache.attend_step.replay`) costs, on
the host: the plan's check (`_Plan.matches`), the window count, and MLX's compiled call itself.
This times each part for the Llama-3.1-8B shapes' tq4 step at one length, and what a compiled
call of one custom-kernel node costs by its outputs and inputs (stand-in kernels built, never
launched). Not evaluated in the timed loops (each loop's outputs are evaluated after it).

Usage: python benchmarks/diagnostics/plan_call.py [--length 4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
import attend  # noqa: E402  (imports longctx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402

from longctx.kernels import decode_step_mma as ds  # noqa: E402
from longctx.kernels import decode_finish as df  # noqa: E402
from longctx.kvcache import attend_step  # noqa: E402
from longctx.kvcache.attention import compressed_attention  # noqa: E402


def us(fn, n: int = 200, reps: int = 9, evaluate: bool = True) -> float:
    ts = []
    for _ in range(reps):
        keep = []
        t = time.perf_counter()
        for _ in range(n):
            keep.append(fn())
        ts.append((time.perf_counter() - t) / n)
        if evaluate:
            mx.eval([k for k in keep if isinstance(k, mx.array)])
    return round(1e6 * statistics.median(ts), 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    args = ap.parse_args()
    env = attend.setup(args.length, presets=("tq4",), affine=False)
    q, view, scale = env["q"], env["tq4"], attend.D**-0.5
    for _ in range(2):  # a key's first step traces; the next keeps the compiled plan
        mx.eval(compressed_attention(q, view, scale))
    p = view.plan[0]
    rows = {"sdpa_fp16_us": us(lambda: mx.fast.scaled_dot_product_attention(q, env["k"], env["v"], scale=scale))}
    rows["step_replay_us"] = us(lambda: attend_step.replay(q, view, scale))
    rows["matches_us"] = us(lambda: p.matches(q, view, scale))
    rows["count_us"] = us(lambda: df.count(0))
    rows["env_us"] = us(attend_step._env)
    n0 = ds.counter(p.heads)
    rows["compiled_call_us"] = us(lambda: p.fn(q, *p.args, df.count(0), p.mean, n0)[0])
    # a compiled call of one custom-kernel node of n_out outputs over n_in inputs (stand-ins of
    # the step kernel's outputs and ~17 inputs; built, never launched)
    if hasattr(mx.fast, "cuda_kernel") and mx.cuda.is_available():
        x = mx.ones((20, 4))
        mx.eval(x)
        parts = [x[i] for i in range(20)]
        mx.eval(parts)
        for n_out, n_in in ((5, 17), (3, 17), (2, 17), (3, 9)):
            k = mx.fast.cuda_kernel(
                name=f"lc_stand_in_{n_out}_{n_in}",
                input_names=[f"i{j}" for j in range(n_in)],
                output_names=[f"o{j}" for j in range(n_out)],
                source="o0[0] = i0[0];",
            )
            node = mx.compile(
                lambda *ins, k=k, n_out=n_out: k(
                    inputs=list(ins),
                    grid=(32, 1, 1),
                    threadgroup=(32, 1, 1),
                    output_shapes=[(4,)] * n_out,
                    output_dtypes=[mx.float32] * n_out,
                )
            )
            ins = parts[:n_in]
            node(*ins)  # (the trace)
            rows[f"kernel_node_{n_out}out_{n_in}in_us"] = us(lambda node=node, ins=ins: node(*ins)[0], evaluate=False)
    rows["reshape_us"] = us(lambda: q.reshape(-1))
    print({"length": args.length, **rows})


if __name__ == "__main__":
    main()
