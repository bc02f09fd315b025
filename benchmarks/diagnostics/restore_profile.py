"""Break the restore path's two phases into their parts, to see what bounds each (diagnostic;
benchmarks/diagnostics/restore_phases.py has the phase totals).

Read + verify of a tq4 cache file: the shipped reader (arrays out, checks' wait, first GPU pass
over the arrays); unless --quick, also positional reads only, reads + sha256, reads + sha256 + copy
into MLX, at several thread counts, against `mx.load` (no verification). Question: one layer's
attention over the restored cache, Lq tokens, synchronized and repeated: the shipped
`compressed_attention`, the fused kernel alone, the same attention under `mx.compile`, and fp16
`scaled_dot_product_attention` over the same number of keys.

Usage: python benchmarks/diagnostics/restore_profile.py --tokens 8000 32000 [--model SPEC] [--quick]
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import document_of, setup, write  # noqa: E402

from longctx.runtime.blas import tune_malloc  # noqa: E402

tune_malloc()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from longctx import kvcache, session  # noqa: E402
from longctx.kvcache import attend_blocked, attend_fused, attention  # noqa: E402
from longctx.kvcache.turbo import CompressedKV, Paths, TurboQuantCache  # noqa: E402
from longctx.store import Store  # noqa: E402
from longctx.store import format as fmt  # noqa: E402

QUESTION = "What does the document say about the chief engineer?"


def best(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def read_variants(path: Path, repeat: int) -> dict:
    with fmt.open_cache(path, "x", "x") as r:
        tensors = list(r.header.tensors.values())

        def job(kind):
            def run(group):
                for t in group:
                    buf = r._read(t)  # positional reads into a fresh numpy buffer
                    if kind >= 1:
                        hashlib.sha256(buf).hexdigest()
                    if kind >= 2:
                        mx.eval(mx.array(buf))

            return run

        def threaded(kind, workers):
            groups = [tensors[i::workers] for i in range(workers)]

            def go():
                with ThreadPoolExecutor(workers) as pool:
                    list(pool.map(job(kind), groups))

            return go

        res = {}
        for workers in (1, 4, 8, 16):
            for kind, name in ((0, "pread"), (1, "pread_sha"), (2, "pread_sha_mxarray")):
                res[f"{name}_w{workers}"] = best(threaded(kind, workers), repeat)
        res["reader_arrays"] = best(lambda: mx.eval(list(r.arrays().values())), repeat)
    res["mx_load_unverified"] = best(lambda: mx.eval(list(mx.load(str(path)).values())), repeat)
    big = np.empty(sum(t.nbytes for t in tensors), dtype=np.uint8)
    big[:] = 1
    res["mx_array_one_copy"] = best(lambda: mx.eval(mx.array(big)), repeat)
    res["sha256_one_thread"] = best(lambda: hashlib.sha256(big).hexdigest(), repeat)
    res["bytes"] = int(big.nbytes)
    return res


def reader_paths(path: Path, repeat: int) -> dict:
    """The shipped reader: arrays handed out (checks still running), the checks' wait, then a
    first GPU pass over every array (where CUDA's managed memory migrates to the GPU). Also a
    candidate not shipped: positional reads on 8 threads into numpy, then one `mx.array` copy per
    array (no checks), with its own first GPU pass."""
    parts: dict[str, list] = {}

    def first_pass(arrays) -> float:
        t = time.perf_counter()
        mx.eval([a.astype(mx.float32).sum() for a in arrays])
        return time.perf_counter() - t

    for _ in range(repeat):
        with fmt.open_cache(path, "x", "x") as r:
            t = time.perf_counter()
            arrays, pending = r.arrays_verifying()
            t1 = time.perf_counter()
            pending.wait()
            t2 = time.perf_counter()
            tensors = list(r.header.tensors.values())
            parts.setdefault("read", []).append(t1 - t)
            parts.setdefault("wait", []).append(t2 - t1)
            parts.setdefault("first_gpu_pass", []).append(first_pass(list(arrays.values())))
            del arrays
            t = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                bufs = list(pool.map(r._read, tensors))
            t1 = time.perf_counter()
            arrays = [mx.array(b.view(np.dtype(fmt.DTYPES[t_.dtype][1])).reshape(t_.shape)) for b, t_ in zip(bufs, tensors)]
            mx.eval(arrays)
            t2 = time.perf_counter()
            parts.setdefault("numpy_w8_pread", []).append(t1 - t)
            parts.setdefault("numpy_w8_to_mlx", []).append(t2 - t1)
            parts.setdefault("numpy_w8_first_gpu_pass", []).append(first_pass(arrays))
            del arrays, bufs
    return {k: min(v) for k, v in parts.items()}


def attention_variants(cache: list, head_dim: int, n_q_heads: int, lq: int, repeat: int) -> dict:
    layer = cache[0]
    kv = layer.view()
    B, Hkv = kv.value_mean.shape[:2]
    q = mx.random.normal((B, n_q_heads, lq, head_dim)).astype(mx.float16)
    scale = head_dim**-0.5
    mask = "causal" if lq > 1 else None
    # the question's own tokens as the exact window, as `ask` has them
    win = (mx.random.normal((B, Hkv, lq, head_dim)), mx.random.normal((B, Hkv, lq, head_dim)))
    kv = CompressedKV(kv.key_codec, kv.value_codec, kv.segments, kv.offset + lq, kv.value_mean, win, kv.sink, None)
    res = {}

    for mode in ("0", "1"):
        view = dataclasses.replace(kv, paths=Paths(compile=mode))
        res[f"compressed_attention_compile{mode}"] = best(
            lambda: mx.eval(attention.compressed_attention(q, view, scale, mask=mask)), repeat
        )

    kc, vc = kv.key_codec, kv.value_codec
    q_rot = kc.rotate(q.astype(mx.float32)).reshape(B, Hkv, -1, kc.padded_dim)
    mx.eval(q_rot)
    seg_k, seg_v, length = kv.segments[0]
    tables = (attention.kernel_table(kc), attention.kernel_table(vc))

    def kernel_only():
        mx.eval(attend_blocked._fused_segment(kc, vc, tables, q_rot, None, seg_k, seg_v, scale, lq, None))

    res["fused_segment_only"] = best(kernel_only, repeat)

    segs = [(k, v) for k, v, _ in kv.segments]
    lengths = [n for _, _, n in kv.segments]

    def traced(q, segs, win, sink, mean):
        # the whole function compiled from outside, as a check (its paths eager inside)
        view = CompressedKV(
            kc,
            vc,
            tuple((k, v, n) for (k, v), n in zip(segs, lengths)),
            kv.offset,
            mean,
            tuple(win),
            tuple(sink),
            None,
            paths=Paths(compile="0"),
        )
        return attention.compressed_attention(q, view, scale, mask=mask)

    compiled = mx.compile(traced)
    try:

        def run_compiled():
            mx.eval(compiled(q, segs, list(win), list(kv.sink), kv.value_mean))

        run_compiled()
        res["compiled_attention"] = best(run_compiled, repeat)
        diff = mx.abs(
            compiled(q, segs, list(win), list(kv.sink), kv.value_mean).astype(mx.float32)
            - attention.compressed_attention(q, kv, scale, mask=mask).astype(mx.float32)
        )
        res["compiled_max_abs_diff"] = float(diff.max())
    except Exception as err:  # compile may refuse the custom kernel: record why
        res["compiled_attention_error"] = f"{type(err).__name__}: {err}"

    n = kv.offset
    r = n_q_heads // Hkv
    keys = mx.random.normal((B, Hkv, n, head_dim)).astype(mx.float16)
    values = mx.random.normal((B, Hkv, n, head_dim)).astype(mx.float16)
    mx.eval(keys, values)

    def sdpa():
        mx.eval(mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask))

    res["sdpa_fp16"] = best(sdpa, repeat)
    res["q_heads_per_kv"] = r
    return res


def decode_variants(lm, cache: list, question: list[int], steps: int) -> dict:
    """Seconds to the first token and per later token of a greedy answer, per compile mode."""
    from longctx import engine

    res = {}
    for mode in ("0", "question", "1"):
        attend_fused._COMPILED.clear()
        for attempt in range(2):  # the second run has every kernel built
            fork = kvcache.fork(cache)
            for c in fork:  # the compile mode under test
                if isinstance(c, TurboQuantCache):
                    c.paths = Paths(compile=mode)
            t = time.perf_counter()
            stream = engine.token_stream(lm.model, question, fork, steps + 1)
            next(stream)
            first = time.perf_counter() - t
            t = time.perf_counter()
            n = sum(1 for _ in stream)
            per = (time.perf_counter() - t) / max(n, 1)
        res[f"compile_{mode}"] = {"first_token_s": first, "per_token_s": per, "tokens": n}
    return res


def main() -> None:
    args, home, lm = setup(
        [8000],
        "profile",
        lambda ap: ap.add_argument("--quick", action="store_true", help="only the shipped reader paths and the attention"),
    )
    preset = kvcache.get_preset(args.preset)
    rows = []
    for n in args.tokens:
        doc, prefix, question = document_of(lm, home, n, QUESTION)
        entry = session.ingest(doc, model=args.model, preset=args.preset).entry
        store = Store()
        path = store.cache_path(entry.id)
        row = {"tokens": len(prefix), "preset": args.preset, "file_bytes": path.stat().st_size}
        row["reader_paths"] = reader_paths(path, args.repeat)
        print(n, "reader_paths", row["reader_paths"], flush=True)
        if not args.quick:
            row["read"] = read_variants(path, args.repeat)
        arrays, _ = store.load(entry, lambda m: None)
        store.close()
        cache = kvcache.from_arrays(arrays, lm.model, preset, getattr(mx, lm.dtype))
        mx.eval([c.state for c in cache])
        args_ = lm.model.args
        head_dim = getattr(args_, "head_dim", None) or args_.hidden_size // args_.num_attention_heads
        for lq in (16, 1):
            row[f"attention_lq{lq}"] = attention_variants(cache, head_dim, args_.num_attention_heads, lq, args.repeat * 4)
        if not args.quick:
            row["decode"] = decode_variants(lm, cache, question, 32)
            print(n, "decode", row["decode"], flush=True)
        rows.append(row)
        for part in ("read", "attention_lq16", "attention_lq1"):
            if part not in row:
                continue
            print(n, part, {k: (round(v * 1e3, 2) if isinstance(v, float) else v) for k, v in row[part].items()}, flush=True)
        del cache, arrays
    device = "cpu" if lm.dtype == "float32" else "gpu"
    out = write(
        args.name or f"restore_profile_{device}",
        {"model": lm.ref.model_id, "model_spec": args.model, "dtype": lm.dtype, "rows": rows},
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
