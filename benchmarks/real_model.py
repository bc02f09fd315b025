"""The default model on a real document, as a user runs it: `longctx ingest` once, then each
question in its own `longctx ask` process.

The document is real text nobody here wrote (Debian's license texts: GPL-3, LGPL-2.1, MPL-2.0,
GPL-2, ...) cut to about `--tokens` tokens, with `--facts` invented facts planted at spread depths
("The Tessaly Reading Room has 20 oak shelves."). Measured per preset (`--kv`): the ingest's
rate and peak (the CLI's JSON), its per-chunk timeline (where the time goes as the prefix grows,
from a second, in-process prefill of the first `--profile-tokens` tokens), and per question: the
answer, whether it holds the fact, and the `ask` process's timings: start to the first byte of
the answer (measured outside), restore and first token as the process reports them.

Results: benchmarks/results/real_model_<machine>.json.

Usage: python benchmarks/real_model.py [--tokens 21000] [--kv tq4] [--model M]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, environment, machine_tag  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
TEXTS = ("GPL-3", "LGPL-2.1", "MPL-2.0", "GPL-2", "Apache-2.0", "Artistic", "GFDL-1.3")
FACTS = [
    ("The Tessaly Reading Room has 20 oak shelves.", "How many oak shelves does the Tessaly Reading Room have?", "20"),
    ("The door of the Marlow archive is a white door.", "What colour is the door of the Marlow archive?", "white"),
    ("The caretaker of the Brennick mill is Oskar Linde.", "Who is the caretaker of the Brennick mill?", "Oskar Linde"),
    ("The Quill ferry leaves the harbour at 7:45 every morning.", "When does the Quill ferry leave the harbour?", "7:45"),
]


def document(tokens: int, facts: int, count) -> str:
    """License texts cut to ~`tokens` tokens (by `count`) with the facts at spread depths."""
    parts = [(LICENSES / t).read_text(errors="replace") for t in TEXTS if (LICENSES / t).exists()]
    paras = [p.strip() for text in parts for p in text.split("\n\n") if p.strip()]
    per = max(1, int(sum(count(p) for p in paras[:50]) / 50))
    body = paras[: max(facts + 1, tokens // per)]
    while count("\n\n".join(body)) > tokens and len(body) > facts + 1:
        body = body[: int(len(body) * 0.97)]
    for i, (fact, _, _) in enumerate(FACTS[:facts]):
        at = int(len(body) * (i + 1) / (facts + 1))
        body.insert(at, fact)
    return "\n\n".join(body)


def cli(env: dict, *args: str, timeout: int = 14400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longctx", *args], env=env, capture_output=True, text=True, timeout=timeout)


def ask(env: dict, question: str, doc: str) -> dict:
    """One `longctx ask` process: its start to the answer's first byte on stdout (a user's wait,
    measured here), the answer, and the process's own phases (its stderr line)."""
    import re

    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "longctx", "ask", question, "--doc", doc, "--max-tokens", "48"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    first = proc.stdout.read(1)  # unbuffered: communicate() below reads the pipes' descriptors
    first_byte = time.perf_counter() - start
    rest, err = proc.communicate(timeout=1800)
    total = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"ask failed: {err.decode()}")
    # (rich wraps the line at the terminal's width: any whitespace between the words)
    m = re.search(r"restored\s+in\s+([0-9.]+)\s+s,\s+first\s+token\s+after\s+([0-9.]+)\s+s", err.decode())
    return {
        "answer": (first + rest).decode().strip(),
        "first_byte_seconds": first_byte,
        "process_seconds": total,
        "restore_seconds": float(m.group(1)) if m else None,
        "first_token_seconds": float(m.group(2)) if m else None,
    }


def profile(lm, ids: list[int], preset: str) -> dict:
    """An in-process prefill of `ids`: per-chunk seconds as the prefix grows."""
    from longctx import engine, kvcache

    cache = kvcache.make(lm.model, kvcache.get_preset(preset))
    st = engine.prefill(lm.model, ids, cache)
    return {
        "tokens": len(ids),
        "seconds": st.seconds,
        "tok_s": st.tokens_per_second,
        "chunk_seconds": [round(x, 3) for x in st.chunk_seconds],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=21000)
    ap.add_argument("--facts", type=int, default=3)
    ap.add_argument("--kv", nargs="+", default=["tq4"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--profile-tokens", type=int, default=0, help="also profile an in-process prefill")
    ap.add_argument("--name", default=None, help="results file name (default real_model_<machine>)")
    ap.add_argument(
        "--home",
        default=None,
        help="LONGCTX_HOME for the runs (default: a new folder; one that holds the model's import saves it)",
    )
    args = ap.parse_args()
    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="longctx-real-"))
    env = {**os.environ, "LONGCTX_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    if args.model:
        env["LONGCTX_MODEL"] = args.model
    os.environ.update(env)
    from longctx.runtime import models

    ref = models.resolve(args.model)
    tok = models.tokenizer(ref)
    text = document(args.tokens, args.facts, lambda s: len(tok.encode(s, add_special_tokens=False)))
    path = home / "licenses.txt"
    path.write_text(text)
    result = {
        "environment": environment(),
        "model": ref.model_id,
        "document": "Debian common-licenses + planted facts",
        "facts": [f for f, _, _ in FACTS[: args.facts]],
        "runs": [],
    }
    out = RESULTS / f"{args.name or 'real_model_' + machine_tag()}.json"
    for kv in args.kv:
        start = time.perf_counter()
        res = cli(env, "ingest", str(path), "--kv", kv, "--name", f"licenses-{kv}", "--json")
        if res.returncode:
            raise SystemExit(res.stderr)
        info = json.loads(res.stdout)
        wall = time.perf_counter() - start
        run = {
            "kv": kv,
            "tokens": info["tokens"],
            "ingest_process_seconds": wall,
            "prefill_seconds": info["prefill_seconds"],
            "ingest_tok_s": info["tokens"] / info["prefill_seconds"],
            "cache_bytes": info["bytes"],
            "questions": [],
        }
        for _, question, want in FACTS[: args.facts]:
            q = ask(env, question, f"licenses-{kv}")
            q.update(question=question, expected=want, correct=want.lower() in q["answer"].lower())
            run["questions"].append(q)
            print(
                f"[{kv}] {question} -> {q['answer']!r} ({'ok' if q['correct'] else 'MISS'}; first byte "
                f"{q['first_byte_seconds']:.1f} s)",
                flush=True,
            )
        run["correct"] = sum(q["correct"] for q in run["questions"])
        run["median_first_byte_s"] = sorted(q["first_byte_seconds"] for q in run["questions"])[len(run["questions"]) // 2]
        result["runs"].append(run)
        print(
            f"[{kv}] {run['tokens']:,} tokens ingested at {run['ingest_tok_s']:.1f} tok/s; "
            f"{run['correct']}/{len(run['questions'])} facts",
            flush=True,
        )
        out.write_text(json.dumps(result, indent=1))
    main_run = result["runs"][0]
    result.update(
        tokens=main_run["tokens"], ingest_tok_s=main_run["ingest_tok_s"], median_first_token_s=main_run["median_first_byte_s"]
    )
    if args.profile_tokens:
        lm = models.load(ref)
        ids = tok.encode(text, add_special_tokens=False)[: args.profile_tokens]
        result["profile"] = profile(lm, ids, args.kv[0])
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
