"""Needle in a haystack past the model's context: segment caches, bm25 vs model ranker.

Runs `longctx.bench.niah_segments` (the code behind `longctx bench niah` for lengths above the
context) and writes `<out>/niah_segments_<machine>[_<label>].json` (machine: cpu, h100, h200;
every question's cell: needle segment, ranking, recall@1/@2, answer, score, timings; the summary
per task, ranker and length; the model; the environment), `<out>/niah_segments_<machine>.cells.jsonl`
(each cell as soon as it is scored, so a run cut short still leaves its data; not committed) and,
where matplotlib is installed, one depth x length accuracy heatmap per ranker (a panel per task).
See the module's docstring for the wall-time estimate on an H200.

Usage:
  python benchmarks/niah_segments.py [--model smollm2] [--lengths 16k,32k,64k]
      [--depths 0,25,50,75,100] [--rankers bm25,model] [--tasks literal,paraphrase] [--kv tq4]
      [--budget-s 420] [--out DIR]
  python benchmarks/niah_segments.py --plot benchmarks/results/niah_segments_<machine>.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, environment, machine_tag, split_list  # noqa: E402

from longctx.bench import niah, niah_segments  # noqa: E402


def plot(path: Path) -> list[Path]:
    """The heatmaps of a results file, next to it."""
    from longctx.bench import plot as plots

    res = niah_segments.Results.from_json(json.loads(path.read_text()))
    return plots.segment_heatmaps(res, path.parent, path.stem)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model spec (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--lengths", default="16k,32k,64k")
    ap.add_argument("--depths", default="0,25,50,75,100", help="percent")
    ap.add_argument("--rankers", default="bm25,model,attention")
    ap.add_argument("--tasks", default="literal,paraphrase")
    ap.add_argument("--kv", default="tq4", help="KV preset of the segment caches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting documents after this")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ap.add_argument("--label", default="", help="added to the file name")
    ap.add_argument("--plot", default=None, help="only draw the heatmaps of this results JSON")
    args = ap.parse_args()
    if args.plot:
        for p in plot(Path(args.plot)):
            print(p)
        return

    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from longctx.runtime import models

    models.resolve(args.model)  # a first GGUF import happens here
    name = f"niah_segments_{machine_tag()}" + (f"_{args.label}" if args.label else "")
    cells_file = out / f"{name}.cells.jsonl"
    cells_file.unlink(missing_ok=True)

    def on_cell(c: niah_segments.Cell) -> None:
        print(
            f"{c.task:>10} {c.ranker:>5} {c.length:>6} d={c.depth:.2f} seg={c.needle_segment}/"
            f"{c.segments} rank={c.ranking[:4]} r@1={c.recall_at_1:.0f} score={c.score:.2f} "
            f"answer={c.answer[:40]!r} restore={c.restore_seconds:.2f}s "
            f"first={c.first_token_seconds:.2f}s ingest={c.ingest_seconds:.2f}s",
            file=sys.stderr,
            flush=True,
        )
        with open(cells_file, "a") as f:
            f.write(json.dumps(asdict(c)) + "\n")

    res = niah_segments.run(
        args.model,
        [niah.parse_length(n) for n in split_list(args.lengths)],
        [float(d) / 100 for d in split_list(args.depths)],
        split_list(args.rankers),
        split_list(args.tasks),
        preset=args.kv,
        seed=args.seed,
        workdir=Path("/tmp") / f"{name}-docs",
        on_cell=on_cell,
        budget_seconds=args.budget_s,
    )
    res.environment = environment()
    for task, per_ranker in res.summary().items():
        for ranker, per in per_ranker.items():
            cols = "  ".join(
                f"{n}: {per[str(n)]['recall_at_1']:.2f}/{per[str(n)]['recall_at_2']:.2f}/{per[str(n)]['accuracy']:.2f}"
                for n in res.lengths
                if per.get(str(n))
            )
            a = per["all"]
            print(
                f"{task:>10} {ranker:>5}  recall@1 {a['recall_at_1']:.2f}  recall@2 "
                f"{a['recall_at_2']:.2f}  accuracy {a['accuracy']:.2f}  ({a['cells']} q)  "
                f"per length r@1/r@2/acc  {cols}"
            )
    print(f"segments per document: {res.segments}; {time.perf_counter() - start:.0f} s")
    path = niah_segments.save(res, out / f"{name}.json")
    print(f"wrote {path}")
    try:
        for p in plot(path):
            print(f"wrote {p}")
    except ImportError:
        print("matplotlib not installed: no heatmaps (draw them later with --plot)", file=sys.stderr)


if __name__ == "__main__":
    main()
