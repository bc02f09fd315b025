"""Running across processes or machines under MLX's launcher (`mlx.launch`): tensor, pipeline
and data parallelism.

`mlx.launch --backend ring -n 2 -- longctx ingest report.pdf` (or `--hostfile hosts.json` naming
machines) starts one process per rank with `MLX_RANK` and `MLX_HOSTFILE` set; only that makes
longctx distributed, a plain process is unchanged. How the ranks split the work (`use`, the CLI's
`--parallel`):

- tensor (the default): each rank keeps its share of every layer (mlx-lm's `shard`: its query and
  KV heads, its part of the MLP), so its KV cache holds `n_kv_heads / N` heads;
- pipeline: each rank keeps a run of whole layers (mlx-lm's `pipeline`: rank N-1 the first
  layers, rank 0 the last), so its KV cache holds those layers; activations go from stage to
  stage once per chunk or token;
- data: each rank holds the whole model and ingests its own segments of a long document or
  collection (`multidoc`); the segments are ordinary entries, the group record is written by
  rank 0 once every rank's are in.

In tensor and pipeline parallelism each rank compresses and stores its share on its own machine
as an entry of its own (the entry records its topology, `entry_tag`), and `ask` restores each
rank's share locally: no cache bytes cross the network. Every rank decodes the same greedy tokens;
rank 0 alone prints.

Faults: `mx.distributed.init` waits forever for a peer that never comes, so it runs on a thread
given `LONGCTX_PEER_TIMEOUT` seconds; a rank that fails makes the others' next all-reduce fail, and `agree`
lets every rank learn whether all of them finished before an ingest's entries count (`mlx.launch`
itself exits 0 whatever its ranks did).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from longctx.errors import ConfigError, ResourceError
from longctx import config


PARALLEL = ("tensor", "pipeline", "data")
_mode = ["tensor"]


def use(parallel: str) -> None:
    """Choose how launched ranks split the work (one of PARALLEL; the CLI's `--parallel`), before
    a model loads. A plain process ignores it."""
    if parallel not in PARALLEL:
        raise ConfigError(f"Unknown parallelism '{parallel}'; choose one of: {', '.join(PARALLEL)}.")
    _mode[0] = parallel


def mode() -> str:
    return _mode[0]


@dataclass(frozen=True)
class Topology:
    """This process's place in a group of ranks."""

    ranks: int
    rank: int
    parallel: str = "tensor"
    layers: tuple[int, int] | None = None  # a pipeline stage's layers [lo, hi) of the model

    @property
    def tag(self) -> str:
        """How entries record it ("tensor:2:0", "pipeline:2:0:14-28"); content addresses hold
        `place`, without the layers (known before the model loads)."""
        lo_hi = f":{self.layers[0]}-{self.layers[1]}" if self.layers else ""
        return f"{self.parallel}:{self.ranks}:{self.rank}{lo_hi}"

    @property
    def place(self) -> str:
        return f"{self.parallel}:{self.ranks}:{self.rank}"

    def heads(self, n_kv_heads: int) -> tuple[int, int]:
        """The KV heads [lo, hi) this rank holds."""
        per = n_kv_heads // self.ranks
        return self.rank * per, (self.rank + 1) * per


def parse_tag(tag: str) -> Topology | None:
    """The Topology an entry's `topology` field names (None: a single process)."""
    if not tag:
        return None
    parallel, ranks, rank, *rest = tag.split(":")
    layers = tuple(int(x) for x in rest[0].split("-")) if rest else None
    return Topology(int(ranks), int(rank), parallel, layers)


def place(tag: str) -> str:
    """An entry's topology without a pipeline stage's layers: what `tag()` answers where it fits."""
    t = parse_tag(tag)
    return t.place if t is not None else ""


def launched() -> bool:
    """Whether MLX's launcher started this process as one rank of several."""
    return "MLX_RANK" in os.environ and ("MLX_HOSTFILE" in os.environ or "MLX_WORLD_SIZE" in os.environ)


@functools.lru_cache(maxsize=1)
def group():
    """The launcher's group (None in a plain process or a group of one). Raises ResourceError if
    the other ranks do not connect within the `peer_timeout` setting's seconds."""
    if not launched():
        return None
    import mlx.core as mx

    backend = "ring" if "MLX_HOSTFILE" in os.environ else "any"
    timeout = config.get("peer_timeout")
    rank = os.environ.get("MLX_RANK")
    # `init` blocks in C, holding the GIL, while a peer is missing: a watchdog process ends it
    with watchdog(
        timeout,
        f"error: rank {rank}: the other ranks did not connect within {timeout} s; "
        "start every rank (mlx.launch) and check the hostfile.",
    ):
        try:
            g = mx.distributed.init(strict=True, backend=backend)
        except RuntimeError as err:
            raise ResourceError(f"Rank {rank} could not join the others: {err}") from err
    return g if g.size() > 1 else None


class watchdog:
    """A context in which this process is killed after `seconds`, with `message` on stderr and
    `cleanup` (a Python snippet) run first by the watchdog: for waits in C code that hold the GIL
    (a missing peer), which no thread of this process could interrupt."""

    def __init__(self, seconds: float, message: str, cleanup: str = ""):
        self.seconds, self.message, self.cleanup = seconds, message, cleanup
        self.proc = None

    def __enter__(self):
        import subprocess
        import sys

        code = (
            "import os, signal, sys, time\n"
            f"time.sleep({float(self.seconds)!r})\n"
            f"os.kill({os.getpid()}, signal.SIGKILL)\n"
            f"{self.cleanup}\n"
            f"print({self.message!r}, file=sys.stderr)\n"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
        return False


def topology() -> Topology | None:
    """This process's topology (None: a single process)."""
    g = group()
    return Topology(g.size(), g.rank(), mode()) if g is not None else None


def tag() -> str:
    """This process's part of a content address: "" in a single process and for data-parallel
    ranks (whose entries are ordinary ones), else `Topology.place`."""
    t = topology()
    return t.place if t is not None and t.parallel != "data" else ""


def entry_tag(model) -> str:
    """What an entry made by this process records as its topology: `tag()`, and on a pipeline
    stage the layers of `model` it holds."""
    t = topology()
    if t is None or t.parallel == "data":
        return ""
    if t.parallel == "pipeline":
        inner = model.model
        t = Topology(t.ranks, t.rank, t.parallel, (int(inner.start_idx), int(inner.end_idx)))
    return t.tag


def share(n: int) -> list[int]:
    """The items of `n` (segments) this rank takes in data parallelism: every N-th from its rank
    (all of them in a single process)."""
    t = topology()
    return list(range(n)) if t is None else list(range(t.rank, n, t.ranks))


def is_leader() -> bool:
    """Whether this process prints (rank 0, or a single process)."""
    t = topology()
    return t is None or t.rank == 0


def check_divides(config: dict, ranks: int) -> None:
    """Refuse a group size that does not divide the model's query and KV heads, before any work."""
    cfg = config.get("text_config", config)
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    if heads % ranks or kv % ranks:
        valid = [n for n in range(1, kv + 1) if kv % n == 0 and heads % n == 0]
        raise ConfigError(
            f"{ranks} ranks do not divide this model's {heads} query and {kv} KV heads; "
            f"run it on {' or '.join(map(str, valid))} ranks."
        )


def split(model, config: dict) -> None:
    """Keep this rank's share of `model`, as `mode()` says, if launched (data: all of it), and
    read its weights (loaded lazily under the launcher)."""
    if group() is None or mode() == "data":
        import mlx.core as mx

        mx.eval(model.parameters())
        return
    (pipeline if mode() == "pipeline" else shard)(model, config)


def stage_layers(n_layers: int, ranks: int, rank: int) -> tuple[int, int]:
    """The layers [lo, hi) mlx-lm's `pipeline` gives `rank` of `ranks`: an even split, the low
    ranks one more where it is uneven, rank N-1 the first layers and rank 0 the last."""
    base, extra = divmod(n_layers, ranks)
    split_ = [base + (1 if r < extra else 0) for r in range(ranks)]
    lo = sum(split_[rank + 1 :])
    return lo, lo + split_[rank]


def pipeline_families() -> list[str]:
    """mlx-lm's model families that have `pipeline` (read from its model files)."""
    import mlx_lm.models
    from pathlib import Path

    folder = Path(mlx_lm.models.__file__).parent
    return sorted(f.stem for f in folder.glob("*.py") if f.stem != "pipeline" and "PipelineMixin" in f.read_text())


def pipeline(model, config: dict) -> None:
    """Keep this stage's run of layers of `model` (mlx-lm's `pipeline`), if launched."""
    g = group()
    if g is None:
        return
    cfg = config.get("text_config", config)
    layers = int(cfg["num_hidden_layers"])
    if g.size() > layers:
        raise ConfigError(f"{g.size()} pipeline stages exceed this model's {layers} layers; run it on at most {layers} ranks.")
    if not hasattr(getattr(model, "model", None), "pipeline"):
        raise ConfigError(
            f"mlx-lm has no pipeline parallelism for the '{config.get('model_type')}' family "
            f"(only {', '.join(pipeline_families())}); use --parallel tensor."
        )
    import mlx.core as mx

    model.model.pipeline(g)
    mx.eval(model.parameters())


def pipelined(model) -> bool:
    """Whether `model` is one stage of several (its call sends and receives activations)."""
    return getattr(getattr(model, "model", None), "pipeline_size", 1) > 1


def shard(model, config: dict) -> None:
    """Keep this rank's share of `model` (mlx-lm's tensor-parallel `shard`), if launched."""
    g = group()
    if g is None:
        return
    check_divides(config, g.size())
    if not hasattr(model, "shard"):
        raise ConfigError(
            f"mlx-lm has no tensor-parallel sharding for the '{config.get('model_type')}' family; run it in one process."
        )
    import mlx.core as mx

    model.shard(g)
    mx.eval(model.parameters())


def agree(ok: bool, cleanup: str = "", what: str = "") -> bool:
    """Whether every rank reached this point with `ok` (False when a peer is gone: the ring
    reports it, or, where its wait never ends, the watchdog kills this rank after running
    `cleanup`, a Python snippet that undoes what only a finished group may keep)."""
    g = group()
    if g is None:
        return ok
    import mlx.core as mx

    timeout = config.get("peer_timeout")
    message = f"error: rank {g.rank()}: another rank stopped answering{what}; nothing of it is kept."
    try:
        with watchdog(timeout, message, cleanup):
            failed = mx.distributed.all_sum(mx.array([0.0 if ok else 1.0]), group=g)
            mx.eval(failed)
        return float(failed.item()) == 0.0
    except RuntimeError:  # "[ring] connection to a peer was lost"
        return False
