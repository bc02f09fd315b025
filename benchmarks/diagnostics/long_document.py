"""A document far past the model's context, through the CLI as a user runs it: ingest once, then
ask each fact in a separate `longctx ask` process.

The document is the shipped haystack prose (samples/haystack) cut to `--tokens` tokens with
`--facts` RULER-style facts ("One of the special magic numbers for X is: N.") at spread depths;
with the default model (SmolLM2-135M-Instruct, 8k context) 24k tokens make 3-4 segment caches.
For each fact: the answer, whether it holds the number (RULER string match), the segment BM25 (or
`--ranker`) chose and whether it is the segment that holds the fact, and the process's timings.
Results: benchmarks/results/long_document_<backend>.json.

    python benchmarks/diagnostics/long_document.py --tokens 24000 --facts 4

On the H200 the ingest takes ~5-10 s of prefill (SmolLM2), each ask process ~5 s (start, model
load, restore, JIT); on this 2-core CPU the ingest runs at ~100-150 tok/s (~3-4 min for 24k).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
import _common  # noqa: E402

from longctx.bench import haystack as hay  # noqa: E402
from longctx.bench.niah import _ADJECTIVES, _NOUNS, string_match_all  # noqa: E402


def _facts(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    keys = rng.sample([f"{a}-{b}" for a in _ADJECTIVES for b in _NOUNS], n)
    return [(k, str(rng.randrange(1_000_000, 9_999_999))) for k in keys]


def _cli(*args: str, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True, env=env, timeout=3600)
    return run, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24000)
    ap.add_argument("--facts", type=int, default=4)
    ap.add_argument("--ranker", default="bm25")
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from longctx.runtime import models

    ref = models.resolve(args.model)
    tok = models.tokenizer(ref)
    facts = _facts(args.facts, args.seed)
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in facts]
    depths = [(i + 0.5) / len(facts) for i in range(len(facts))]

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    doc = hay.build(hay.load_corpus(), needles, depths, args.tokens, count, count, seed=args.seed)
    work = Path(tempfile.mkdtemp(prefix="longctx-longdoc-"))
    path = work / "long-report.txt"
    path.write_text(doc.text)
    env = {**os.environ, "LONGCTX_HOME": str(work / "home")}
    if args.model:
        env["LONGCTX_MODEL"] = args.model
    run, ingest_s = _cli("ingest", str(path), "--json", env=env)
    if run.returncode:
        raise SystemExit(f"ingest failed: {run.stderr.strip().splitlines()[-1:]}")
    group = json.loads(run.stdout)
    rows = []
    for (key, value), needle in zip(facts, needles):
        q = f"What is the special magic number for {key} mentioned in the provided text?"
        run, seconds = _cli("ask", q, "--max-tokens", "24", "--ranker", args.ranker, "--json", env=env)
        if run.returncode:
            rows.append({"key": key, "error": run.stderr.strip()[-300:]})
            continue
        out = json.loads(run.stdout)
        holder = next(i for i, s in enumerate(group["segments"]) if s["id"] and needle in _segment_text(env, s["id"]))
        rows.append(
            {
                "key": key,
                "value": value,
                "answer": out["answer"],
                "correct": string_match_all(out["answer"], [value]) == 1.0,
                "segment": out["segment"],
                "needle_segment": holder,
                "retrieved": out["segment"] == holder,
                "sources": out["sources"],
                "process_seconds": seconds,
                "restore_seconds": out["restore_seconds"],
                "first_token_seconds": out["first_token_seconds"],
            }
        )
        print(
            f"{key:>22}: {'ok ' if rows[-1]['correct'] else 'MISS'} segment {out['segment']} "
            f"(needle in {holder}) {out['answer'][:40]!r} {seconds:.1f} s",
            flush=True,
        )
    payload = {
        "model": ref.model_id,
        "tokens": group["tokens"],
        "segments": len(group["segments"]),
        "segment_tokens": [s["tokens"] for s in group["segments"]],
        "ingest_seconds": ingest_s,
        "ranker": args.ranker,
        "rows": rows,
        "correct": sum(r.get("correct", False) for r in rows),
        "retrieved": sum(r.get("retrieved", False) for r in rows),
        "facts": len(rows),
    }
    out = _common.write(f"long_document_{_common.device_kind()}", payload)
    print(
        f"{payload['tokens']:,} tokens in {payload['segments']} segments, ingest "
        f"{ingest_s:.1f} s; {payload['correct']}/{len(rows)} correct, {payload['retrieved']}/"
        f"{len(rows)} from the right segment -> {out}"
    )


def _segment_text(env: dict, sid: str) -> str:
    from unittest import mock

    from longctx.store import Store, groups

    with mock.patch.dict(os.environ, {"LONGCTX_HOME": env["LONGCTX_HOME"]}):
        store = Store(cleanup=False)
        try:
            return groups.text(store, sid)
        finally:
            store.close()


if __name__ == "__main__":
    main()
