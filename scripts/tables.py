"""Write the README's and docs' result tables from benchmarks/results/*.json.

Each table lives between `<!-- table:NAME -->` and `<!-- /table:NAME -->` in a markdown file; this
script rewrites what is between them. `--check` changes nothing and exits 1 if a table is stale
(a test runs it, so a results file and the tables that quote it cannot drift apart).

    python scripts/tables.py [--check]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FILES = {"speed": ["README.md", "docs/performance.md"], "quality": ["docs/presets.md"], "quality_summary": ["README.md"]}


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _card(data: dict) -> str:
    env = data.get("environment", {})
    gpu = env.get("gpu") or ""
    for card in ("H100", "H200"):
        if card in gpu:
            return card
    return f"CPU ({env.get('cpus', '?')} cores)" if "cpu" in str(env.get("backend", "")).lower() else (gpu or "?")


def _x(v: float) -> str:
    return f"{v:.2f}×"


def speed() -> str:
    rows = []
    d = _load("real_model_cpu.json")
    if d:
        rows.append(
            (
                f"ingest {d['tokens']:,} tokens, {d['model']} tq4 (`real_model.py`)",
                _card(d),
                f"{d['ingest_tok_s']:.1f} tok/s",
                f"fresh `ask`: {d['median_first_token_s']:.1f} s to the first token",
                "real_model_cpu.json",
            )
        )
    d = _load("serve_cpu.json")
    if d:
        rows.append(
            (
                f"follow-up question, {d['model']}: served vs a fresh `ask -c` (`serve.py`)",
                _card(d),
                f"{d['median_served_s']:.2f} s vs {d['median_fresh_s']:.1f} s to the first token",
                f"{d['speedup']:.1f}× faster",
                "serve_cpu.json",
            )
        )
    d = _load("restore_cpu.json")
    if d:
        r = {row["tokens"]: row for row in d["rows"]}
        n = max(r)
        rows.append(
            (
                f"restore + first token vs prefilling again, {d['model']}, {n:,} tokens (`restore.py`)",
                _card(d),
                f"{r[n]['c_tq4_process_s']:.2f} s vs {r[n]['a_reprefill_s']:.1f} s",
                f"{r[n]['a_reprefill_s'] / r[n]['c_tq4_process_s']:.0f}× faster",
                "restore_cpu.json",
            )
        )
    d = _load("attend_h100.json")
    if d:
        h = d["head_to_head"]
        ks = sorted(h, key=int)
        rows.append(
            (
                "decode-step attention vs MLX fp16 SDPA, 8B shape, 4k / 8k / 32k / 128k (`attend.py`)",
                _card(d),
                " / ".join(f"{h[k]['pipelined_ms']['fused_tq4']:.3f}" for k in ks) + " ms",
                " / ".join(_x(h[k]["speedup"]) for k in ks),
                "attend_h100.json",
            )
        )
        c = d.get("chained") or {}
        if c:
            ks = sorted(c, key=int)
            rows.append(
                (
                    "same, per layer of 8 chained layers (one evaluation a token)",
                    _card(d),
                    " / ".join(f"{c[k]['per_layer_ms']['fused_tq4']:.3f}" for k in ks) + " ms",
                    " / ".join(_x(c[k]["speedup"]) for k in ks),
                    "attend_h100.json",
                )
            )
    d = _load("prefill_h100.json")
    if d:
        r = d["ratios"]
        rows.append(
            (
                "prefill, 8B shape, 8k / 32k tokens: speed, peak memory (`prefill_shapes.py`)",
                _card(d),
                " / ".join(_x(r[f"llama-3.1-8b tq4 {n}"]["speed_vs_fp16"]) for n in (8192, 32768)) + " speed",
                " / ".join(_x(r[f"llama-3.1-8b tq4 {n}"]["peak_vs_fp16"]) for n in (8192, 32768)) + " peak",
                "prefill_h100.json",
            )
        )
    d = _load("answer_h100.json")
    if d:
        r = d["ratios"]
        rate = {(row["kv"], row["tokens"]): row["decode_tok_s"] for row in d["rows"]}
        if "4-bit tq4 131072" in r:
            t = r["4-bit tq4 131072"]
            rows.append(
                (
                    "answer decode, 8B 4-bit, 128k cached (`answer_shapes.py`)",
                    _card(d),
                    f"{rate[('tq4', 131072)]:.0f} tok/s",
                    f"{_x(t['decode_vs_fp16'])} fp16; ingest {_x(t['prefill_vs_fp16'])}, peak {_x(t['prefill_peak_vs_fp16'])}",
                    "answer_h100.json",
                )
            )
        if "4-bit tq4:portable 131072" in r:  # the kernel Macs run, forced on CUDA: the Mac proxy
            rows.append(
                (
                    "same with the portable kernel (what Metal runs), 32k / 128k: the Mac proxy",
                    _card(d),
                    " / ".join(f"{rate[('tq4:portable', n)]:.0f}" for n in (32768, 131072)) + " tok/s",
                    " / ".join(_x(r[f"4-bit tq4:portable {n}"]["decode_vs_fp16"]) for n in (32768, 131072)) + " fp16",
                    "answer_h100.json",
                )
            )
    head = "| what (benchmark) | machine | longctx tq4 | vs fp16 / baseline | results file |\n|---|---|---|---|---|\n"
    return head + "".join(f"| {a} | {b} | {c} | {e} | `{f}` |\n" for a, b, c, e, f in rows)


def quality() -> str:
    d = _load("kv_quality_cpu.json")
    if not d:
        return "(no results yet: `python benchmarks/kv_quality.py`)\n"
    out = [
        f"{d['model']} ({d['dtype']}, CPU), {d['text']}; {d['method']}. KL(fp16 ‖ preset) in nats per "
        "answer token; NIAH: needles found of those fp16 found and of all (RULER string match).\n",
        "| tokens | preset | bits/ch | answer KL | perplexity vs fp16 | top-1 agreement | NIAH |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in d["runs"]:
        base = run["presets"]["fp16"]["niah"]
        for name, p in run["presets"].items():
            if "error" in p:  # a PyPI peer whose code fails on this model
                out.append(f"| {run['tokens']:,} | `{name}` | — | fails: {p['error']} | | | |")
                continue
            hits = sum(p["niah"])
            same = sum(1 for a, b in zip(p["niah"], base) if a >= b)
            niah = f"{hits:g}/{len(p['niah'])}" + ("" if name == "fp16" else f" ({same}/{len(base)} cells ≥ fp16)")
            kl = "—" if name == "fp16" else f"{p['answer_kl']:.4f}"
            ppl = "—" if name == "fp16" else f"{p['ppl_delta_pct']:+.2f}%"
            top = "—" if name == "fp16" else f"{100 * p['top1']:.1f}%"
            out.append(f"| {run['tokens']:,} | `{name}` | {p['bits_per_channel']:.2f} | {kl} | {ppl} | {top} | {niah} |")
    return "\n".join(out) + "\n"


def quality_summary() -> str:
    """One row per preset: KL, perplexity change and needles found at every length measured."""
    d = _load("kv_quality_cpu.json")
    if not d:
        return "(no results yet: `python benchmarks/kv_quality.py`)\n"
    runs = d["runs"]
    # longctx's presets (the PyPI peers' rows are in docs/presets.md)
    names = [n for n in runs[0]["presets"] if not n.startswith("peer:")]
    names = sorted(names, key=lambda p: -runs[0]["presets"][p]["bits_per_channel"])
    lengths = " / ".join(f"{r['tokens'] / 1024:.0f}k" for r in runs)
    out = [
        f"{d['model']} on the CPU, license texts with 5 needles, at {lengths} tokens "
        "([docs/presets.md](docs/presets.md) has every cell):\n",
        "| preset | bits/ch | answer KL vs fp16 | perplexity vs fp16 | needles found (fp16: "
        + " / ".join(f"{sum(r['presets']['fp16']['niah']):g}" for r in runs)
        + ") |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        if name == "fp16":
            continue
        cells = [r["presets"].get(name) for r in runs]

        def row(fmt) -> str:
            return " / ".join(fmt(c) if c else "—" for c in cells)

        bits = next(c for c in reversed(cells) if c)["bits_per_channel"]
        out.append(
            f"| `{name}` | {bits:.2f} | "
            + row(lambda c: f"{c['answer_kl']:.4f}")
            + " | "
            + row(lambda c: f"{c['ppl_delta_pct']:+.1f}%")
            + " | "
            + row(lambda c: f"{sum(c['niah']):g}")
            + " |"
        )
    return "\n".join(out) + "\n"


def render(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- table:{name} -->\n)(.*?)(<!-- /table:{name} -->)", re.S)
    return pattern.sub(lambda m: m.group(1) + body + m.group(3), text)


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    makers = {"speed": speed, "quality": quality, "quality_summary": quality_summary}
    for name, files in FILES.items():
        body = makers[name]()
        for f in files:
            path = ROOT / f
            text = path.read_text()
            new = render(text, name, body)
            if new != text:
                stale.append(f"{f} ({name})")
                if not check:
                    path.write_text(new)
    if check and stale:
        print("stale tables (run python scripts/tables.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
