"""The shared Metal compile check (../shared/tools/metal_check) with this project's extra launches.

The shared tool drives a fixed launch plan (the kernels it was written for). Kernels added since
are appended here to that plan, through the same recording executor, so their Metal source is
built and compiled exactly as the tool does for the others. Same arguments as the tool:

    .venv/bin/python scripts/metal_check.py . --hypothetical [--full]

What the shared tool would need to cover them itself: the calls in `extra_launches` added to its
`enumerate_launches`.

`lc_decode_attend_mma` (kernels/decode_attend_mma.py) is reported NOT EXERCISED by design: it is
CUDA only, and under the Metal backend the decode step launches `lc_decode_attend_simdgroup` (4-bit
keys and values, P = 64 / 128) or the portable `lc_decode_attend`, which this plan covers. Its CUDA
source is compiled by nvcc and run by the CPU emulator in tests/test_kernels_emulated.py.

The shared tool's shim does not model MSL's simdgroup matrices (`simdgroup_half8x8`,
`simdgroup_load`, `simdgroup_multiply_accumulate`, ...): `metal_simdgroup_shim.h` beside this
script declares them (address spaces, element types, 8x8), and the tool is pointed at a shim
that includes its own and then that one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "shared" / "tools" / "metal_check" / "metal_check.py"


def extra_launches(tool, full: bool) -> list:
    """(origin, spec, launch) of what the shared plan does not launch: lc_dequant, the decode
    step's lc_decode_finish and lc_decode_attend with the q rotation inside (ROTQ), and the
    fused prefill chunk's lc_prefill_encode and lc_rotate."""
    import mlx.core as mx

    from longctx.kernels import _prelude
    from longctx.kernels import dequant as dq
    from longctx.kvcache.presets import PRESETS

    rec = tool.Recorder()
    widths = sorted(
        {(p.key_bits, p.key_bits2) for p in PRESETS.values() if p.kind == "turbo"}
        | {(p.value_bits, 0) for p in PRESETS.values() if p.kind == "turbo"}
    )
    lengths = (1, 2, 17, 4096) if full else (1, 4096)
    with _prelude.executor(rec, as_backend="metal"):
        for b1, b2 in widths:
            for p in (64, 128, 256):
                for hkv in (1, 3, 8):
                    for length in lengths:
                        for exact in (False, True):
                            rec.origin = f"dequant b={b1}+{b2} P={p} H={hkv} L={length} exact={exact}"
                            enc = {
                                "idx": mx.zeros((1, hkv, length, b1 * p // 32), dtype=mx.uint32),
                                "norm": mx.zeros((1, hkv, length), dtype=mx.float16),
                            }
                            if b2:
                                enc["idx2"] = mx.zeros((1, hkv, length, b2 * p // 32), dtype=mx.uint32)
                            rows = (lambda n: mx.zeros((1, hkv, n, p), dtype=mx.float16)) if exact else None
                            dq.dequant(
                                enc,
                                mx.zeros((1 << (b1 + b2),)),
                                bits=b1,
                                bits2=b2,
                                p=p,
                                head=rows(4) if rows else None,
                                after=rows(640) if rows else None,
                            )
        # The two-launch decode step (attend_step): decode_attend with the q rotation inside,
        # then decode_finish, for the shipped and the 8B shapes, every query dtype, with and
        # without sink and window.
        from longctx.kvcache import attend_step
        from longctx.kvcache.presets import get_preset
        from longctx.kvcache.turbo import CompressedKV, codecs_for

        names = [n for n, p in PRESETS.items() if p.kind == "turbo"]
        for name in names:
            for hkv, r, p in ((3, 3, 64), (8, 4, 128), (1, 4, 256), (2, 16, 64), (1, 1, 32)):
                kc, vc = codecs_for(get_preset(name), p, layer=0)
                if kc.rvq is not None or kc.spec.qjl:
                    continue
                seg = lambda bits: {
                    "idx": mx.zeros((1, hkv, 4096, bits * p // 32), dtype=mx.uint32),
                    "norm": mx.zeros((1, hkv, 4096), dtype=mx.float16),
                }
                for exact in (False, True):
                    rows = lambda n, dt: (mx.zeros((1, hkv, n, p), dtype=dt),) * 2
                    view = CompressedKV(
                        kc,
                        vc,
                        ((seg(kc.spec.bits), seg(vc.spec.bits), 4096),),
                        4100,
                        mx.zeros((1, hkv, 1, p)),
                        rows(9, mx.float32) if exact else None,
                        rows(4, mx.float16) if exact else None,
                    )
                    for dt in (mx.float16, mx.bfloat16, mx.float32):
                        rec.origin = f"decode step {name} P={p} H={hkv} r={r} exact={exact} {dt}"
                        attend_step.attention(mx.zeros((1, hkv * r, 1, p), dtype=dt), view, 0.1)
        # The fused prefill chunk (kernels/prefill_encode.py, kernels/rotate.py): every scalar
        # width, dim and model dtype, with and without the window's rows and the old buffer.
        from longctx.kernels import prefill_encode as pe
        from longctx.kernels import rotate as rt

        for bits in sorted(
            {p.key_bits for p in PRESETS.values() if p.kind == "turbo"}
            | {p.value_bits for p in PRESETS.values() if p.kind == "turbo"}
        ):
            for p in (64, 128, 256):
                for hkv in (1, 3, 8):
                    for dt in (mx.float16, mx.bfloat16, mx.float32):
                        for held in (False, True):
                            rec.origin = f"prefill_encode b={bits} P={p} H={hkv} {dt} held={held}"
                            wd = bits * p // 32
                            pe.prefill_encode(
                                mx.zeros((1, hkv, 512, p), dtype=dt),
                                mx.zeros((1, hkv, 1, p)),
                                mx.ones((p,)),
                                mx.zeros(((1 << bits) - 1,)),
                                mx.zeros((1, hkv, 128, p), dtype=mx.float16) if held else None,
                                mx.zeros((1, hkv, 4096, wd), dtype=mx.uint32) if held else None,
                                mx.zeros((1, hkv, 4096), dtype=mx.float16) if held else None,
                            )
        for p in (64, 128, 256):
            for hkv, r in ((1, 4), (3, 3), (8, 4)):
                for dt in (mx.float16, mx.bfloat16, mx.float32):
                    rec.origin = f"rotate P={p} H={hkv} r={r} {dt}"
                    x = mx.zeros((1, hkv * r, 512, p), dtype=dt)
                    rt.rotate(x, mx.ones((p,)))
                    rt.rotate(x.astype(mx.float16), mx.ones((p,)), inverse=True, mean=mx.zeros((1, hkv, 1, p)), out_dtype=dt)
        # The simdgroup-matrix decode step (kernels/decode_attend_simdgroup.py, which the decode
        # step above launches at tq4 and P = 64 / 128), at every row count it takes, and its
        # fallback, the portable kernel, at the same shapes (with and without the exact tokens).
        from longctx.kernels import decode_attend as da
        from longctx.kernels import decode_attend_simdgroup as ds

        for p in ds.DIMS:
            for r in range(1, ds.MAX_ROWS + 1) if full else (1, 3, 4, 8):
                for hkv, length in ((1, 1), (1, 17), (8, 4096)) if full else ((1, 1), (8, 4096)):
                    seg = {
                        "idx": mx.zeros((1, hkv, length, p // 8), dtype=mx.uint32),
                        "norm": mx.zeros((1, hkv, length), dtype=mx.float16),
                    }
                    for dt in (mx.float16, mx.bfloat16, mx.float32):
                        rec.origin = f"decode_attend_simdgroup P={p} H={hkv} r={r} L={length} {dt}"
                        q = mx.zeros((1, hkv, r, p), dtype=dt)
                        ds.decode_attend_simdgroup_partials(q, seg, seg, mx.zeros((16,)), mx.ones((p,)), scale=0.1)
                        rec.origin = f"decode_attend_partials tq4 P={p} H={hkv} r={r} L={length} {dt}"
                        rows = (mx.zeros((1, hkv, 4, p)),) * 2
                        for exact in (False, True):
                            da.decode_attend_partials(
                                q,
                                seg,
                                seg,
                                mx.zeros((16,)),
                                mx.zeros((16,)),
                                mx.ones((p,)),
                                key_bits=4,
                                value_bits=4,
                                scale=0.1,
                                sink=rows if exact else None,
                                window=rows if exact else None,
                                v_signs=mx.ones((p,)) if exact else None,
                            )
    return rec.launches


# The shared tool's shim has no model of MSL's simdgroup matrices; this one is included after it.
SIMDGROUP_SHIM = Path(__file__).resolve().parent / "metal_simdgroup_shim.h"


def _with_simdgroup_shim(tool) -> None:
    """Point the tool at a shim that includes its own, then the simdgroup-matrix model."""
    import tempfile

    shim = Path(tempfile.mkdtemp(prefix="metal_check_shim_")) / "metal_shim.h"
    shim.write_text(f'#pragma once\n#include "{tool.SHIM}"\n#include "{SIMDGROUP_SHIM}"\n')
    tool.SHIM = shim


def _short_names(generate_sources, most: int = 200):
    """The tool's `generate_sources` with kernel names past `most` characters shortened (a prefix
    and a hash of the whole), in the name and in the source alike. MLX names a Metal kernel by its
    template values and every input's dtype; the decode step's variant with the exact tokens
    (20 inputs) comes to ~300 characters, past the 255 bytes of a file name, and the tool
    writes each source to a file named after its kernel. MLX itself keeps the library in
    memory under the long name; the compiled text is the same but for the function's name."""
    import hashlib

    def wrapped(variants, verify):
        mismatches = generate_sources(variants, verify)
        for v in variants:
            if len(v.kernel_name) > most:
                digest = hashlib.sha1(v.kernel_name.encode()).hexdigest()[:16]
                short = f"{v.kernel_name[: most - 17]}_{digest}"
                v.source = v.source.replace(v.kernel_name, short)
                v.kernel_name = short
        return mismatches

    return wrapped


def main(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("metal_check", TOOL)
    tool = importlib.util.module_from_spec(spec)
    sys.modules["metal_check"] = tool
    spec.loader.exec_module(tool)
    planned = tool.enumerate_launches
    tool.enumerate_launches = lambda full: planned(full) + extra_launches(tool, full)
    tool.generate_sources = _short_names(tool.generate_sources)
    _with_simdgroup_shim(tool)
    rc = tool.main(argv)
    print("note: lc_decode_attend_mma is CUDA only (never launched on Metal); see this script's docstring")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
