"""The instructions a kernel's warps stall on most, from an Nsight Compute report's source page.

`ncu -o REPORT --section SourceCounters --section WarpStateStats ...` samples where each warp is
stalled, per SASS instruction. This reads `ncu -i REPORT --page source --csv --print-source sass`
(the CSV on stdin or as a file) and prints the instructions with the most stall samples, each
with its share of all samples and the instructions just before it (what it waits on is usually
a few lines up), plus the samples summed per instruction kind (LDG, LDS, HMMA, BAR, ...).

Usage (on the GPU machine, after ncu):
    ncu -i rep.ncu-rep --page source --csv --print-source sass | python3 benchmarks/diagnostics/ncu_sass.py
"""

from __future__ import annotations

import argparse
import csv
import io
import sys


def _num(x: str) -> float:
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="?", help="the source page's CSV (default: stdin)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--context", type=int, default=3, help="instructions shown before each")
    args = ap.parse_args()
    text = open(args.csv).read() if args.csv else sys.stdin.read()
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Source" in line and "," in line), 0)
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    if not rows:
        sys.exit("no rows in the source page's CSV")
    cols = list(rows[0].keys())
    sample = next((c for c in cols if "Sampling" in c and "All" in c), next((c for c in cols if "Sampl" in c), None))
    if sample is None:
        sys.exit(f"no stall-sampling column among {cols}")
    src = next(c for c in cols if c.strip() == "Source")
    execd = next((c for c in cols if c.startswith("Instructions Executed")), None)
    total = sum(_num(r[sample]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples ({sample})")
    kinds: dict = {}
    for r in rows:
        op = r[src].split()[0] if r[src].split() else "?"
        if op.startswith("@"):
            op = r[src].split()[1] if len(r[src].split()) > 1 else op
        op = op.split(".")[0]
        kinds[op] = kinds.get(op, 0.0) + _num(r[sample])
    print(
        "samples by instruction kind:",
        ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:14]),
    )
    # where shared-memory wavefronts and global sectors exceed the ideal (bank conflicts,
    # uncoalesced accesses), per instruction
    for col in [c for c in cols if "Excessive" in c]:
        tot = sum(_num(r[col]) for r in rows)
        if not tot:
            continue
        print(f"--- {col}: {tot:.0f} in all; the instructions with most:")
        for i in sorted(range(len(rows)), key=lambda i: -_num(rows[i][col]))[:12]:
            if _num(rows[i][col]):
                print(
                    f"   {i:5d} {100 * _num(rows[i][col]) / tot:5.1f}%  {_num(rows[i][col]):10.0f}"
                    + (f"  executed {rows[i][execd]}" if execd else "")
                    + f"  {rows[i][src]}"
                )
    print("columns:", "; ".join(cols))
    order = sorted(range(len(rows)), key=lambda i: -_num(rows[i][sample]))[: args.top]
    for i in sorted(order):
        r = rows[i]
        print(f"--- #{i} {100 * _num(r[sample]) / total:5.1f}%" + (f"  executed {r[execd]}" if execd else ""))
        for j in range(max(0, i - args.context), i + 1):
            mark = ">>" if j == i else "  "
            print(f"{mark} {j:5d} {100 * _num(rows[j][sample]) / total:5.1f}%  {rows[j][src]}")


if __name__ == "__main__":
    main()
