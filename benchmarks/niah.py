"""Needle in a haystack over the product path (ingest, then ask from the restored cache), per preset.

Runs `longctx.bench.niah` (the code behind `longctx bench niah`) and writes
`<out>/niah_<machine>[_<label>].json` (machine: cpu, h100, h200; every run's cells, grids and
per-preset summary with its model, plus the environment), `<out>/niah_<machine>.cells.jsonl` (each
cell as soon as it is scored, so a run cut short still leaves its data; not committed) and, where
matplotlib is installed, one depth x length heatmap PNG per task and preset. Another model or
setting than the committed grid's gets a `--label`. `--plot FILE.json` only draws the PNGs of an
earlier run.

Usage:
  python benchmarks/niah.py [--model smollm2] [--lengths 1k,2k,4k,8k] [--depths 0,50,100]
      [--kv fp16,tq4] [--task single] [--samples 1] [--budget-s 300] [--out DIR]
  python benchmarks/niah.py --plot benchmarks/results/niah_<machine>.json
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

from longctx.bench import niah  # noqa: E402


def plot(path: Path) -> list[Path]:
    """Heatmaps of every run in a results file, next to it."""
    from longctx.bench import plot as plots

    data = json.loads(path.read_text())
    written = []
    for run in data["runs"]:
        res = niah.Results.from_json(run)
        written += plots.heatmaps(res, path.parent, f"{path.stem}_{res.task}")
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model spec (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--lengths", default="1k,2k,4k,8k,16k,32k")
    ap.add_argument("--depths", default="0,10,20,30,40,50,60,70,80,90,100", help="percent")
    ap.add_argument("--kv", default="fp16,tq4")
    ap.add_argument("--task", default="single", help="comma-separated: single,uuid,multikey,multivalue")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shared", action="store_true", help="one haystack per length for all depths")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting ingests after this")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ap.add_argument("--label", default="", help="added to the file name (e.g. 'anchor')")
    ap.add_argument("--rope-scale", type=float, default=None, help="run with RoPE scaled by this")
    ap.add_argument("--rope-type", default="ntk-by-parts", help="ntk-by-parts, yarn or linear")
    ap.add_argument("--plot", default=None, help="only draw the heatmaps of this results JSON")
    args = ap.parse_args()
    if args.plot:
        for p in plot(Path(args.plot)):
            print(p)
        return

    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [niah.parse_length(n) for n in split_list(args.lengths)]
    depths = [float(d) / 100 for d in split_list(args.depths)]
    from longctx.runtime import models

    if args.rope_scale:
        args.model = models.with_rope_scale(args.model, args.rope_scale, args.rope_type)
    models.resolve(args.model)  # a first GGUF import happens here
    name = f"niah_{machine_tag()}" + (f"_{args.label}" if args.label else "")
    cells_file = out / f"{name}.cells.jsonl"
    cells_file.unlink(missing_ok=True)

    def on_cell(cell: niah.Cell) -> None:
        print(
            f"{cell.task} {cell.preset:>7} {cell.length:>6} d={cell.depth:.2f} "
            f"tok={cell.tokens} score={cell.score:.2f} answer={cell.answer[:48]!r} "
            f"t={cell.answer_seconds:.2f}s ingest={cell.ingest_seconds:.2f}s",
            file=sys.stderr,
            flush=True,
        )
        with open(cells_file, "a") as f:
            f.write(json.dumps(asdict(cell)) + "\n")

    runs = []
    for task in split_list(args.task):
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
        if left is not None and left <= 0:
            print(f"budget spent; skipping task {task}", file=sys.stderr)
            continue
        res = niah.run(
            args.model,
            task,
            lengths,
            depths,
            split_list(args.kv),
            args.samples,
            args.seed,
            workdir=Path("/tmp") / f"{name}-docs",
            shared=args.shared,
            on_cell=on_cell,
            budget_seconds=left,
        )
        runs.append(res.to_json())
        for p, s in res.summary().items():
            print(
                f"{task} {p}: score {s['score']:.3f} over {s['cells']} cells, "
                f"{s['bits_per_channel']:.2f} bits/channel, {s['cache_bytes_per_token']:,.0f} B/token, "
                f"answer {s['mean_answer_seconds']:.2f} s, ingest {s['mean_ingest_seconds']:.2f} s"
            )
    path = out / f"{name}.json"
    path.write_text(
        json.dumps({"environment": environment(), "seconds": round(time.perf_counter() - start, 1), "runs": runs}, indent=1)
    )
    print(f"wrote {path}")
    try:
        for p in plot(path):
            print(f"wrote {p}")
    except ImportError:
        print("matplotlib not installed: no heatmaps (draw them later with --plot)", file=sys.stderr)


if __name__ == "__main__":
    main()
