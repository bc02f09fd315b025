"""Tensor and pipeline parallelism's cost and share per rank: one process vs `mlx.launch -n 2` ranks.

Each run (one process, then each of N ranks under `mlx.launch --backend ring`, `--parallel tensor`
or `pipeline`) ingests the same document with tq4 and answers one question (greedy, `--answer`
tokens), recording: ingest seconds, the process's peak resident memory, the cache's bytes, and
while answering the collective operations per answer token, by kind (calls and bytes, counted by
wrapping `mx.distributed.all_sum`, which mlx-lm's sharded layers call, and `send`, `recv_like`
and `all_gather`, which its pipeline stages call); for tensor parallelism also the all-reduces'
share of a token's time (timed alone, synchronously, over the same arrays after the answer: a
pipeline's sends need their peer's receives, so they are not re-timed). On one 2-core machine the
ranks share the cores: the times say what the protocol costs here, not what two machines gain.

Results: benchmarks/results/distributed_<machine>.json (the single process, then each parallelism).

Usage: python benchmarks/distributed.py [--parallel tensor pipeline] [--model M] [--ranks 2]
       [--doc samples/report.pdf]
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


OPS = ("all_sum", "send", "recv_like", "all_gather")  # mx.distributed calls that move bytes


def worker(args) -> None:
    import mlx.core as mx

    from longctx import asking, session
    from longctx.runtime import distributed

    parallel = args.parallel[0]  # a worker runs one
    distributed.use(parallel)
    counts = {op: [0, 0] for op in OPS}  # op -> [calls, bytes]
    arrays = []
    real = {op: getattr(mx.distributed, op) for op in OPS}

    def counting(op):
        def call(x, *a, **k):
            counts[op][0] += 1
            counts[op][1] += x.nbytes
            if op == "all_sum" and len(arrays) < 64:
                arrays.append((x, k.get("group")))
            return real[op](x, *a, **k)

        return call

    for op in OPS:
        setattr(mx.distributed, op, counting(op))
    start = time.perf_counter()
    result = session.ingest(args.doc, args.model, "tq4", force=True)
    ingest_s = time.perf_counter() - start
    base = {op: list(c) for op, c in counts.items()}
    answer = session.Answer()
    t0 = time.perf_counter()
    text = "".join(asking.ask(QUESTION, result.entry.id, args.model, max_tokens=args.answer, answer=answer))
    answer_s = time.perf_counter() - t0 - answer.first_token_seconds
    tokens = max(1, len(answer.tokens) if answer.tokens else args.answer)
    steps = max(1, tokens - 1)
    per_token = {
        op: {"calls": (counts[op][0] - base[op][0]) / tokens, "bytes": (counts[op][1] - base[op][1]) / tokens} for op in OPS
    }
    reduce_s = 0.0
    if arrays and distributed.group() is not None:  # the all-reduces of one token, timed alone
        per = int(round(per_token["all_sum"]["calls"])) or 1
        sample = [(mx.zeros_like(x[:, -1:]) if x.ndim == 3 else mx.zeros_like(x), g) for x, g in arrays[-per:]]
        mx.eval([s for s, _ in sample])
        t = time.perf_counter()
        for _ in range(10):
            mx.eval([real["all_sum"](s, group=g) for s, g in sample])
        reduce_s = (time.perf_counter() - t) / 10
    row = {
        "rank": int(os.environ.get("MLX_RANK", "0")),
        "topology": result.entry.topology or "single",
        "tokens": result.entry.tokens,
        "ingest_seconds": ingest_s,
        "cache_bytes": result.entry.bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "answer": text,
        "answer_tokens": tokens,
        "decode_tok_s": steps / answer_s if answer_s > 0 else None,
        "per_answer_token": per_token,
        "collective_calls_per_token": sum(v["calls"] for v in per_token.values()),
        "collective_bytes_per_token": sum(v["bytes"] for v in per_token.values()),
        "all_reduce_calls_per_token": per_token["all_sum"]["calls"],
        "all_reduce_bytes_per_token": per_token["all_sum"]["bytes"],
        "all_reduce_seconds_per_token": reduce_s,
        "all_reduce_share_of_token": reduce_s * steps / answer_s if answer_s > 0 and reduce_s else None,
    }
    Path(args.out).joinpath(f"{row['topology'].replace(':', '_')}.json").write_text(json.dumps(row))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--parallel", nargs="+", choices=("tensor", "pipeline"), default=["tensor", "pipeline"])
    ap.add_argument("--doc", default=str(ROOT / "samples" / "report.pdf"))
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--home", default=None, help="the runs' LONGCTX_HOME (default: a new folder; one that holds the model's import saves it)"
    )
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    out = Path(tempfile.mkdtemp(prefix="longctx-dist-"))
    home = Path(args.home) if args.home else out / "home"
    env = {**os.environ, "LONGCTX_HOME": str(home)}
    # the model's one-time import (a GGUF becomes an mlx-lm directory) before any timing
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from longctx.runtime import models; models.resolve(sys.argv[1] if len(sys.argv) > 1 else None)",
            *([args.model] if args.model else []),
        ],
        env=env,
        check=True,
        timeout=3600,
    )

    def me(parallel: str, folder: Path) -> list[str]:
        folder.mkdir(exist_ok=True)
        return [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--out",
            str(folder),
            "--doc",
            args.doc,
            "--answer",
            str(args.answer),
            "--parallel",
            parallel,
        ] + (["--model", args.model] if args.model else [])

    subprocess.run(me("tensor", out / "single"), env=env, check=True, timeout=7200)
    single = json.loads(next((out / "single").glob("*.json")).read_text())
    result = {
        "environment": environment(),
        "model": args.model or "default",
        "document": Path(args.doc).name,
        "ranks": args.ranks,
        "single": single,
    }
    _report(single)
    for parallel in args.parallel:
        launch = [
            str(Path(sys.executable).parent / "mlx.launch"),
            "--backend",
            "ring",
            "-n",
            str(args.ranks),
            "--starting-port",
            str(_port()),
            "--",
            *me(parallel, out / parallel),
        ]
        subprocess.run(launch, env=env, check=True, timeout=7200)
        ranks = [json.loads(p.read_text()) for p in sorted((out / parallel).glob("*.json"))]
        if len(ranks) != args.ranks:
            raise SystemExit(f"{parallel}: only {len(ranks)} of {args.ranks} ranks reported")
        result[parallel] = {
            "per_rank": ranks,
            "same_answer": all(r["answer"] == single["answer"] for r in ranks),
            "ingest_vs_single": [r["ingest_seconds"] / single["ingest_seconds"] for r in ranks],
            "peak_rss_vs_single": [r["peak_rss_bytes"] / single["peak_rss_bytes"] for r in ranks],
            "cache_bytes_vs_single": [r["cache_bytes"] / single["cache_bytes"] for r in ranks],
        }
        for r in ranks:
            _report(r)
        print(f"{parallel}: same answer as one process: {result[parallel]['same_answer']}")
    path = RESULTS / f"distributed_{machine_tag()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def _report(r: dict) -> None:
    print(
        f"{r['topology']:>12}: ingest {r['ingest_seconds']:.1f} s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, "
        f"cache {r['cache_bytes'] / 2**20:.1f} MiB, per answer token: "
        + ", ".join(
            f"{v['calls']:.0f} {op} ({v['bytes'] / 1024:.1f} KiB)" for op, v in r["per_answer_token"].items() if v["calls"]
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
