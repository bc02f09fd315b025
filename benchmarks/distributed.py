"""Tensor parallelism's cost and share per rank: one process vs `mlx.launch -n 2` ranks.

Each run (one process, then each of N ranks under `mlx.launch --backend ring`) ingests the same
document with tq4 and answers one question (greedy, `--answer` tokens), recording: ingest seconds,
the process's peak resident memory, the cache's bytes, and while answering the all-reduces per
answer token (calls and bytes, counted by wrapping `mx.distributed.all_sum`, which mlx-lm's
sharded layers call) and their share of a token's time (the all-reduces timed alone, synchronously,
over the same arrays after the answer). On one 2-core machine the ranks share the cores: the times
say what the protocol costs here, not what two machines gain.

Results: benchmarks/results/distributed_<machine>.json.

Usage: python benchmarks/distributed.py [--model M] [--ranks 2] [--doc samples/report.pdf]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, environment, machine_tag  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Who is the chief engineer of the cooperative?"


def worker(args) -> None:
    import mlx.core as mx

    from longctx import asking, session
    from longctx.runtime import distributed

    calls, sizes, arrays = [0], [0], []
    real = mx.distributed.all_sum

    def counting(x, *a, **k):
        calls[0] += 1
        sizes[0] += x.nbytes
        if len(arrays) < 64:
            arrays.append((x, k.get("group")))
        return real(x, *a, **k)

    mx.distributed.all_sum = counting
    start = time.perf_counter()
    result = session.ingest(args.doc, args.model, "tq4", force=True)
    ingest_s = time.perf_counter() - start
    base = calls[0], sizes[0]
    answer = session.Answer()
    t0 = time.perf_counter()
    text = "".join(asking.ask(QUESTION, result.entry.id, args.model, max_tokens=args.answer, answer=answer))
    answer_s = time.perf_counter() - t0 - answer.first_token_seconds
    tokens = max(1, len(answer.tokens) if answer.tokens else args.answer)
    steps = max(1, tokens - 1)
    per_token_calls = (calls[0] - base[0]) / tokens
    reduce_s = 0.0
    if arrays and distributed.group() is not None:  # the all-reduces of one token, timed alone
        per = int(round(per_token_calls)) or 1
        sample = [(mx.zeros_like(x[:, -1:]) if x.ndim == 3 else mx.zeros_like(x), g) for x, g in arrays[-per:]]
        mx.eval([s for s, _ in sample])
        t = time.perf_counter()
        for _ in range(10):
            mx.eval([real(s, group=g) for s, g in sample])
        reduce_s = (time.perf_counter() - t) / 10
    row = {"rank": int(os.environ.get("MLX_RANK", "0")), "topology": distributed.tag() or "single",
           "tokens": result.entry.tokens, "ingest_seconds": ingest_s, "cache_bytes": result.entry.bytes,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "answer": text, "answer_tokens": tokens, "decode_tok_s": steps / answer_s if answer_s > 0 else None,
           "all_reduce_calls_per_token": per_token_calls,
           "all_reduce_bytes_per_token": (sizes[0] - base[1]) / tokens,
           "all_reduce_seconds_per_token": reduce_s,
           "all_reduce_share_of_token": reduce_s * steps / answer_s if answer_s > 0 else None}
    Path(args.out).joinpath(f"{row['topology'].replace(':', '_')}.json").write_text(json.dumps(row))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--doc", default=str(ROOT / "samples" / "report.pdf"))
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    out = Path(tempfile.mkdtemp(prefix="longctx-dist-"))
    env = {**os.environ, "LONGCTX_HOME": str(out / "home")}
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out), "--doc", args.doc,
          "--answer", str(args.answer)] + (["--model", args.model] if args.model else [])
    subprocess.run(me, env=env, check=True, timeout=7200)
    launch = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "-n", str(args.ranks),
              "--starting-port", str(_port()), "--", *me]
    subprocess.run(launch, env=env, check=True, timeout=7200)
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    single = next(r for r in rows if r["topology"] == "single")
    ranks = [r for r in rows if r["topology"] != "single"]
    if len(ranks) != args.ranks:
        raise SystemExit(f"only {len(ranks)} of {args.ranks} ranks reported")
    result = {"environment": environment(), "model": args.model or "default", "document": Path(args.doc).name,
              "ranks": args.ranks, "single": single, "per_rank": ranks,
              "same_answer": all(r["answer"] == single["answer"] for r in ranks),
              "ingest_vs_single": [r["ingest_seconds"] / single["ingest_seconds"] for r in ranks],
              "peak_rss_vs_single": [r["peak_rss_bytes"] / single["peak_rss_bytes"] for r in ranks],
              "cache_bytes_vs_single": [r["cache_bytes"] / single["cache_bytes"] for r in ranks]}
    path = RESULTS / f"distributed_{machine_tag()}.json"
    path.write_text(json.dumps(result, indent=1))
    for r in [single, *ranks]:
        print(f"{r['topology']:>12}: ingest {r['ingest_seconds']:.1f} s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, "
              f"cache {r['cache_bytes'] / 2**20:.1f} MiB, {r['all_reduce_calls_per_token']:.0f} all-reduces "
              f"({r['all_reduce_bytes_per_token'] / 1024:.1f} KiB) per answer token")
    print(f"same answer: {result['same_answer']}; wrote {path}")


if __name__ == "__main__":
    main()
