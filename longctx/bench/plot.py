"""Depth x length heatmaps of NIAH results: one PNG per preset with the fp16 baseline beside it;
for segmented runs (past the context), one PNG per ranker with a panel per task.

matplotlib is optional (`pip install 'longctx[bench]'`); `heatmaps` raises ImportError without it,
and callers skip the pictures with a warning.
"""

from __future__ import annotations

from pathlib import Path

from longctx.bench.niah import BASELINE, Results


def _label(n: int) -> str:
    return f"{n / 1024:g}k" if n % 256 == 0 else str(n)


def _pyplot():
    """matplotlib's pyplot (headless) and the red-yellow-green map, grey for missing cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("niah", ["#c0392b", "#f1c40f", "#27ae60"])
    return plt, cmap.with_extremes(bad="#dddddd")


def _figure(plt, panels: int, results):
    """A row of `panels` depth x length panels sized to the grid."""
    width = max(3.4, 0.8 + 0.6 * len(results.lengths))
    return plt.subplots(
        1, panels, figsize=(0.8 + width * panels, 1.4 + 0.3 * len(results.depths)), squeeze=False, constrained_layout=True
    )


def _panel(ax, cmap, grid: list, xlabels: list[str], depths: list[float], xlabel: str, title: str):
    """One depth x length panel: the values (None: missing), each written in its cell."""
    grid = [[float("nan") if v is None else v for v in row] for row in grid]
    im = ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto", origin="upper")
    ax.set_xticks(range(len(xlabels)), xlabels)
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=9)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:  # not NaN
                ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=6)
    return im


def heatmaps(results: Results, out_dir: str | Path, stem: str) -> list[Path]:
    """Write `<stem>_<preset>.png` for every preset that has cells.

    Args:
        results: a run's results.
        out_dir: destination folder.
        stem: file name prefix, e.g. "niah_SmolLM2-135M-Instruct_cpu".

    Returns:
        the paths written.
    """
    plt, cmap = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = results.summary()
    written = []
    for preset in results.presets:
        if preset not in summary:
            continue
        panels = [preset] if preset == BASELINE or BASELINE not in summary else [BASELINE, preset]
        fig, axes = _figure(plt, len(panels), results)
        for ax, p in zip(axes[0], panels):
            s = summary[p]
            im = _panel(
                ax,
                cmap,
                results.grid(p),
                [_label(n) for n in results.lengths],
                results.depths,
                "context length (tokens)",
                f"{p}: score {s['score']:.2f}, {s['bits_per_channel']:.2f} bits/ch",
            )
        fig.colorbar(im, ax=list(axes[0]), shrink=0.8, label="score")
        fig.suptitle(f"NIAH {results.task} - {results.model_id}", fontsize=10)
        path = out_dir / f"{stem}_{preset}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _counts(counts: list[int] | None) -> str:
    if not counts:
        return "?"
    return str(counts[0]) if len(counts) == 1 else f"{min(counts)}-{max(counts)}"


def segment_heatmaps(results, out_dir: str | Path, stem: str) -> list[Path]:
    """Write `<stem>_<ranker>.png` for every ranker of a segmented run (`niah_segments`): one
    depth x length accuracy panel per task, its recall@1 / recall@2 in the panel's title.

    Args:
        results: a `niah_segments.Results`.
        out_dir: destination folder.
        stem: file name prefix.

    Returns:
        the paths written.
    """
    plt, cmap = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = results.summary()
    written = []
    for ranker in results.rankers:
        tasks = [t for t in results.tasks if ranker in summary.get(t, {})]
        if not tasks:
            continue
        fig, axes = _figure(plt, len(tasks), results)
        for ax, task in zip(axes[0], tasks):
            s = summary[task][ranker]["all"]
            im = _panel(
                ax,
                cmap,
                results.grid(ranker, task),
                [f"{_label(n)}\n{_counts(results.segments.get(str(n)))} seg" for n in results.lengths],
                results.depths,
                "document length (tokens)",
                f"{task}: accuracy {s['accuracy']:.2f}, recall@1 {s['recall_at_1']:.2f}, @2 {s['recall_at_2']:.2f}",
            )
        fig.colorbar(im, ax=list(axes[0]), shrink=0.8, label="accuracy")
        fig.suptitle(
            f"NIAH past the context, ranker {ranker} - {results.model_id} "
            f"({results.context_length:,}-token context, {results.preset})",
            fontsize=10,
        )
        path = out_dir / f"{stem}_{ranker}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
