"""What a fresh process pays on its first question, per compile mode of the fused GPU path.

In-process benchmarks repeat the same question, so from the second run on they reuse whatever
`mx.compile` traced (and MLX's kernel caches); a `longctx ask` process answers one question, so
it traces once and decodes with a window that grows every step. This ingests one document, then
for each compile mode (`kvcache.turbo.Paths.compile`: "0", "question", "1") starts fresh processes (two per mode, in
turn) that restore the cache and time the first answer token and the next `--steps` tokens.

Usage: python benchmarks/diagnostics/first_call.py [--tokens 8000] [--model SPEC] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import document_of, write  # noqa: E402

QUESTION = "What does the document say about the chief engineer?"

CHILD = r"""
import json, sys, time
from longctx.runtime.blas import tune_malloc
tune_malloc()
import mlx.core as mx
from longctx import engine, kvcache, session
from longctx.kvcache.turbo import Paths, TurboQuantCache
from longctx.runtime import models
from longctx.store import Store
entry_id, spec, steps, question = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]), json.loads(sys.argv[4])
lm = models.load(models.resolve(spec))
store = Store()
entry = store.find(entry_id)
t = time.perf_counter()
cache, pending = session.restore_verifying(entry, lm, store)
for c in cache:  # the compile mode under test
    if isinstance(c, TurboQuantCache):
        c.paths = Paths(compile=sys.argv[5])
store.close()
stream = engine.token_stream(lm.model, question, kvcache.fork(cache), steps + 1)
next(stream)
pending.wait()
first = time.perf_counter() - t
t = time.perf_counter()
n = sum(1 for _ in stream)
print(json.dumps({"first_token_s": first, "per_token_s": (time.perf_counter() - t) / max(n, 1), "tokens": n}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="tq4")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    from longctx.runtime.blas import tune_malloc

    tune_malloc()
    from longctx import session
    from longctx.runtime import models

    home = Path(tempfile.mkdtemp(prefix="longctx-first-"))
    os.environ["LONGCTX_HOME"] = str(home)
    lm = models.load(models.resolve(args.model))
    doc, prefix, question = document_of(lm, home, args.tokens, QUESTION)
    entry = session.ingest(doc, model=args.model, preset=args.preset).entry
    results: dict[str, list] = {}
    for run in range(args.runs):
        for mode in ("0", "question", "1"):
            t = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", CHILD, entry.id, args.model or "", str(args.steps), json.dumps(question), mode],
                env=dict(os.environ),
                capture_output=True,
                text=True,
            )
            if out.returncode:
                raise SystemExit(out.stderr[-2000:])
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["process_s"] = time.perf_counter() - t
            results.setdefault(mode, []).append(row)
            print(run, mode, row, flush=True)
    import mlx.core as mx

    device = "cpu" if mx.default_device().type == mx.DeviceType.cpu else "gpu"
    path = write(
        args.name or f"first_call_{device}",
        {
            "model": lm.ref.model_id,
            "model_spec": args.model,
            "tokens": len(prefix),
            "preset": args.preset,
            "question_tokens": len(question),
            "steps": args.steps,
            "runs": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
