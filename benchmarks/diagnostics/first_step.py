"""What a fresh process pays the first time it attends a compressed cache of a given length on
a CUDA GPU: MLX compiles each kernel source with NVRTC on its first launch in a process. It keeps
the compiled code of its own kernels in a cache directory (`MLX_PTX_CACHE_DIR`) that later
processes load, but does not write that of custom kernels (`mx.fast.cuda_kernel`, all of
longctx's); longctx writes those files itself (`runtime/cuda_kernels`), where MLX reads them.

For each length, fresh processes in turn share one new, empty cache directory (`RUNS`: the first
finds it cold and fills it, the next ones find it warm, with longctx's kernel files off, as
before them, or on). Each builds a one-layer compressed cache of Llama-3.1-8B's attention shape
(8 KV heads, 32 query heads, d = 128) from random keys and values, seals and forks it as `ask`
does, then times, evaluated one at a time: a 16-token question's attention (the fused compiled
path), the first answer token's decode step, and the second one's. Lengths below
`decode_attend_mma.DYNAMIC_MIN_KEYS` run the static whole-step kernel, lengths from it the one
that hands out keys: two kernel sources. The stepwise rows feed the question one token at a
time instead (`question_stepwise`, `engine.stepwise`: the decode step's kernel only, not the
decode-attend kernel and the split combine a batched question launches).

Usage: python benchmarks/diagnostics/first_step.py [--lengths 16384 131072] [--name first_step_h100]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import device_kind, write  # noqa: E402

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[2])
import _common  # noqa: F401  (longctx first)
import mlx.core as mx
from longctx.kvcache import get_preset
from longctx.kvcache.attention import compressed_attention
from longctx.kvcache.turbo import TurboQuantCache
from longctx.runtime import cuda_kernels
L, H, HQ, D = int(sys.argv[1]), 8, 32, 128
stepwise = sys.argv[3] == "stepwise"
if sys.argv[4] != "1":  # longctx's kernel files off
    cuda_kernels.disable()
preset = get_preset("tq4")
mx.random.seed(0)
c = TurboQuantCache(preset, 0)
for lo in range(0, L, 8192):
    n = min(8192, L - lo)
    kv = mx.random.normal((1, H, n, D)).astype(mx.bfloat16)
    c.update_and_fetch(kv, kv)
    mx.eval(c.state)
c.seal()
mx.eval(c.state)
fork = TurboQuantCache.from_arrays(preset, 0, c.arrays(), D).fork(exact_new=1024)
out = {}

def timed(name, lq, times=1):  # `times` calls of lq tokens each, evaluated one by one
    total = 0.0
    for _ in range(times):
        k = mx.random.normal((1, H, lq, D)).astype(mx.bfloat16)
        q = mx.random.normal((1, HQ, lq, D)).astype(mx.bfloat16)
        mx.eval(k, q)
        t = time.perf_counter()
        view, _ = fork.update_and_fetch(k, k)
        mx.eval(compressed_attention(q, view, D ** -0.5, mask="causal" if lq > 1 else None))
        total += time.perf_counter() - t
    out[name] = total

if stepwise:  # the question's 16 tokens one at a time, timed together
    timed("question_s", 1, 16)
else:
    timed("question_s", 16)
timed("first_step_s", 1)
timed("second_step_s", 1)
out["kernel_file_stats"] = {k: cuda_kernels.STATS[k] for k in ("hit", "write", "skip", "last_skip")}
out["kernel_file_stats"]["compile_s"] = round(cuda_kernels.STATS["compile_s"], 3)
print(json.dumps(out))
"""


# (MLX's PTX folder, longctx's compiled-kernel files, question): the first process finds the
# folder empty and fills it (MLX its own kernels, longctx its files: `runtime/cuda_kernels`); the
# next ones find it warm, with the files off (MLX compiles longctx's kernels, as before them) or
# on (MLX loads them)
RUNS = (
    ("cold", True, "batched"),
    ("warm", False, "batched"),
    ("warm", True, "batched"),
    ("warm", False, "stepwise"),
    ("warm", True, "stepwise"),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 131072])
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parents[1])  # benchmarks/ (_common), for the child
    rows = []
    for length in args.lengths:
        with tempfile.TemporaryDirectory(prefix="lc-ptx-") as ptx, tempfile.TemporaryDirectory(prefix="lc-ptx-mlx-") as mlx_only:
            for run, files, question in RUNS:
                if run == "warm" and not any(Path(mlx_only).iterdir()):
                    # MLX reads any file in its folder, longctx's too: the rows with the files
                    # off get a copy of the warm folder holding MLX's own kernels only
                    for f in Path(ptx).iterdir():
                        if f.is_file() and not f.name.startswith("custom_kernel_lc_"):
                            shutil.copy2(f, Path(mlx_only) / f.name)
                env = dict(os.environ, MLX_PTX_CACHE_DIR=ptx if files else mlx_only)
                p = subprocess.run(
                    [sys.executable, "-c", CHILD, str(length), here, question, "1" if files else "0"],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if p.returncode:
                    sys.exit(f"first_step: the child failed at {length}:\n{p.stderr[-2000:]}")
                r = {
                    "length": length,
                    "ptx_cache": run,
                    "kernel_files": files,
                    "question": question,
                    **json.loads(p.stdout.strip().splitlines()[-1]),
                }
                rows.append(r)
                print(
                    f"L={length:>7} {run} files={'on ' if files else 'off'} {question:>8}: "
                    f"question {r['question_s']:.3f} s, first step {r['first_step_s']:.3f} s, "
                    f"second {r['second_step_s']:.4f} s  {r['kernel_file_stats']}",
                    flush=True,
                )
    write(args.name or f"first_step_{device_kind()}", {"rows": rows})


if __name__ == "__main__":
    main()
