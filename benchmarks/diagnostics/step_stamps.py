"""Where a whole decode step's kernel time goes, phase by phase (CUDA; clock stamps in the kernel).

`decode_attend_mma.decode_step_mma` launched in its timing variant (`STAMPS`): thread 0 of every
threadgroup stamps the SM clock at its phases' ends and the global timer at entry and exit. Per
length (Llama-3.1-8B shapes, tq4, one query token), for a bare compressed segment and for the
cache as `ask` holds it while answering (`attend.answer_view`: sealed, restored, forked, a
4-token sink and a 256-token window), over `--calls` calls in each `--modes` mode (pipe: queued
back to back; sync: each evaluated; flush: each after a 1 GiB read, cold L2):

- span: first entry to last exit (the kernel's duration, launch latency excluded);
- ramp: last entry minus first entry (threadgroups starting late: the wave's ramp);
- per threadgroup, median and max: issue (the first blocks' copies and norms requested), q_load
  (q staged), rotate (its Walsh-Hadamard rotation and the score MMA's fragments), table (the pair
  table written), loop (every warp's blocks), merge (the warps' states through shared memory), exact
  (the split's share of the exact tokens, its state written), arrive (fence, count), and the
  last threadgroups' finish (split merge, rotation back, mean, output), and its parts: fence,
  the splits' maxima, the weighted acc sums, the rotation back, the end (`FINISH_STEPS`);
- tail: the last exit minus the last non-finishing threadgroup's exit (what the finish adds
  after every split is done).

- where the slow main loops are: each warp's own loop end (the spread between a threadgroup's
  first and last warp), the SM each threadgroup ran on (%smid) and how many of the launch's
  threadgroups shared it, the loop's median and max per such count, and for one pipelined call
  of each row every threadgroup's loop time, SM and warp slot (`per_threadgroup`).

`--variants static dynamic` times the default kernel and the one whose keys are handed out while
it runs (`decode_attend_mma.DYNAMIC`) at every length side by side, per length and view
(`default`: the library's choice by length, `DYNAMIC_MIN_KEYS`); `dynamic:SP:GB` sets its
static share and grant size, and a `:hm` suffix numbers its threadgroups head-major (not
`HEADS_INTERLEAVED`). Per head: when its last threadgroup left its main loop (`head_loop_end_us`,
since the launch's first entry; a head's grants balance its splits' ends only within the head).

Clocks become microseconds at each threadgroup's own rate (clocks over global-timer ns between
its entry and exit). The stamps cost a few instructions per threadgroup (thread 0, ~12 stores;
lane 0 of each warp, one).

Usage: python benchmarks/diagnostics/step_stamps.py [--lengths 4096 32768 131072] [--modes pipe sync flush]
       [--variants static dynamic] [--name step_stamps_h200]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
import attend  # noqa: E402  (imports longctx first: OpenBLAS before mlx)
from _common import write  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from longctx.kernels import _prelude  # noqa: E402
from longctx.kernels import decode_attend_mma as dm  # noqa: E402
from longctx.kernels import decode_finish as df  # noqa: E402
from longctx.kvcache.attend_fused import kernel_table  # noqa: E402

# (name, clock stamp at its start, at its end): `decode_attend_mma._STAMP_HEADER`'s indices
STEPS = (("issue", 1, 2), ("q_load", 2, 3), ("rotate", 3, 4), ("table", 4, 5), ("loop", 5, 6),
         ("merge", 6, 11), ("exact", 11, 7), ("arrive", 7, 8), ("finish", 8, 9))
PHASES = tuple(name for name, _, _ in STEPS[:-1])
# the finish's parts (the last threadgroup of each head): its fence, the splits' maxima (m
# loads; the first splits' acc loads issued), the weighted acc sums (every split's acc read),
# the rotation back, the end (the states merged, the output written)
FINISH_STEPS = (("f_fence", 8, 21), ("f_max", 21, 18), ("f_acc", 18, 19), ("f_rotate", 19, 20),
                ("f_end", 20, 9))


def step_args(view):
    """`decode_step_mma`'s arguments for a cache view, as `attend_step._step` passes them."""
    kc, vc = view.key_codec, view.value_codec
    seg_k, seg_v, _ = view.segments[0]
    B, H, P, rows = attend.B, attend.HKV, attend.D, attend.HQ // attend.HKV
    q = mx.random.normal((B, H, rows, P), key=mx.random.key(7)).astype(mx.float16)
    sink = tuple(view.sink) if view.sink else None
    window = tuple(view.window) if view.window else None
    args = (q, seg_k, seg_v, kernel_table(kc), kc.rotation.signs, sink, window, vc.rotation.signs,
            view.value_mean, P ** -0.5, mx.float16, df.count(window[0].shape[2] if window else 0))
    mx.eval(q)
    return args, B * H


def measure(s: int, view, kind: str, calls: int, mode: str, flush=None) -> dict:
    """`mode`: "sync" (each call evaluated before the next), "pipe" (calls queued back to back,
    one evaluation at the end) or "flush" (queued, each after a read of `flush`, an array larger
    than the L2: the cold caches a layer's step meets while answering, between the model's
    matrix products). The stamps are read after the last call (reading them between calls would
    move their buffers to unified memory, which MLX's cache then hands back as a later output)."""
    args, n_heads = step_args(view)
    counts = dm.counter(n_heads)
    for _ in range(3):
        out, counts = dm.decode_step_mma(*args, counts)
        mx.eval(out, counts)
    stamps, keep = [], []
    for i in range(calls):
        if flush is not None:
            keep.append(flush.sum())
        out, counts = dm.decode_step_mma(*args, counts)
        stamps.append(dm.stamped())
        keep.append(out)
        if mode == "sync":
            mx.eval(out, counts, stamps[-1])
    mx.eval(keep, counts, stamps)
    runs = [np.array(st).astype(np.int64) for st in stamps]
    length = view.segments[0][0]["norm"].shape[2]
    chunk, n_split = dm.splits(length, n_heads, attend.D)
    res = {"S": s, "view": kind, "mode": mode,
           "variant": "dynamic" if dm.hands_out(length) else "static",
           "segment": length, "threadgroups": int(runs[0].shape[0]), "splits": n_split,
           "chunk": chunk}
    per = {k: [] for k in (*PHASES, "finish", "span", "ramp", "tail", "ghz", "warp_spread",
                           *(name for name, _, _ in FINISH_STEPS))}
    tg = np.arange(runs[0].shape[0])
    head = tg % n_heads if dm.hands_out(length) and dm.HEADS_INTERLEAVED else tg // n_split
    head_ends = []  # per call: each head's last loop end, us since the launch's first entry
    by_load: dict = {}  # threadgroups on the SM -> per call, the loop us of such threadgroups
    for st in runs:
        g0, g1 = st[:, 0], st[:, 10]
        t0 = g0.min()
        g0r = (g0 - t0) % (1 << 32)
        g1r = (g1 - t0) % (1 << 32)
        since = (st - st[:, 1:2]) % (1 << 32)  # clocks since entry
        rate = float(np.median(since[:, 9] / np.maximum(g1r - g0r, 1)))  # GHz
        per["ghz"].append(rate)
        d = {name: (since[:, b] - since[:, a]) / rate / 1e3 for name, a, b in STEPS}  # us
        # the threadgroups that ran a finish: each head's longest from arrival to end (the
        # others' finish stamps are unwritten words)
        last = np.zeros(len(st), dtype=bool)
        for h in range(n_heads):
            idx = np.flatnonzero(head == h)
            last[idx[np.argmax(d["finish"][idx])]] = True
        for name in PHASES:
            per[name].append((float(np.median(d[name])), float(d[name].max())))
        per["finish"].append((float(np.median(d["finish"][last])) if last.any() else 0.0,
                              float(d["finish"].max())))
        for name, a, b in FINISH_STEPS:
            x = (since[last, b] - since[last, a]) / rate / 1e3 if last.any() else np.zeros(1)
            per[name].append((float(np.median(x)), float(x.max())))
        warps = min(4, dm.WARPS)
        ends = since[:, 12:12 + warps] / rate / 1e3  # each warp's loop end, us since entry
        per["warp_spread"].append((float(np.median(ends.max(1) - ends.min(1))),
                                   float((ends.max(1) - ends.min(1)).max())))
        sm = st[:, 16]
        load = np.bincount(sm)[sm]  # threadgroups of this launch on each one's SM
        for n_tg in np.unique(load):
            by_load.setdefault(int(n_tg), []).append(d["loop"][load == n_tg])
        loop_end = g0r / 1e3 + since[:, 6] / rate / 1e3
        head_ends.append([float(loop_end[head == h].max()) for h in range(n_heads)])
        per["span"].append(float(g1r.max()) / 1e3)
        per["ramp"].append(float(g0r.max()) / 1e3)
        rest = g1r[~last] if (~last).any() else g1r
        per["tail"].append(float(g1r.max() - rest.max()) / 1e3)
    res["head_loop_end_us"] = [round(float(x), 2) for x in np.median(np.array(head_ends), 0)]
    res["sms_used"] = int(len(np.unique(runs[-1][:, 16])))
    # (max: the median over calls of each call's max, as for the phases)
    res["loop_by_sm_load"] = {str(k): {"threadgroups": int(v[-1].size),
                                       "median_us": round(float(np.median(np.concatenate(v))), 2),
                                       "max_us": round(statistics.median(float(x.max())
                                                                         for x in v), 2)}
                              for k, v in sorted(by_load.items())}
    if mode == "pipe":  # one call's threadgroups, in launch order
        st = runs[len(runs) // 2]
        since = (st - st[:, 1:2]) % (1 << 32)
        rate = float(np.median(since[:, 9] / np.maximum((st[:, 10] - st[:, 0]) % (1 << 32), 1)))
        res["per_threadgroup"] = {
            "loop_us": [round(float(x), 2) for x in (since[:, 6] - since[:, 5]) / rate / 1e3],
            "start_ns": [int(x) for x in (st[:, 0] - st[:, 0].min()) % (1 << 32)],
            "sm": [int(x) for x in st[:, 16]], "warp_slot": [int(x) for x in st[:, 17]],
            "head": [int(x) for x in head]}
    for name in (*PHASES, "finish", "warp_spread", *(name for name, _, _ in FINISH_STEPS)):
        res[name + "_us"] = {"median": round(statistics.median(x[0] for x in per[name]), 2),
                             "max": round(statistics.median(x[1] for x in per[name]), 2)}
    for name in ("span", "ramp", "tail"):
        res[name + "_us"] = round(statistics.median(per[name]), 2)
    res["sm_ghz"] = round(statistics.median(per["ghz"]), 3)
    return res


def _variant(name: str, defaults: dict) -> dict:
    """The `decode_attend_mma` tunables a --variants name sets (`defaults`: the module's own, which
    `default` keeps: the library's choice by length)."""
    if name == "default":
        return dict(defaults)
    if name == "static":
        return {**defaults, "DYNAMIC": False, "DYNAMIC_MIN_KEYS": 0}
    if name == "dynamic":
        return {**defaults, "DYNAMIC": True, "HEADS_INTERLEAVED": True}
    kind, _, rest = name.partition(":")
    sp, _, rest = rest.partition(":")
    gb, _, order = rest.partition(":")
    if kind != "dynamic" or not sp.isdigit() or not gb.isdigit() or int(gb) < 1 \
            or int(sp) > 99 or order not in ("", "hm"):
        raise SystemExit(f"step_stamps: unknown variant {name!r} (default, static, dynamic,"
                         " dynamic:SP:GB, dynamic:SP:GB:hm)")
    return {**defaults, "DYNAMIC": True, "STATIC_PERCENT": int(sp), "GRANT_BLOCKS": int(gb),
            "HEADS_INTERLEAVED": order != "hm"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--modes", nargs="+", default=["pipe"], choices=["pipe", "sync", "flush"])
    ap.add_argument("--variants", nargs="+", default=["static", "dynamic"],
                    help="default (the library's choice by length), static, dynamic (the "
                         "module's STATIC_PERCENT and GRANT_BLOCKS, at every length) or "
                         "dynamic:SP:GB (SP%% of the keys in static first grants, the rest in "
                         "grants of GB blocks; a :hm suffix: threadgroups numbered head-major)")
    ap.add_argument("--name", default="step_stamps_h200")
    args = ap.parse_args()
    if _prelude.backend() != "cuda":
        sys.exit("step_stamps: the whole-step kernel's stamps need the CUDA backend")
    dm.STAMPS = True
    defaults = {k: getattr(dm, k) for k in ("DYNAMIC", "DYNAMIC_MIN_KEYS", "STATIC_PERCENT",
                                            "GRANT_BLOCKS", "HEADS_INTERLEAVED")}
    for v in args.variants:
        _variant(v, defaults)  # (a malformed one fails before any timing)
    rows = []
    # 1 GiB of bf16, read between the flush mode's calls (the H200's L2 is 50 MB)
    flush = mx.zeros((1 << 29,), dtype=mx.bfloat16) if "flush" in args.modes else None
    if flush is not None:
        mx.eval(flush)
    for s in args.lengths:
        env = attend.setup(s, presets=("tq4",), affine=False)
        views = {"bare": env["tq4"], "answer": attend.answer_view(env["k"], env["v"])}
        for (kind, view), mode, variant in itertools.product(views.items(), args.modes,
                                                             args.variants):
            for k, v in _variant(variant, defaults).items():
                setattr(dm, k, v)
            r = measure(s, view, kind, args.calls, mode, flush if mode == "flush" else None)
            r["variant"] = variant
            if dm.hands_out(r["segment"]):
                r["static_percent"], r["grant_blocks"] = dm.STATIC_PERCENT, dm.GRANT_BLOCKS
                r["heads_interleaved"] = dm.HEADS_INTERLEAVED
            rows.append(r)
            loads = " ".join(f"{k}/SM {v['median_us']:.1f}/{v['max_us']:.1f} ({v['threadgroups']})"
                             for k, v in r["loop_by_sm_load"].items())
            print(f"S={s:>6} {kind:<6} {mode:<5} {variant:<7} span {r['span_us']:6.1f} us  ramp "
                  f"{r['ramp_us']:4.1f}  tail {r['tail_us']:4.1f} | median/max: "
                  + " ".join(f"{k} {r[k + '_us']['median']:.1f}/{r[k + '_us']['max']:.1f}"
                             for k in (*PHASES, "finish"))
                  + " | finish " + " ".join(f"{k[2:]} {r[k + '_us']['median']:.1f}/"
                                            f"{r[k + '_us']['max']:.1f}"
                                            for k, _, _ in FINISH_STEPS)
                  + f" | head loop end {min(r['head_loop_end_us']):.1f}.."
                  f"{max(r['head_loop_end_us']):.1f}"
                  + f" | warp spread {r['warp_spread_us']['median']:.1f}/"
                  f"{r['warp_spread_us']['max']:.1f} | loop by TGs per SM {loads} | "
                  f"{r['sms_used']} SMs, {r['threadgroups']} tgs, {r['sm_ghz']} GHz", flush=True)
        for k, v in defaults.items():
            setattr(dm, k, v)
        del env, views
    path = write(args.name, {"shapes": {"kv_heads": attend.HKV, "rows": attend.HQ // attend.HKV,
                                        "head_dim": attend.D},
                             "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
