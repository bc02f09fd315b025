"""The SASS of a decode step's CUDA kernels without a GPU: registers, spills, and the main loop.

Captures the launches one decode step makes (Llama-3.1-8B shapes, tq4, a sink and a window, the
CUDA path, kernels replaced by zeros), compiles each kernel's exact CUDA source for sm_90 with
nvcc (tests/kernel_emu.py's `cuda_source`, MLX's NVRTC source), disassembles it with cuobjdump,
and reports per kernel: registers and spills (ptxas), instructions in all, and for every loop
holding tensor-core MMAs (a backward branch) its length and instruction mix. The smallest such
loop of `lc_decode_step_mma` is the main loop's body per 16-key block.

This counts instructions; it does not time them (`attend.py`, `step_timeline.py` and ncu on a
GPU do). Needs nvcc and cuobjdump (pip: nvidia-cuda-cuobjdump, no GPU needed); `--cuobjdump`
names the binary when it is not on PATH. Usage:
    python benchmarks/diagnostics/sass_loop.py [--kernel lc_decode_step_mma] [--dump out.sass]
                                   [--length 32768]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import environment  # noqa: E402  (imports longctx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402


def _cuobjdump(given: str | None) -> str:
    if given:
        return given
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia  # the pip wheel's namespace package

        for base in nvidia.__path__:
            for cand in Path(base).glob("*/bin/cuobjdump"):
                return str(cand)
    except ImportError:
        pass
    sys.exit("cuobjdump not found: pip install nvidia-cuda-cuobjdump, or pass --cuobjdump")


def launches(length: int = 4096) -> dict:
    """{kernel name: (spec, launch)} of one decode step at 8B shapes over `length` cached
    tokens (from `decode_step_mma.DYNAMIC_MIN_KEYS` the step hands keys out), tq4, on the CUDA
    path."""
    from longctx.kernels import _prelude
    from longctx.kvcache import attend_step
    from longctx.kvcache.presets import get_preset
    from longctx.kvcache.turbo import Paths, TurboQuantCache

    got = {}

    def capture(spec, launch):
        got[spec.name] = (spec, launch)
        return [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]

    preset = get_preset("tq4")
    k = mx.random.normal((1, 8, length, 128)).astype(mx.bfloat16)
    c = TurboQuantCache(preset, 0)
    c.update_and_fetch(k, k)
    c.seal()
    fork = TurboQuantCache.from_arrays(preset, 0, c.arrays(), 128, Paths(compile_under_executor=True)).fork(exact_new=1024)
    fork.update_and_fetch(k[:, :, :16], k[:, :, :16])
    with _prelude.executor(capture, as_backend="cuda"):
        view, _ = fork.update_and_fetch(k[:, :, :1], k[:, :, :1])
        mx.eval(attend_step.attention(mx.zeros((1, 32, 1, 128), dtype=mx.bfloat16), view, 128**-0.5))
    return got


def parse(sass: str) -> list[tuple[int, str]]:
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    return ins


def mma_loops(ins: list) -> list[tuple[int, list]]:
    """(MMAs, body) of every backward branch's range holding MMAs, shortest first."""
    loops, seen = [], set()
    for a, text in ins:
        m = re.search(r"BRA\s+(?:`?\(?\.?L?_?x?_?\d*\)?)?\s*0x([0-9a-f]+)", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= a or target in seen:
            continue
        body = [x for x in ins if target <= x[0] <= a]
        h = sum("HMMA" in t for _, t in body)
        if h:
            seen.add(target)
            loops.append((h, body))
    return sorted(loops, key=lambda x: len(x[1]))


def main() -> None:
    import kernel_emu

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default=None, help="only this kernel (default: every launch)")
    ap.add_argument("--cuobjdump", default=None)
    ap.add_argument("--dump", default=None, help="write the (last) kernel's SASS here")
    ap.add_argument("--length", type=int, default=4096, help="cached tokens (from 32768 the whole step hands keys out)")
    args = ap.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("nvcc not on PATH")
    tool = _cuobjdump(args.cuobjdump)
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    print(f"mlx {environment()['mlx']}, sm_90, nvcc {nvcc.split(',')[-2].strip()}")
    for name, (spec, launch) in launches(args.length).items():
        if args.kernel and name != args.kernel:
            continue
        report = kernel_emu.nvcc_check(spec, launch)
        res = [x.strip() for x in report.splitlines() if "registers" in x or "spill" in x]
        src = kernel_emu.cuda_source(spec, launch)
        cubin = kernel_emu.BUILD / f"c_{hashlib.sha1(src.encode()).hexdigest()[:16]}.cubin"
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        if args.dump:
            Path(args.dump).write_text(sass)
        ins = parse(sass)
        print(f"{name}: {len(ins)} instructions; " + "; ".join(res))
        for h, body in mma_loops(ins)[:4]:
            mix = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body)
            pred = sum(t.startswith("@") for _, t in body)
            print(
                f"  loop at {body[0][0]:#x}: {len(body)} instructions, {h} MMAs, {pred} "
                f"predicated: " + ", ".join(f"{k} {v}" for k, v in mix.most_common(12))
            )


if __name__ == "__main__":
    main()
