"""What the CLI shows of the store, as rich renderables and plain values (no printing here):
`list`'s width-aware table, relative times, the JSON of an eviction, the table of a segmented
NIAH run."""

from __future__ import annotations

import time

from rich.table import Table

from longctx.units import human_bytes


def ago(when: float, now: float | None = None) -> str:
    """Seconds since `when` as `just now`, `5 min ago`, `3 h ago`, `2 d ago`."""
    s = max(0.0, (time.time() if now is None else now) - when)
    if s < 60:
        return "just now"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{int(s // size)} {unit} ago"
    return "just now"


def entries_table(entries, width: int, last_used: dict[str, float] | None = None) -> Table:
    """`list`'s table in `width` columns: the optional columns that fit, most useful first; the
    name column shrinks (ellipsis) before the id, which never wraps. `--json` has every field."""
    seen = last_used or {}
    columns = {  # name -> (cells, justify); id, name and tokens always shown
        "id": ([e.id for e in entries], "left"),
        "name": ([e.name for e in entries], "left"),
        "tokens": ([f"{e.tokens:,}" for e in entries], "right"),
        "kv": ([e.kv_preset + (f" [{e.topology}]" if getattr(e, "topology", "") else "") for e in entries], "left"),
        "on disk": ([human_bytes(e.bytes) for e in entries], "right"),
        "last used": ([ago(seen.get(e.id, e.created)) for e in entries], "right"),
        "model": ([e.model_id for e in entries], "left"),
        "pages": ([str(e.pages) for e in entries], "right"),
        "bits/ch": ([f"{e.bits_per_channel:.2f}" for e in entries], "right"),
        "B/token": ([f"{e.bytes_per_token:,.0f}" for e in entries], "right"),
    }
    need = {k: max([len(k)] + [len(c) for c in cells]) + 3 for k, (cells, _) in columns.items()}
    name_min = 8 + 3
    shown = ["id", "name", "tokens"]
    used = 1 + need["id"] + min(need["name"], name_min) + need["tokens"]
    for k in ("kv", "on disk", "last used", "model", "pages", "bits/ch", "B/token"):
        if used + need[k] <= width:
            shown.append(k)
            used += need[k]
    name_room = width - (used - min(need["name"], name_min)) - 3  # its cells, less padding, border
    table = Table()
    for k in [c for c in columns if c in shown]:
        table.add_column(
            k,
            justify=columns[k][1],
            no_wrap=True,
            max_width=max(name_room, name_min - 3) if k == "name" else None,
            overflow="ellipsis" if k in ("name", "model") else "fold",
        )
    for row in zip(*[columns[k][0] for k in columns if k in shown]):
        table.add_row(*row)
    return table


def unit_name(unit) -> str:
    """An evicted unit's name: the entry's, or a group's document name with its segment count."""
    if len(unit.entries) == 1:
        return unit.entries[0].name
    return f"{unit.entries[0].name.split(' (')[0]} ({len(unit.entries)} segments)"


def evicted_json(ev) -> list[dict]:
    """The units an eviction removed (`budget.Eviction`), for `--json`."""
    return [
        {
            "id": u.key,
            "names": [e.name for e in u.entries],
            "ids": [e.id for e in u.entries],
            "bytes": u.bytes,
            "last_used": u.last_used,
        }
        for u in (ev.removed if ev else [])
    ]


def niah_segments_report(res) -> tuple[Table, list[str]]:
    """A segmented NIAH run (`niah_segments.Results`): recall@1 / recall@2 / accuracy per task,
    ranker and length, and one summary line per task and ranker."""
    label = lambda n: f"{n / 1024:g}k" if n % 256 == 0 else str(n)  # noqa: E731
    table = Table(
        "task",
        "ranker",
        *[label(n) for n in res.lengths],
        "all",
        title=f"NIAH past the {res.context_length:,}-token context: {res.model_id} "
        f"({res.preset}); recall@1 / recall@2 / accuracy",
    )
    summary = res.summary()
    lines = ["segments per document: " + ", ".join(f"{label(int(n))}: {'/'.join(map(str, c))}" for n, c in res.segments.items())]
    for t, per_ranker in summary.items():
        for r, per in per_ranker.items():
            cols = [per.get(str(n)) or {} for n in res.lengths] + [per["all"]]
            table.add_row(
                t, r, *[f"{c['recall_at_1']:.2f} / {c['recall_at_2']:.2f} / {c['accuracy']:.2f}" if c else "-" for c in cols]
            )
            a = per["all"]
            lines.append(
                f"{t} {r}: recall@1 {a['recall_at_1']:.2f}, recall@2 "
                f"{a['recall_at_2']:.2f}, accuracy {a['accuracy']:.2f} over {a['cells']} "
                f"questions; restore {a['mean_restore_seconds']:.2f} s, first token "
                f"{a['mean_first_token_seconds']:.2f} s"
            )
    return table, lines
