"""Tensor parallelism under MLX's launcher, as users run it: `mlx.launch --backend ring -n 2 --
longctx ingest/ask` on 127.0.0.1 (free ports, every run under a timeout), on a tiny random model
(4 query heads, 2 KV heads). Answers equal one process's; each rank stores its heads' share; merge
and reshard round trips; the refusals and faults a user meets."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import make_tiny_model

LAUNCH = Path(sys.executable).parent / "mlx.launch"
pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
TEXT = "The lighthouse keeper is Ada Quill. The island has 412 sheep and one blue boat.\n" * 6
QUESTION = "Who keeps the lighthouse?"


def _ports(n: int) -> int:
    """A first port of `n` consecutive free ones."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free ports")


def _launch(env: dict, n: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [str(LAUNCH), "--backend", "ring", "-n", str(n), "--starting-port", str(_ports(n)), "--",
           sys.executable, "-m", "longctx", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _cli(env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longctx", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _answer(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count('"answer"') == 1, res.stdout  # rank 0 alone prints
    return json.loads(res.stdout[res.stdout.index("{"):])["answer"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    model = make_tiny_model(root / "tiny", context=2048, attn_gain=2.0)
    env = {**os.environ, "LONGCTX_HOME": str(root / "home"), "LONGCTX_MODEL": str(model),
           "LONGCTX_PEER_TIMEOUT": "30"}
    for name in ("a.txt", "b.txt", "c.txt"):
        (root / name).write_text(TEXT + f"This is {name}.\n")
    return root, env


def _entries(env: dict) -> list[dict]:
    return json.loads(_cli(env, "list", "--json").stdout)


def test_two_ranks_answer_as_one_process_and_store_their_heads(setup):
    root, env = setup
    assert _cli(env, "ingest", str(root / "a.txt")).returncode == 0
    one = _answer(_cli(env, "ask", QUESTION, "--doc", "a.txt", "--json", "--max-tokens", "8"))
    res = _launch(env, 2, "ingest", str(root / "a.txt"))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    shards = sorted((e for e in _entries(env) if e["name"] == "a.txt" and e["topology"]), key=lambda e: e["topology"])
    assert [e["topology"] for e in shards] == ["tensor:2:0", "tensor:2:1"]
    assert _answer(_launch(env, 2, "ask", QUESTION, "--doc", "a.txt", "--json", "--max-tokens", "8")) == one

    # each rank's file holds its KV head of what one process stores
    os.environ["LONGCTX_HOME"] = env["LONGCTX_HOME"]
    from longctx.store import Store

    store = Store(cleanup=False)
    try:
        whole = next(e for e in store.entries() if e.name == "a.txt" and not e.topology)
        full, _ = store.load(whole)
        parts = [store.load(store.get(s["id"]))[0] for s in shards]
    finally:
        store.close()
    for key, value in full.items():
        if value.ndim < 2:
            continue
        for r, part in enumerate(parts):
            want, got = np.array(value[:, r:r + 1]), np.array(part[key])
            assert got.shape == want.shape, key
            if want.dtype.kind == "u":  # packed indices: the same codes but for rare ties
                assert (got == want).mean() > 0.98, key
            else:
                np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2)


def test_the_wrong_topology_is_one_line_and_merge_makes_an_ordinary_entry(setup):
    root, env = setup
    res = _launch(env, 2, "ingest", str(root / "b.txt"))
    assert res.returncode == 0, res.stderr
    two = _answer(_launch(env, 2, "ask", QUESTION, "--doc", "b.txt", "--json", "--max-tokens", "8"))
    alone = _cli(env, "ask", QUESTION, "--doc", "b.txt")
    assert alone.returncode == 1 and "mlx.launch -n 2" in alone.stderr and "longctx merge b.txt" in alone.stderr
    assert len(alone.stderr.strip().splitlines()) == 1
    assert _cli(env, "merge", "b.txt").returncode == 0
    assert _answer(_cli(env, "ask", QUESTION, "--doc", "b.txt", "--json", "--max-tokens", "8")) == two


def test_reshard_splits_an_ordinary_entry_for_two_ranks(setup):
    root, env = setup
    assert _cli(env, "ingest", str(root / "c.txt")).returncode == 0
    one = _answer(_cli(env, "ask", QUESTION, "--doc", "c.txt", "--json", "--max-tokens", "8"))
    bad = _cli(env, "reshard", "c.txt", "--ranks", "3")
    assert bad.returncode == 1 and "do not divide" in bad.stderr
    assert _cli(env, "reshard", "c.txt", "--ranks", "2").returncode == 0
    assert _answer(_launch(env, 2, "ask", QUESTION, "--doc", "c.txt", "--json", "--max-tokens", "8")) == one


def test_three_ranks_are_refused_before_any_work(setup):
    root, env = setup
    before = len(_entries(env))
    res = _launch(env, 3, "ingest", str(root / "a.txt"), "--force")
    assert "3 ranks do not divide this model's 4 query and 2 KV heads; run it on 1 or 2 ranks" in res.stderr
    assert len(_entries(env)) == before


def _spawn(env: dict, hostfile: Path, rank: int, extra: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "longctx", *args],
                            env={**env, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), **extra},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_rank_killed_mid_ingest_leaves_no_entry_and_every_rank_fails(setup, tmp_path):
    root, env = setup
    doc = tmp_path / "d.txt"
    doc.write_text(TEXT.replace("412", "413"))
    base = _ports(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    ranks = [_spawn(env, hostfile, 0, {}, "ingest", str(doc)),
             _spawn(env, hostfile, 1, {"LONGCTX_FAILPOINT": "ingest:prefilled"}, "ingest", str(doc))]
    outs = [p.communicate(timeout=300) for p in ranks]
    assert ranks[0].returncode == 1 and "nothing of it is kept" in outs[0][1]
    assert ranks[1].returncode != 0  # SIGKILLed
    assert not [e for e in _entries(env) if e["name"] == "d.txt"]


def test_a_peer_that_never_comes_times_out_in_one_line(setup, tmp_path):
    root, env = setup
    base = _ports(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    start = time.time()
    p = _spawn(env, hostfile, 0, {"LONGCTX_PEER_TIMEOUT": "5"}, "ingest", str(root / "a.txt"))
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0 and "did not connect within 5 s" in err and len(err.strip().splitlines()) == 1
    assert time.time() - start < 60
