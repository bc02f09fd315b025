"""One decode step of attention over a long cache: fp16 SDPA vs quantized caches vs the fused kernel.

Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, batch 1, one query token)
at S = 4k, 8k, 32k, 128k cached tokens. Methods, all measured in one run:

- fp16_sdpa:        mx.fast.scaled_dot_product_attention on fp16 K/V;
- mlxlm_qsdpa_a8/a4: mlx-lm's quantized_scaled_dot_product_attention (affine, group 64);
- dequant_sdpa_a8/a4: mx.dequantize of the affine cache, then SDPA;
- dequant_sdpa_tq4/tq3: our cache decoded to fp16 (rotated frame), SDPA, rotated back;
- fused_tq4/tq3/...: `compressed_attention` on the GPU, the whole step: for scalar presets two
  launches (`attend_step`: the decode-attend kernel rotating q itself, then `decode_finish`:
  split merge, rotation back, exact tokens, value mean); the others the compiled fused path;
  (on CUDA fused_tq4 is one launch: `decode_step_mma.decode_step_mma`, the last threadgroup per
  KV head finishing the step);
- fused_tq4_portable / answer_tq4_portable: the two-launch step with the portable
  decode-attend kernel (the one Metal runs) instead of the tensor-core one
  (`attend_step.attention(..., tensor_cores=False)`);
- answer_tq4: the tq4 step while answering (a sink and a 256-token window as well);
- compiled_tq4: the compiled fused path for tq4 (rotate q, kernel, split merge, rotate back, add
  the value mean as separate launches under mx.compile; `fused_step=False`);
- kernel_tq4/tq3: the two kernels alone (decode_attend + split_combine) on a rotated query.

Timing: `sync` is the median wall time of a step followed by mx.eval (what the anchors in
shared/ANCHORS.md report; ~0.1 ms is the floor there); `pipelined` is the time per step of 30
steps issued back to back with mx.async_eval and one final eval (a decode loop's steady state).
GB/s counts the bytes of the cache representation the method reads (fp16 K/V, packed words +
norms, affine words + scales + biases), not what a method writes in between. (The kernels'
variant sweeps, module globals set around timings, are gone: their rows are in git history.)

Other shapes: `--heads 28 4` (Qwen2.5-7B: 7 query rows per KV head; results under another
`--name`, e.g. attend_h200_qwen2.5-7b).

Usage: python benchmarks/attend.py [--lengths 4096 8192 32768 131072] [--heads 32 8] [--name attend_h200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write  # noqa: E402  (imports longctx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402

from longctx.kernels import _prelude  # noqa: E402
from longctx.kernels import decode_attend as da  # noqa: E402
from longctx.kernels import decode_attend_mma as dm  # noqa: E402
from longctx.kernels import decode_step_mma as ds  # noqa: E402
from longctx.kvcache import attend_step  # noqa: E402
from longctx.kvcache.attention import compressed_attention, kernel_table  # noqa: E402
from longctx.kvcache.presets import get_preset  # noqa: E402
from longctx.kvcache.turbo import CompressedKV, codecs_for  # noqa: E402

HQ, HKV, D, B = 32, 8, 128, 1
TQ = ("tq4", "tq3", "tq3+qjl", "rvq2+2")
PEAK_GBS = 4800.0
ANCHORS_MS = {
    "fp16_sdpa": {4096: 0.102, 8192: 0.095, 32768: 0.130, 131072: 0.221},
    "mlxlm_qsdpa_a8": {4096: 0.186, 8192: 0.208, 32768: 0.585, 131072: 2.453},
    "mlxlm_qsdpa_a4": {4096: 0.194, 8192: 0.345, 32768: 0.816, 131072: 2.974},
    "dequant_sdpa_a8": {4096: 0.148, 8192: 0.163, 32768: 0.391, 131072: 1.303},
    "dequant_sdpa_a4": {4096: 0.117, 8192: 0.151, 32768: 0.339, 131072: 0.908},
}


def sync_ms(fn, warmup=10, iters=60) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def pipelined_ms(fn, steps=30, reps=7) -> float:
    def burst():
        outs = []
        t = time.perf_counter()
        for _ in range(steps):
            o = fn()
            mx.async_eval(o)
            outs.append(o)
        mx.eval(outs)
        return (time.perf_counter() - t) / steps

    burst()
    return 1e3 * statistics.median(burst() for _ in range(reps))


def alternating(fns: dict, rounds: int, steps: int = 30) -> dict:
    """name -> each round's pipelined ms (`pipelined_ms`, one burst of `steps`), the functions
    timed in turn every round, so that drift in the machine's state falls on all of them alike."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(pipelined_ms(fn, steps=steps, reps=1))
    return times


def per_round(times: dict, name: str) -> list:
    """fp16 SDPA's time over `name`'s in each round of `alternating`, sorted."""
    return sorted(a / b for a, b in zip(times["fp16_sdpa"], times[name]))


def head_to_head(env, rounds: int = 9) -> dict:
    """fp16 SDPA and the tq4 step (the default path) timed in alternating pipelined bursts, right
    after the length's setup, so that both see the same host and GPU state (the method loop
    below times each method once, one after another: its tq4 rows have swung by 1.6x between
    runs at 8k-32k while fp16's held). Also, per tq4 step: the host time to build it (the Python
    call, not evaluated), the kept plan's compiled call alone, and how many of the timed steps
    replayed the layer's kept plan (`attend_step.replay`; a step that does not takes the path
    choice)."""
    from longctx.kernels import decode_finish as df
    from longctx.kvcache import attend_step

    q, k, v, view, scale = env["q"], env["k"], env["v"], env["tq4"], D**-0.5
    fns = {
        "fp16_sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
        "fused_tq4": lambda: compressed_attention(q, view, scale),
    }
    replay, hits = attend_step.replay, [0, 0]

    def counted(*a):
        out = replay(*a)
        hits[out is not None] += 1
        return out

    attend_step.replay = counted
    try:
        for fn in fns.values():
            mx.eval(fn())
        times = alternating(fns, rounds)
        build = []
        for _ in range(5):
            t = time.perf_counter()
            outs = [fns["fused_tq4"]() for _ in range(30)]
            build.append((time.perf_counter() - t) / 30)
            mx.eval(outs)
        # of that, the kept plan's compiled call alone (its count chained as a step chains it)
        call, p = [], view.plan[0]
        if p is not None:
            counts = ds.counter(p.heads)
            for _ in range(5):
                outs = []
                t = time.perf_counter()
                for _ in range(30):
                    out, counts = p.fn(q, *p.args, df.count(0), p.mean, counts)
                    outs.append(out)
                call.append((time.perf_counter() - t) / 30)
                mx.eval(outs, counts)
            ds.keep_counter(p.heads, counts)
    finally:
        attend_step.replay = replay
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "rounds": rounds,
        "pipelined_ms": med,
        "speedup": med["fp16_sdpa"] / med["fused_tq4"],
        "speedup_per_round": per_round(times, "fused_tq4"),
        "tq4_build_us": 1e6 * statistics.median(build),
        "tq4_compiled_call_us": 1e6 * statistics.median(call) if call else None,
        "tq4_replayed": hits[1],
        "tq4_not_replayed": hits[0],
    }


def chained(s: int, layers: int = 8, rounds: int = 5, steps: int = 10) -> dict:
    """The step as a model's token takes it: `layers` layers, each with a cache of its own, each
    attending the previous layer's output (an attention output has its query's shape), issued
    together and evaluated once per token, pipelined like `pipelined_ms`; fp16 SDPA and the tq4
    step in alternating rounds. A lone step (`head_to_head`) pays one evaluation per step, whose
    host cost (~40 us on the H200's VM) bounds both contenders below 32k; in a token it is paid
    once for all layers, as `ask` pays it. Distinct caches, so that no layer reads another's from
    L2 (a 32k tq4 cache is ~36 MB)."""
    scale = D**-0.5
    caches = []
    for i in range(layers):
        k = mx.random.normal((B, HKV, s, D), key=mx.random.key(100 + 2 * i)).astype(mx.float16)
        v = mx.random.normal((B, HKV, s, D), key=mx.random.key(101 + 2 * i)).astype(mx.float16)
        view = tq_view(k, v, "tq4", layer=i)
        mx.eval(k, v, list(view.segments[0][0].values()), list(view.segments[0][1].values()))
        caches.append((k, v, view))
    q0 = mx.random.normal((B, HQ, 1, D), key=mx.random.key(99)).astype(mx.float16)

    def fp16():
        q = q0
        for k, v, _ in caches:
            q = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
        return q

    def tq4():
        q = q0
        for _, _, view in caches:
            q = compressed_attention(q, view, scale)
        return q

    def portable():  # the same step with the portable kernel (the one Metal runs)
        q = q0
        for _, _, view in caches:
            q = _portable(q, view, scale)
        return q

    fns = {"fp16_sdpa": fp16, "fused_tq4": tq4, "fused_tq4_portable": portable}
    for fn in fns.values():  # the first steps trace and keep each layer's plan
        for _ in range(2):
            mx.eval(fn())
    times = alternating(fns, rounds, steps)
    med = {name: statistics.median(ts) / layers for name, ts in times.items()}
    return {
        "layers": layers,
        "rounds": rounds,
        "per_layer_ms": med,
        "speedup": med["fp16_sdpa"] / med["fused_tq4"],
        "speedup_per_round": per_round(times, "fused_tq4"),
        "portable_speedup": med["fp16_sdpa"] / med["fused_tq4_portable"],
        "portable_speedup_per_round": per_round(times, "fused_tq4_portable"),
    }


def nbytes(arrays) -> int:
    return sum(a.nbytes for a in arrays)


def setup(s: int, seed: int = 0, presets=TQ, affine=True) -> dict:
    """Random fp16 K/V, their affine and TurboQuant encodings, one query."""
    mx.random.seed(seed)
    k = mx.random.normal((B, HKV, s, D)).astype(mx.float16)
    v = mx.random.normal((B, HKV, s, D)).astype(mx.float16)
    q = mx.random.normal((B, HQ, 1, D)).astype(mx.float16)
    env = {"q": q, "k": k, "v": v}
    for bits in (8, 4) if affine else ():
        env[f"a{bits}"] = (mx.quantize(k, group_size=64, bits=bits), mx.quantize(v, group_size=64, bits=bits))
    for name in presets:
        env[name] = tq_view(k, v, name)
    mx.eval(
        [q, k, v]
        + [env[a] for a in ("a8", "a4") if a in env]
        + [list(env[n].segments[0][i].values()) for n in presets for i in (0, 1)]
    )
    if "tq4" in presets and affine:
        env["answer_tq4"] = answer_view(k, v)
    return env


def tq_view(k, v, preset: str, layer: int = 0) -> CompressedKV:
    """fp16 K/V encoded with `preset`'s codecs for `layer`, as one segment of a cache's view (not
    evaluated); `plan`: the slot where a layer's step keeps its launch, as a cache's view
    carries it."""
    s = k.shape[2]
    kc, vc = codecs_for(get_preset(preset), D, layer=layer)
    return CompressedKV(kc, vc, ((kc.encode(k), vc.encode(v), s),), s, mx.zeros((B, HKV, 1, D), dtype=mx.float32), plan=[None])


def answer_view(k, v, window: int = 256):
    """A tq4 cache as `ask` holds it while answering: the prefix sealed, restored and forked,
    then `window` exact tokens (a question and an answer so far) in its window buffer, plus the
    sink: the view a layer's decode step reads (its plan kept between calls)."""
    from longctx.kvcache.turbo import TurboQuantCache

    preset = get_preset("tq4")
    c = TurboQuantCache(preset, 0)
    c.update_and_fetch(k, v)
    c.seal()
    tq = TurboQuantCache.from_arrays(preset, 0, c.arrays(), D).fork(exact_new=1024)
    new = mx.random.normal((B, HKV, window, D), key=mx.random.key(3)).astype(k.dtype)
    view, _ = tq.update_and_fetch(new, new)
    mx.eval(tq.state)
    return view


def methods(env: dict, s: int) -> dict:
    """name -> (step function, bytes of cache read)."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention as qsdpa

    q, k, v = env["q"], env["k"], env["v"]
    scale = D**-0.5
    out = {"fp16_sdpa": (lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), k.nbytes + v.nbytes)}
    for bits in (8, 4):
        qk, qv = env[f"a{bits}"]
        out[f"mlxlm_qsdpa_a{bits}"] = (
            # mlx-lm scales its queries in place (queries *= scale): give it a fresh array.
            lambda qk=qk, qv=qv, bits=bits: qsdpa(q * 1.0, qk, qv, scale, None, 64, bits),
            nbytes(qk) + nbytes(qv),
        )
        out[f"dequant_sdpa_a{bits}"] = (
            lambda qk=qk, qv=qv, bits=bits: mx.fast.scaled_dot_product_attention(
                q, mx.dequantize(*qk, group_size=64, bits=bits), mx.dequantize(*qv, group_size=64, bits=bits), scale=scale
            ),
            nbytes(qk) + nbytes(qv),
        )
    for name in TQ:
        view = env[name]
        seg_k, seg_v, _ = view.segments[0]
        cache_bytes = nbytes(seg_k.values()) + nbytes(seg_v.values())
        out[f"fused_{name}"] = (lambda view=view: compressed_attention(q, view, scale), cache_bytes)
        if name == "tq4":  # the portable kernel, and the compiled fused path the two-launch
            # step replaced, side by side
            out["fused_tq4_portable"] = (lambda view=view: _portable(q, view, scale), cache_bytes)
            out["compiled_tq4"] = (lambda view=view: _compiled(q, view, scale), cache_bytes)
        if name in ("tq4", "tq3"):
            out[f"dequant_sdpa_{name}"] = (lambda view=view: _dequant_sdpa(q, view, scale), cache_bytes)
            out[f"kernel_{name}"] = (_kernel_only(q, view, scale), cache_bytes)
    if "answer_tq4" in env:  # a step while answering: the sink and a 256-token window as well
        view = env["answer_tq4"]
        cache_bytes = nbytes(view.segments[0][0].values()) + nbytes(view.segments[0][1].values())
        out["answer_tq4"] = (lambda view=view: compressed_attention(q, view, scale), cache_bytes)
        out["answer_tq4_portable"] = (lambda view=view: _portable(q, view, scale), cache_bytes)
    return out


def _compiled(q, view, scale):
    return compressed_attention(q, view, scale, fused_step=False)


def _portable(q, view, scale):
    """The step with the portable decode-attend kernel (the one Metal runs): its kept plan
    replayed as `compressed_attention` replays the default one."""
    return attend_step.attention(q, view, scale, tensor_cores=False)


def _dequant_sdpa(q, view, scale):
    """Decode the whole cache to fp16 in the rotated frames, SDPA, rotate back."""
    kc, vc = view.key_codec, view.value_codec
    seg_k, seg_v, _ = view.segments[0]
    q_rot = kc.rotate(q).astype(mx.float16)
    k_hat = kc.decode_rotated(seg_k).astype(mx.float16)
    v_hat = vc.decode_rotated(seg_v).astype(mx.float16)
    o = mx.fast.scaled_dot_product_attention(q_rot, k_hat, v_hat, scale=scale)
    return vc.unrotate(o)


def _kernel_only(q, view, scale):
    kc, vc = view.key_codec, view.value_codec
    seg_k, seg_v, _ = view.segments[0]
    q_rot = kc.rotate(q.astype(mx.float32)).reshape(B, HKV, HQ // HKV, kc.padded_dim)
    mx.eval(q_rot)
    kt, vt = kernel_table(kc), kernel_table(vc)
    kw = dict(key_bits=kc.spec.bits, value_bits=vc.spec.bits, scale=scale)
    return lambda: da.decode_attend(q_rot, seg_k, seg_v, kt, vt, **kw)


def check(env) -> float:
    """Max relative difference of the fused step vs the pure-MLX path on the same cache."""
    view = env["tq4"]
    a = compressed_attention(env["q"], view, D**-0.5, fused=True)
    b = compressed_attention(env["q"], view, D**-0.5, fused=False)
    return float(mx.abs(a - b).max() / mx.abs(b).max())


def main() -> None:
    global HQ, HKV
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 32768, 131072])
    ap.add_argument("--name", default=None, help="results file name (default attend_<backend>)")
    ap.add_argument(
        "--chained-layers",
        type=int,
        default=8,
        metavar="L",
        help="per length, also fp16 SDPA vs the tq4 step over L chained layers with "
        "caches of their own, one evaluation per token (`chained`; 0: none)",
    )
    ap.add_argument(
        "--methods",
        nargs="+",
        metavar="NAME",
        help="time only these methods (plus torch's anchors); the other rows of the "
        "results file are kept, marked carried_over with their run's date",
    )
    ap.add_argument(
        "--heads",
        nargs=2,
        type=int,
        default=[HQ, HKV],
        metavar=("Q", "KV"),
        help="query and KV heads (default Llama-3.1-8B's 32 8; Qwen2.5-7B: 28 4)",
    )
    ap.add_argument("--profile", action="store_true", help="only run the tq4 kernels at the largest length (for ncu), no output")
    args = ap.parse_args()
    HQ, HKV = args.heads
    if HQ % HKV:
        ap.error("query heads must be a multiple of KV heads")
    backend = _prelude.backend()
    if args.profile:  # the whole tq4 step, tensor-core kernel then portable (8 steps each)
        env = setup(max(args.lengths), presets=("tq4",), affine=False)
        view, q = env["tq4"], env["q"]
        for step in (compressed_attention, _portable):
            for _ in range(8):
                mx.eval(step(q, view, D**-0.5))
        return
    rows, checks, duels, chains = [], {}, {}, {}
    for s in args.lengths:
        env = setup(s)
        if backend != "cpu":
            duels[s] = head_to_head(env)
            d = duels[s]
            print(
                f"S={s:>6} head to head: fp16 {d['pipelined_ms']['fp16_sdpa']:.4f} ms, tq4 "
                f"{d['pipelined_ms']['fused_tq4']:.4f} ms: {d['speedup']:.2f}x (rounds "
                f"{d['speedup_per_round'][0]:.2f}-{d['speedup_per_round'][-1]:.2f}x); tq4 "
                f"build {d['tq4_build_us']:.1f} us (its compiled call "
                f"{d['tq4_compiled_call_us'] or 0:.1f}), replayed {d['tq4_replayed']} / "
                f"{d['tq4_replayed'] + d['tq4_not_replayed']}",
                flush=True,
            )
        if backend != "cpu" and args.chained_layers:
            c = chains[s] = chained(s, args.chained_layers)
            print(
                f"S={s:>6} {c['layers']} chained layers, one evaluation: per layer fp16 "
                f"{c['per_layer_ms']['fp16_sdpa']:.4f} ms, tq4 "
                f"{c['per_layer_ms']['fused_tq4']:.4f} ms: {c['speedup']:.2f}x (rounds "
                f"{c['speedup_per_round'][0]:.2f}-"
                f"{c['speedup_per_round'][-1]:.2f}x); portable "
                f"{c['per_layer_ms']['fused_tq4_portable']:.4f} ms: {c['portable_speedup']:.2f}x",
                flush=True,
            )
        checks[s] = check(env)
        for name, (fn, cache_bytes) in methods(env, s).items():
            if args.methods and name not in args.methods:
                continue
            t_sync, t_pipe = sync_ms(fn), pipelined_ms(fn)
            rows.append(
                {
                    "S": s,
                    "method": name,
                    "sync_ms": t_sync,
                    "pipelined_ms": t_pipe,
                    "cache_bytes": cache_bytes,
                    "gbs_sync": cache_bytes / t_sync / 1e6,
                    "gbs_pipelined": cache_bytes / t_pipe / 1e6,
                    "anchor_ms": ANCHORS_MS.get(name, {}).get(s),
                }
            )
            r = rows[-1]
            print(
                f"S={s:>6} {name:<20} sync {t_sync:7.3f} ms  pipelined {t_pipe:7.3f} ms  "
                f"{r['gbs_pipelined']:7.0f} GB/s ({100 * r['gbs_pipelined'] / PEAK_GBS:4.1f}% "
                f"of {PEAK_GBS:.0f})",
                flush=True,
            )
        if backend == "cuda":
            rows += torch_rows(s)
        del env
    if args.methods:
        rows += _carried(args.name or f"attend_{backend}", rows)
    ratios = _ratios([r for r in rows if "carried_over" not in r])
    _table(rows, ratios)
    path = write(
        args.name or f"attend_{backend}",
        {
            "shapes": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "batch": B, "query_tokens": 1},
            "kernel_backend": backend,
            "peak_gbs": PEAK_GBS,
            "rows": rows,
            "ratios": ratios,
            "fused_vs_mlx_path_max_rel_diff": checks,
            "head_to_head": duels or None,
            "chained": chains or None,
            "knobs": {
                "TARGET_GROUPS": da.TARGET_GROUPS or "auto",
                "SM_COUNT": da.SM_COUNT,
                "NT": da.NT,
                "MIN_SPLIT_TILES": da.MIN_SPLIT_TILES,
                "MIN_BLOCKS": da.MIN_BLOCKS,
                "STAGE_WORDS": da.STAGE_WORDS,
                "MMA_WARPS": dm.WARPS,
                "MMA_STAGES": dm.STAGES,
            },
        },
    )
    print(f"wrote {path}")


def _carried(name: str, rows: list) -> list:
    """From the results file `name`: its rows whose (S, method) this run did not time, each
    marked `carried_over` with the date of the run that measured it (their ratios are not
    recomputed)."""
    import json

    from _common import RESULTS

    path = RESULTS / f"{name}.json"
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    done = {(r["S"], r["method"]) for r in rows}
    date = old.get("environment", {}).get("date", "unknown")
    return [{**r, "carried_over": r.get("carried_over", date)} for r in old.get("rows", []) if (r["S"], r["method"]) not in done]


def torch_rows(s: int, steps: int = 30, reps: int = 7) -> list:
    """torch's fp16 SDPA anchors (cuDNN, flash) at this length on the same GPU, when torch with
    CUDA is installed: `steps` calls captured in a CUDA graph, replayed, timed by CUDA events,
    median of `reps` replays per step (the pipelined analogue). [] where torch is missing."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, HKV, s, D, device="cuda", dtype=torch.float16)
    v = torch.randn(B, HKV, s, D, device="cuda", dtype=torch.float16)
    rows = []
    for label, backend in (("torch_cudnn_fp16", SDPBackend.CUDNN_ATTENTION), ("torch_flash_fp16", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                f = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                    q, k, v, enable_gqa=True
                )
                f()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(steps):
                        f()
            times = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / steps)
            ms = statistics.median(times)
            nb = k.numel() * 2 * 2
            rows.append(
                {
                    "S": s,
                    "method": label,
                    "sync_ms": ms,
                    "pipelined_ms": ms,
                    "cache_bytes": nb,
                    "gbs_sync": nb / ms / 1e6,
                    "gbs_pipelined": nb / ms / 1e6,
                    "anchor_ms": None,
                    "timing": "torch CUDA graph replay",
                }
            )
            print(f"S={s:>6} {label:<20} {ms:7.3f} ms (graph replay)", flush=True)
        except Exception as err:  # noqa: BLE001 - an anchor that cannot run is reported, not fatal
            print(f"S={s:>6} {label:<20} unavailable: {type(err).__name__}: {err}", flush=True)
    return rows


def _ratios(rows) -> list:
    """Speedups of the fused step over the other methods, measured in this run."""
    t = {(r["S"], r["method"]): r for r in rows}
    out = []
    for (s, name), r in t.items():
        if not name.startswith("fused_tq"):
            continue
        for other, target in (
            ("fp16_sdpa", 2.0),
            ("torch_cudnn_fp16", 1.0),
            ("mlxlm_qsdpa_a8", 5.0),
            ("mlxlm_qsdpa_a4", 5.0),
            ("dequant_sdpa_a8", 1.5),
            ("dequant_sdpa_a4", 1.5),
            (f"dequant_sdpa_{name[6:]}", 1.5),
        ):
            if (s, other) not in t:
                continue
            for mode in ("sync_ms", "pipelined_ms"):
                out.append(
                    {
                        "S": s,
                        "fused": name,
                        "vs": other,
                        "mode": mode[:-3],
                        "speedup": t[(s, other)][mode] / r[mode],
                        "target": target,
                    }
                )
    return out


def _table(rows, ratios) -> None:
    print("\n| S | method | sync ms | pipelined ms | GB/s (pipelined) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['S']} | {r['method']} | {r['sync_ms']:.3f} | {r['pipelined_ms']:.3f} | {r['gbs_pipelined']:.0f} |")
    print("\n| S | fused | vs | sync speedup | pipelined speedup | target |")
    print("|---|---|---|---|---|---|")
    pairs = {}
    for x in ratios:
        pairs.setdefault((x["S"], x["fused"], x["vs"], x["target"]), {})[x["mode"]] = x["speedup"]
    for (s, f, vs, target), v in pairs.items():
        print(f"| {s} | {f} | {vs} | {v.get('sync', 0):.2f}x | {v.get('pipelined', 0):.2f}x | >= {target}x |")


if __name__ == "__main__":
    main()
