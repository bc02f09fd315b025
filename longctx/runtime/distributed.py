"""Running across processes or machines under MLX's launcher (`mlx.launch`): tensor parallelism.

`mlx.launch --backend ring -n 2 -- longctx ingest report.pdf` (or `--hostfile hosts.json` naming
machines) starts one process per rank with `MLX_RANK` and `MLX_HOSTFILE` set; only that makes
longctx distributed, a plain process is unchanged. Each rank loads the model and keeps its share
of it (mlx-lm's `shard`: its query and KV heads, its part of the MLP), so its KV cache holds
`n_kv_heads / N` heads; it compresses and stores that share on its own machine as an entry of its
own (the entry records its topology, `Topology.tag`), and `ask` restores each rank's share
locally: no cache bytes cross the network, only mlx-lm's all-reduces of each layer's output.
Every rank decodes the same greedy tokens; rank 0 alone prints.

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



@dataclass(frozen=True)
class Topology:
    """This process's place in a tensor-parallel group."""

    ranks: int
    rank: int
    parallel: str = "tensor"

    @property
    def tag(self) -> str:
        """How entries record it (and their content address includes it)."""
        return f"{self.parallel}:{self.ranks}:{self.rank}"

    def heads(self, n_kv_heads: int) -> tuple[int, int]:
        """The KV heads [lo, hi) this rank holds."""
        per = n_kv_heads // self.ranks
        return self.rank * per, (self.rank + 1) * per


def parse_tag(tag: str) -> Topology | None:
    """The Topology an entry's `topology` field names (None: a single process)."""
    if not tag:
        return None
    parallel, ranks, rank = tag.split(":")
    return Topology(int(ranks), int(rank), parallel)


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

    from longctx import config

    backend = "ring" if "MLX_HOSTFILE" in os.environ else "any"
    timeout = config.get("peer_timeout")
    rank = os.environ.get("MLX_RANK")
    # `init` blocks in C, holding the GIL, while a peer is missing: a watchdog process ends it
    with watchdog(timeout, f"error: rank {rank}: the other ranks did not connect within {timeout} s; "
                           "start every rank (mlx.launch) and check the hostfile."):
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

        code = ("import os, signal, sys, time\n"
                f"time.sleep({float(self.seconds)!r})\n"
                f"os.kill({os.getpid()}, signal.SIGKILL)\n"
                f"{self.cleanup}\n"
                f"print({self.message!r}, file=sys.stderr)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
        return False


def topology() -> Topology | None:
    """This process's topology (None: a single process)."""
    g = group()
    return Topology(g.size(), g.rank()) if g is not None else None


def tag() -> str:
    t = topology()
    return t.tag if t is not None else ""


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
        raise ConfigError(f"{ranks} ranks do not divide this model's {heads} query and {kv} KV heads; "
                          f"run it on {' or '.join(map(str, valid))} ranks.")


def shard(model, config: dict) -> None:
    """Keep this rank's share of `model` (mlx-lm's tensor-parallel `shard`), if launched."""
    g = group()
    if g is None:
        return
    check_divides(config, g.size())
    if not hasattr(model, "shard"):
        raise ConfigError(f"mlx-lm has no tensor-parallel sharding for the '{config.get('model_type')}' "
                          "family; run it in one process.")
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

    from longctx import config

    timeout = config.get("peer_timeout")
    message = f"error: rank {g.rank()}: another rank stopped answering{what}; nothing of it is kept."
    try:
        with watchdog(timeout, message, cleanup):
            failed = mx.distributed.all_sum(mx.array([0.0 if ok else 1.0]), group=g)
            mx.eval(failed)
        return float(failed.item()) == 0.0
    except RuntimeError:  # "[ring] connection to a peer was lost"
        return False
