"""A follow-up question through `longctx serve` against a fresh `longctx ask` process, and the
server's memory with several documents warm.

For one document: the time to the first answer token of (a) `longctx ask -c "FOLLOW-UP"` in a new
process, from its start to the answer's first byte on stdout (imports, model load, restore, the
conversation's tokens appended, the question prefilled) and
(b) the same follow-up sent to a running server whose conversation holds the first turn (the
question alone is prefilled), through the `openai` client, streaming. Then the server's resident
memory (RSS, from /proc) after one question to each of `--docs` documents vs after one document,
with `--cache-bytes` bounding what stays warm.

Results: benchmarks/results/serve_<machine>.json.

Usage: python benchmarks/serve.py [--model M] [--docs 3] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, environment, machine_tag  # noqa: E402

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
FIRST = "Who is the chief engineer of the cooperative?"
FOLLOW = "What else does the report say about that person?"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _first_token(client, doc: str, messages: list) -> tuple[float, str]:
    start = time.perf_counter()
    first, text = None, ""
    for chunk in client.chat.completions.create(model=doc, messages=messages, stream=True, max_tokens=48, temperature=0):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece and first is None:
            first = time.perf_counter() - start
        text += piece or ""
    return first, text


def main() -> None:
    import openai

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache-bytes", default="4GB")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="longctx-serve-"))
    env = {**os.environ, "LONGCTX_HOME": str(home)}
    if args.model:
        env["LONGCTX_MODEL"] = args.model
    cli = [sys.executable, "-m", "longctx"]
    essays = sorted(p for p in (SAMPLES / "haystack").glob("*.md") if p.name != "README.md")
    docs = [SAMPLES / "report.pdf", SAMPLES / "notes.md", *essays][: args.docs]
    for d in docs:
        subprocess.run([*cli, "ingest", str(d)], env=env, check=True, capture_output=True, timeout=3600)
    names = [d.name for d in docs]

    # (a) fresh processes: ask, then ask -c (the follow-up), timed by the CLI's own JSON
    fresh = []
    for _ in range(args.repeat):
        subprocess.run(
            [*cli, "ask", FIRST, "--doc", names[0], "--max-tokens", "48"], env=env, check=True, capture_output=True, timeout=600
        )
        start = time.perf_counter()  # process start to the first byte of the answer on stdout
        proc = subprocess.Popen(
            [*cli, "ask", "-c", FOLLOW, "--doc", names[0], "--max-tokens", "48"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )
        proc.stdout.read(1)
        fresh.append(time.perf_counter() - start)
        proc.stdout.read()
        proc.wait(timeout=600)

    # (b) the server: the first turn once, then the follow-up (the conversation is kept between them)
    port = _port()
    server = subprocess.Popen(
        [*cli, "serve", "--port", str(port), "--cache-bytes", args.cache_bytes],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        deadline = time.time() + 600
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.time() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not start")
                time.sleep(1)
        served = []
        for _ in range(args.repeat):
            _, a1 = _first_token(client, names[0], [{"role": "user", "content": FIRST}])
            t, _ = _first_token(
                client,
                names[0],
                [{"role": "user", "content": FIRST}, {"role": "assistant", "content": a1}, {"role": "user", "content": FOLLOW}],
            )
            served.append(t)
        rss_one = _rss(server.pid)
        for name in names[1:]:
            _first_token(client, name, [{"role": "user", "content": FIRST}])
        rss_all = _rss(server.pid)
        health = json.loads(__import__("urllib.request").request.urlopen(f"http://127.0.0.1:{port}/health").read())
    finally:
        server.terminate()
        server.wait(timeout=60)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    result = {
        "environment": environment(),
        "model": health["model"],
        "documents": names,
        "fresh_ask_follow_up_first_token_s": fresh,
        "served_follow_up_first_token_s": served,
        "median_fresh_s": med(fresh),
        "median_served_s": med(served),
        "speedup": med(fresh) / med(served),
        "rss_one_document_bytes": rss_one,
        f"rss_{len(names)}_documents_bytes": rss_all,
        "warm_bytes": health["warm_bytes"],
        "cache_bytes_limit": args.cache_bytes,
    }
    out = RESULTS / f"serve_{machine_tag()}.json"
    out.write_text(json.dumps(result, indent=1))
    print(
        f"follow-up first token: fresh ask {med(fresh):.2f} s, served {med(served):.3f} s "
        f"({result['speedup']:.1f}x); RSS {rss_one / 2**30:.2f} GiB with 1 document warm, "
        f"{rss_all / 2**30:.2f} GiB with {len(names)}"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
