"""Host time of a kept decode-step plan's call, part by part (GPU; the step's real graph).

A decode step that replays its layer's kept plan (`longctx.kvcache.attend_step.replay`) costs, on
the host: the plan's check (`_Plan.matches`), the window count, and the call itself: MLX's
compiled call, or with the native helper (`longctx.native`) a tape replay. This times each part
for the Llama-3.1-8B shapes' tq4 step at one length, and the tape's parts: converting its input
list (a tape of no nodes over the same inputs) and building its nodes. Not evaluated in the
timed loops (each loop's outputs are evaluated after it).

Usage: python benchmarks/diagnostics/plan_call.py [--length 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
import attend  # noqa: E402  (imports longctx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402

from longctx import native  # noqa: E402
from longctx.kernels import decode_attend_mma as dm  # noqa: E402
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
    q, view, scale = env["q"], env["tq4"], attend.D ** -0.5
    compiled = dataclasses.replace(view, plan=[None])
    with attend.native_off():
        for _ in range(2):
            mx.eval(compressed_attention(q, compiled, scale))
    for _ in range(2):
        mx.eval(compressed_attention(q, view, scale))
    p, c = view.plan[0], compiled.plan[0]
    rows = {"nodes": p.tape.nodes if p.tape is not None else None,
            "constants": p.tape.constants if p.tape is not None else None,
            "inputs": len(p.args) if p.tape is not None else None}
    rows["sdpa_fp16_us"] = us(lambda: mx.fast.scaled_dot_product_attention(
        q, env["k"], env["v"], scale=scale))
    rows["step_replay_us"] = us(lambda: attend_step.replay(q, view, scale))
    rows["step_replay_compiled_us"] = us(lambda: attend_step.replay(q, compiled, scale))
    rows["matches_us"] = us(lambda: p.matches(q, view, scale))
    rows["count_us"] = us(lambda: df.count(0))
    rows["env_us"] = us(attend_step._env)
    n0 = dm.counter(p.heads)
    if p.tape is not None:
        flat = list(p.args)
        flat[0], flat[-3], flat[-1] = q, df.count(0), n0
        rows["tape_replay_us"] = us(lambda: p.tape.replay(flat)[0])
        empty = native.Tape(flat, [flat[0]])
        rows["tape_inputs_only_us"] = us(lambda: empty.replay(flat)[0])
        one = native.Tape([q], [q.reshape(-1)])
        rows["tape_one_node_us"] = us(lambda: one.replay([q])[0])
        # what a node costs by its outputs and inputs (stand-ins of the kernel's 5 and ~17)
        x = mx.ones((20, 4))
        mx.eval(x)
        parts = [x[i] for i in range(20)]
        mx.eval(parts)
        for name, ins, outs in (  # (the tapes' first two outputs, as the step's)
                ("split5", [x], lambda a: mx.split(a[0], 5)),
                ("divmod2", [x, x], lambda a: list(mx.divmod(a[0], a[1]))),
                ("concat20", parts, lambda a: [mx.concatenate(a)]),
                ("concat20_split5", parts, lambda a: mx.split(mx.concatenate(a), 5))):
            t = native.Tape(ins, outs(ins)[:2])
            rows[f"tape_{name}_us"] = us(lambda t=t, ins=ins: t.replay(ins)[0])
        # a custom-kernel node of n_out outputs over n_in inputs (built, never launched)
        if hasattr(mx.fast, "cuda_kernel") and mx.cuda.is_available():
            for n_out, n_in in ((5, 17), (3, 17), (2, 17), (3, 9)):
                k = mx.fast.cuda_kernel(name=f"lc_stand_in_{n_out}_{n_in}",
                                        input_names=[f"i{j}" for j in range(n_in)],
                                        output_names=[f"o{j}" for j in range(n_out)],
                                        source="o0[0] = i0[0];")
                ins = parts[:n_in]
                outs = k(inputs=ins, grid=(32, 1, 1), threadgroup=(32, 1, 1),
                         output_shapes=[(4,)] * n_out, output_dtypes=[mx.float32] * n_out)
                t = native.Tape(ins, outs[-2:])
                rows[f"tape_kernel_{n_out}out_{n_in}in_us"] = us(
                    lambda t=t, ins=ins: t.replay(ins)[0], evaluate=False)
    rows["compiled_call_us"] = us(lambda: c.fn(q, *c.args, df.count(0), c.mean, n0)[0])
    rows["reshape_us"] = us(lambda: q.reshape(-1))
    print({"length": args.length, **rows})


if __name__ == "__main__":
    main()
