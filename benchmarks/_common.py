"""Shared benchmark helpers: environment facts and writing results JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import longctx  # noqa: F401  (OpenBLAS before mlx)
from longctx.bench.env import environment, safe_name  # noqa: F401  (the benchmarks' helpers)

RESULTS = Path(__file__).resolve().parent / "results"
GPL3 = Path("/usr/share/common-licenses/GPL-3")


def device_kind() -> str:
    """ "cpu", "cuda" or "metal": the backend MLX runs on, for result file names."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    return "cuda" if getattr(mx, "cuda", None) is not None and mx.cuda.is_available() else "metal"


def machine_tag() -> str:
    """ "cpu", "h100", "h200" (the card's model, lower case) or "metal": the machine part of a
    results file's name (benchmarks/results/<bench>_<machine>.json)."""
    kind = device_kind()
    if kind != "cuda":
        return kind
    import subprocess

    try:
        name = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "gpu"
    for card in ("H100", "H200", "A100", "L40S", "L4"):
        if card in name:
            return card.lower()
    return "gpu"


def split_list(text: str) -> list[str]:
    """A command-line list: items separated by commas or spaces."""
    return text.replace(",", " ").split()


def write(name: str, payload: dict) -> Path:
    """Write `payload` plus the environment to benchmarks/results/<name>.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=1))
    return path


def prose(min_chars: int) -> str:
    """Real, redistributable prose for benchmarks: the sample report and notes, the GPL-3 text
    where the system has it (Debian's common-licenses), then samples/haystack/*.md; repeated only
    if still shorter than `min_chars`."""
    from longctx.documents import read_document

    root = Path(__file__).resolve().parent.parent / "samples"
    parts = [read_document(root / "report.pdf").text, (root / "notes.md").read_text()]
    if GPL3.exists():
        parts.append(GPL3.read_text())
    parts += [f.read_text() for f in sorted((root / "haystack").glob("*.md"))]
    text = "\n\n".join(parts)
    while len(text) < min_chars:
        text += "\n\n" + "\n\n".join(parts)
    return text


def document_of(lm, directory: Path, n: int, question: str) -> tuple[Path, list[int], list[int]]:
    """A text file of real prose whose prompt prefix is about `n` tokens (capped to leave room
    for an answer), with its prefix and question token ids. The search may overshoot by a token
    or two."""
    from longctx import prompt, session

    n = min(n, lm.context_length - session.answer_reserve(lm.context_length) - 8)
    words = prose(n * 8).split(" ")
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi) // 2
        lay = prompt.layout(lm.tokenizer, f"doc{n}.txt", " ".join(words[:mid]))
        if len(prompt.prefix_tokens(lm.tokenizer, lay)) < n:
            lo = mid + 1
        else:
            hi = mid
    doc = directory / f"doc{n}.txt"
    doc.write_text(" ".join(words[:lo]))
    lay = prompt.layout(lm.tokenizer, doc.name, doc.read_text())
    return doc, prompt.prefix_tokens(lm.tokenizer, lay), prompt.question_tokens(lm.tokenizer, lay, question)


def setup(default_tokens: list[int], tag: str, extra=None):
    """The common arguments of the per-phase benchmarks (--tokens, --preset, --model, --repeat,
    --name; `extra(parser)` adds more), a fresh LONGCTX_HOME for their ingests, and the loaded
    model: (args, home, lm)."""
    import argparse
    import tempfile

    from longctx.runtime import models

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=default_tokens)
    ap.add_argument("--preset", default="tq4")
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--name", default=None)
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix=f"longctx-{tag}-"))
    os.environ["LONGCTX_HOME"] = str(home)
    return args, home, models.load(models.resolve(args.model))
