"""KV cache quality per preset on real text nobody here wrote, against the uncompressed cache.

For each length N: a haystack of license texts (Debian's /usr/share/common-licenses: GPL-3,
LGPL-2.1, MPL-2.0, Apache-2.0, ...) with `--needles` RULER needles ("One of the special magic
numbers for X is: N.") at evenly spread depths, laid out as `longctx ingest` lays out a
document, is prefilled ONCE uncompressed; every preset's cache is then the compression an
ingest stores (`longctx.bench.quality.compressed`). Per preset:
- answer KL(fp16 || preset), perplexity and top-1 agreement over the prefix's last `--answer`
  tokens, teacher-forced in steps of 16 from an answering fork of the cache of the tokens before
  them (the exact prefix truncated: keys of a position depend on earlier tokens only);
- needle in a haystack: each needle's question asked from a fork of the whole prefix's cache,
  greedy, scored by RULER's string match.

Results: benchmarks/results/kv_quality_<cpu|h100|h200>.json (one run per length, appended as
each length finishes).

Usage: python benchmarks/kv_quality.py [--model M] [--lengths 2048 8192 16384] [--presets ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, environment, machine_tag  # noqa: E402

import mlx.core as mx  # noqa: E402

from longctx import kvcache, prompt  # noqa: E402
from longctx.bench import haystack, niah, quality  # noqa: E402
from longctx.kvcache.presets import bits_per_channel  # noqa: E402
from longctx.runtime import models  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
TEXTS = ("GPL-3", "LGPL-2.1", "MPL-2.0", "Apache-2.0", "GPL-2", "Artistic", "GFDL-1.3", "MPL-1.1")
PRESETS = ["fp16", "tq5k4v", "tq4", "tq4k3v", "tq3+qjl", "tq3", "rvq2+2"]


def license_corpus(folder: Path) -> list:
    """The license texts as haystack essays (copied as .txt files for `haystack.load_corpus`)."""
    missing = [t for t in TEXTS if not (LICENSES / t).exists()]
    if len(missing) == len(TEXTS):
        raise SystemExit(f"no license texts in {LICENSES} (Debian/Ubuntu base-files)")
    for t in TEXTS:
        if t not in missing:
            (folder / f"{t}.txt").write_text((LICENSES / t).read_text(encoding="utf-8", errors="replace"))
    return haystack.load_corpus(folder)


def run_length(lm, n: int, presets: list[str], needles: int, answer: int, essays, seed: int) -> dict:
    tok = lm.tokenizer
    depths = [i / (needles - 1) for i in range(needles)] if needles > 1 else [0.5]
    cache_pieces: dict[str, int] = {}

    def piece_tokens(s: str) -> int:
        if s not in cache_pieces:
            cache_pieces[s] = len(tok.encode(s, add_special_tokens=False))
        return cache_pieces[s]

    case = niah.make_case("single", n, depths, 0, seed, tok, essays, n, piece_tokens)
    lay = prompt.layout(tok, niah.DOC_NAME, case.text)
    ids = prompt.prefix_tokens(tok, lay)
    print(f"[{n}] prefix {len(ids)} tokens, {needles} needles; exact prefill...", file=sys.stderr, flush=True)
    exact, prefill_s = quality.prefill_exact(lm.model, ids)
    head = len(ids) - answer
    row = {
        "tokens": len(ids),
        "answer_tokens": answer,
        "prefill_seconds": round(prefill_s, 1),
        "depths": list(case.needle_depths),
        "presets": {},
    }
    truncated = {}
    for p in presets:
        truncated[p] = quality.compressed(lm.model, exact, p, upto=head)
    scores = quality.answer_scores(lm.model, truncated, ids[head - 1 :])
    del truncated
    for p in presets:
        full = quality.compressed(lm.model, exact, p)
        found, answers = [], []
        for probe in case.probes:
            suffix = prompt.question_tokens(tok, lay, probe.question)
            text = niah.cut_answer(quality.ask(lm.model, tok, full, suffix, max_tokens=24))
            found.append(niah.string_match_all(text, probe.answers))
            answers.append(text)
        s = scores[p]
        row["presets"][p] = {
            "bits_per_channel": round(bits_per_channel(kvcache.get_preset(p), kvcache.head_dims(lm.model)[0], len(ids)), 3),
            "answer_kl": s["kl"],
            "answer_ppl": s["ppl"],
            "ppl_delta_pct": 100 * (s["ppl"] / scores["fp16"]["ppl"] - 1),
            "top1": s["top1"],
            "niah": found,
            "niah_score": sum(found) / len(found),
            "answers": answers,
        }
        r = row["presets"][p]
        print(
            f"[{n}] {p:>8} {r['bits_per_channel']:6.2f} b/ch  KL {r['answer_kl']:.5f}  "
            f"dppl {r['ppl_delta_pct']:+6.2f}%  top1 {100 * r['top1']:5.1f}%  "
            f"NIAH {sum(found):g}/{len(found)}",
            file=sys.stderr,
            flush=True,
        )
        del full
    row["expected"] = [list(p.answers) for p in case.probes]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: longctx's default model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--presets", nargs="+", default=PRESETS)
    ap.add_argument("--needles", type=int, default=5)
    ap.add_argument("--answer", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()

    lm = models.load(models.resolve(args.model))
    presets = ["fp16"] + [p for p in args.presets if p != "fp16"]
    out = RESULTS / f"{args.name or 'kv_quality_' + machine_tag()}.json"
    data = {
        "model": lm.ref.model_id,
        "dtype": lm.dtype,
        "text": "Debian common-licenses: " + ", ".join(TEXTS),
        "method": "one exact prefill per length; each preset's cache = the compression ingest stores",
        "runs": [],
    }
    if out.exists():  # a run of other lengths adds to the file (one file per machine)
        old = json.loads(out.read_text())
        if old.get("model") == data["model"]:
            data["runs"] = [r for r in old["runs"] if not any(abs(r["tokens"] - n) < 64 for n in args.lengths)]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        essays = license_corpus(Path(folder))
        for n in args.lengths:
            data["runs"].append(run_length(lm, n, presets, args.needles, args.answer, essays, args.seed))
            data["runs"].sort(key=lambda r: r["tokens"])
            data["seconds"] = round(time.perf_counter() - start, 1)
            out.write_text(json.dumps({"environment": environment(), **data}, indent=1))
            mx.clear_cache()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
