"""How long NVRTC takes to compile each kernel a CUDA answer launches, measured on any machine.

MLX's `mx.fast.cuda_kernel` compiles its kernels with NVRTC in every process: MLX keeps the PTX
of its own kernels on disk (`MLX_PTX_CACHE_DIR`), but builds custom kernels with that cache off
(mlx 0.32 `CustomKernel::eval_gpu`, `get_jit_module(..., false)`), so a fresh `longctx ask` on
a CUDA GPU compiles every kernel its question and first tokens launch (`first_step.py` times that
on the GPU). NVRTC needs no GPU: this script records the distinct launches of a 16-token question
and two decode steps over a compressed cache (Llama-3.1-8B's attention shape; the whole step
static and handing out keys, as the library runs it below and from
`decode_step_mma.DYNAMIC_MIN_KEYS` keys: a cache of each length) with the
GPU code paths and a stand-in executor, then compiles each one's exact source (MLX's signature
around the kernel body, MLX's device header stubbed: `tests/kernel_emu.py`) for sm_90 and times
it.

Needs NVRTC and the CUDA headers (pip: nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12,
nvidia-cuda-cccl-cu12; unpacked anywhere, given as --nvidia, the folder holding their `nvidia/`).
Usage:
    python benchmarks/diagnostics/nvrtc_compile.py --nvidia /tmp/nv [--name nvrtc_compile_cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from _common import write  # noqa: E402  (imports longctx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402

from longctx.kernels import _prelude  # noqa: E402
from longctx.kernels import decode_step_mma as ds  # noqa: E402
from longctx.kvcache import get_preset  # noqa: E402
from longctx.kvcache.attention import compressed_attention  # noqa: E402
from longctx.kvcache.turbo import TurboQuantCache  # noqa: E402

H, HQ, D, QUESTION = 8, 32, 128, 16


def launches() -> list:
    """(spec, launch) of each distinct launch of a question and two steps, the whole step
    static and handing out keys."""
    from decode_host import _zeros

    seen: dict = {}

    def record(spec, launch):
        key = (
            spec.name,
            spec.header,
            spec.source,
            tuple(launch.template),
            tuple((a.dtype, a.ndim > 0) for a in launch.inputs),
            tuple(launch.output_dtypes),
        )
        seen.setdefault(key, (spec, launch))
        return _zeros(spec, launch)

    preset = get_preset("tq4")
    with _prelude.executor(record, as_backend="cuda"):
        for length in (4096, ds.DYNAMIC_MIN_KEYS):  # the whole step static, then handing out
            c = TurboQuantCache(preset, 0)
            kv = mx.random.normal((1, H, length, D)).astype(mx.bfloat16)
            c.update_and_fetch(kv, kv)
            c.seal()
            fork = TurboQuantCache.from_arrays(preset, 0, c.arrays(), D).fork(exact_new=1024)
            for lq in (QUESTION, 1, 1):
                k = mx.random.normal((1, H, lq, D)).astype(mx.bfloat16)
                q = mx.random.normal((1, HQ, lq, D)).astype(mx.bfloat16)
                view, _ = fork.update_and_fetch(k, k)
                compressed_attention(q, view, D**-0.5, mask="causal" if lq > 1 else None)
    return list(seen.values())


def main() -> None:
    import kernel_emu

    ap = argparse.ArgumentParser()
    ap.add_argument("--nvidia", required=True, help="folder holding nvidia/cuda_nvrtc, nvidia/cuda_runtime, nvidia/cuda_cccl")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--name", default="nvrtc_compile_cpu")
    args = ap.parse_args()
    nv = Path(args.nvidia) / "nvidia"
    lib = next((nv / "cuda_nvrtc" / "lib").glob("libnvrtc.so.*"), None)
    if lib is None:
        sys.exit(f"nvrtc_compile: no libnvrtc.so.* under {nv / 'cuda_nvrtc' / 'lib'}")
    rows = []
    for spec, launch in launches():
        name = spec.name
        t = time.perf_counter()
        kernel_emu.nvrtc_check(
            spec,
            launch,
            str(lib),
            cccl_include=str(nv / "cuda_cccl" / "include"),
            cuda_include=str(nv / "cuda_runtime" / "include"),
            arch=args.arch,
        )
        seconds = time.perf_counter() - t
        template = {k: (v if isinstance(v, (int, bool)) else str(v)) for k, v in launch.template}
        rows.append({"kernel": name, "template": template, "seconds": seconds})
        print(f"{name:24s} {seconds:6.2f} s  {template}", flush=True)
    total = sum(r["seconds"] for r in rows)
    print(f"{len(rows)} kernels, {total:.2f} s")
    write(args.name, {"arch": args.arch, "nvrtc": lib.name, "rows": rows, "total_seconds": total})


if __name__ == "__main__":
    main()
