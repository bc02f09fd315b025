"""Tensor, pipeline and data parallelism under MLX's launcher, as users run it: `mlx.launch
--backend ring -n 2 -- longctx ingest/ask` on 127.0.0.1 (free ports, every run under a timeout),
on tiny random models (a llama with 4 query and 2 KV heads; a 3-layer qwen2, whose family has
mlx-lm's `pipeline`). Answers equal one process's; each rank stores its heads' or its layers'
share; merge and reshard round trips; data-parallel ranks write one process's group of segments;
the refusals and faults a user meets."""

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
    cmd = [
        str(LAUNCH),
        "--backend",
        "ring",
        "-n",
        str(n),
        "--starting-port",
        str(_ports(n)),
        "--",
        sys.executable,
        "-m",
        "longctx",
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _cli(env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longctx", *args], env=env, capture_output=True, text=True, timeout=timeout)


def _answer(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count('"answer"') == 1, res.stdout  # rank 0 alone prints
    return json.loads(res.stdout[res.stdout.index("{") :])["answer"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    model = make_tiny_model(root / "tiny", context=2048, attn_gain=2.0)
    env = {**os.environ, "LONGCTX_HOME": str(root / "home"), "LONGCTX_MODEL": str(model), "LONGCTX_PEER_TIMEOUT": "30"}
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
            want, got = np.array(value[:, r : r + 1]), np.array(part[key])
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
    return subprocess.Popen(
        [sys.executable, "-m", "longctx", *args],
        env={**env, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), **extra},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_rank_killed_mid_ingest_leaves_no_entry_and_every_rank_fails(setup, tmp_path):
    root, env = setup
    doc = tmp_path / "d.txt"
    doc.write_text(TEXT.replace("412", "413"))
    base = _ports(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    ranks = [
        _spawn(env, hostfile, 0, {}, "ingest", str(doc)),
        _spawn(env, hostfile, 1, {"LONGCTX_FAILPOINT": "ingest:prefilled"}, "ingest", str(doc)),
    ]
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


# -- pipeline parallelism: each rank a run of whole layers (mlx-lm's `pipeline`, qwen2 has it) ------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A 3-layer qwen2: stage 1 holds layer 0 alone, stage 0 layers 1-2 (an uneven split, so one
    stage's small cache parts are stacked and the other's are not)."""
    root = tmp_path_factory.mktemp("pipe")
    model = make_tiny_model(root / "tiny-qwen2", seed=4, context=2048, attn_gain=2.0, model_type="qwen2", layers=3)
    env = {**os.environ, "LONGCTX_HOME": str(root / "home"), "LONGCTX_MODEL": str(model), "LONGCTX_PEER_TIMEOUT": "30"}
    (root / "p.txt").write_text(TEXT + "This is p.txt.\n")
    return root, env


def _arrays(env: dict, entry_id: str) -> dict:
    """An entry's arrays per layer (numpy), as `manage` splits a cache file."""
    from longctx import manage
    from longctx.store import Store

    os.environ["LONGCTX_HOME"] = env["LONGCTX_HOME"]
    store = Store(cleanup=False)
    try:
        arrays, _ = store.load(store.get(entry_id))
        layers, _ = manage._layers_of(arrays)
        return {i: {k: np.array(v) for k, v in parts.items()} for i, parts in layers.items()}
    finally:
        store.close()


def _token_major(env: dict, doc: str) -> dict:
    """One process's cache of `doc` prefilled token-major, as every pipeline stage prefills it
    (a single process's ingest may go layer-major: its later layers' codes then differ a little)."""
    from longctx import engine, kvcache, manage, session
    from longctx.runtime import models

    p = session.plan(doc, env["LONGCTX_MODEL"])
    lm = models.load(p.model)
    cache = kvcache.make(lm.model, p.preset)
    engine.prefill(lm.model, p.tokens, cache, order="token")
    layers, _ = manage._layers_of(kvcache.to_arrays(cache, p.preset))
    return {i: {k: np.array(v) for k, v in parts.items()} for i, parts in layers.items()}


def _same(got: np.ndarray, want: np.ndarray, what: str, exact: bool = False) -> None:
    assert got.shape == want.shape, what
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=what)
    elif want.dtype.kind == "u":  # packed indices: the same codes but for rare ties
        assert (got == want).mean() > 0.98, what
    else:
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2)


def test_pipeline_stages_answer_as_one_process_store_their_layers_and_merge(qwen):
    root, env = qwen
    doc = str(root / "p.txt")
    res = _launch(env, 2, "ingest", doc, "--parallel", "pipeline")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    stages = sorted((e for e in _entries(env) if e["topology"]), key=lambda e: e["topology"])
    assert [e["topology"] for e in stages] == ["pipeline:2:0:1-3", "pipeline:2:1:0-1"]
    two = _answer(_launch(env, 2, "ask", QUESTION, "--doc", "p.txt", "--json", "--max-tokens", "8", "--parallel", "pipeline"))

    # asked from the wrong topology: one line saying how
    alone = _cli(env, "ask", QUESTION, "--doc", "p.txt")
    assert alone.returncode == 1 and len(alone.stderr.strip().splitlines()) == 1, alone.stderr
    assert "mlx.launch -n 2` with `--parallel pipeline`" in alone.stderr and "longctx merge p.txt" in alone.stderr

    assert _cli(env, "ingest", doc).returncode == 0
    one = _answer(_cli(env, "ask", QUESTION, "--doc", "p.txt", "--json", "--max-tokens", "8"))
    assert two == one
    whole = next(e for e in _entries(env) if e["name"] == "p.txt" and not e["topology"])
    single = _token_major(env, doc)

    # each stage's file holds its layers of what one process stores (codec seeds numbered globally)
    parts = {}
    for e in stages:
        lo = int(e["topology"].split(":")[3].split("-")[0])
        for i, layer in _arrays(env, e["id"]).items():
            parts[lo + i] = layer
            for name, got in layer.items():
                _same(got, single[lo + i][name], f"layer {lo + i} {name}")
    assert sorted(parts) == sorted(single) == [0, 1, 2]

    # merge joins the stages into one entry (in place of the single-process one: its address)
    assert _cli(env, "rm", whole["id"]).returncode == 0
    assert _cli(env, "merge", "p.txt").returncode == 0
    merged = _arrays(env, whole["id"])  # the same content address as the single-process entry
    for i, layer in parts.items():
        for name, got in layer.items():
            _same(merged[i][name], got, f"merged layer {i} {name}", exact=True)
    assert _answer(_cli(env, "ask", QUESTION, "--doc", "p.txt", "--json", "--max-tokens", "8")) == one

    # reshard for pipeline stages: the stages' files again, bit for bit
    made = _cli(env, "reshard", "p.txt", "--ranks", "2", "--parallel", "pipeline")
    assert made.returncode == 0, made.stderr
    for e in stages:
        lo = int(e["topology"].split(":")[3].split("-")[0])
        for i, layer in _arrays(env, e["id"]).items():
            for name, got in layer.items():
                _same(got, parts[lo + i][name], f"resharded layer {lo + i} {name}", exact=True)
    too_many = _cli(env, "reshard", "p.txt", "--ranks", "4", "--parallel", "pipeline")
    assert too_many.returncode == 1 and "exceed the cache's 3 layers" in too_many.stderr


def test_a_family_without_pipeline_is_refused_in_one_line(setup):
    root, env = setup
    res = _launch(env, 2, "ingest", str(root / "a.txt"), "--force", "--parallel", "pipeline")
    lines = [ln for ln in res.stderr.splitlines() if "pipeline parallelism" in ln]
    assert lines and "'llama' family" in lines[0] and "qwen2" in lines[0], res.stderr
    assert "Traceback" not in res.stderr


# -- data parallelism: whole-model ranks ingest disjoint segments of a long document -------------


def _long_document(env: dict, tmp_path: Path) -> tuple[Path, dict]:
    """A document past a 1024-token model's context, and the environment that cuts it into
    300-token segments."""
    model = make_tiny_model(tmp_path / "tiny-1k", seed=4, context=1024, attn_gain=2.0, model_type="qwen2", layers=2)
    long = tmp_path / "long.txt"
    long.write_text("\n\n".join(f"Part {i}. " + TEXT.splitlines()[0].replace("412", str(400 + i)) for i in range(12)) + "\n")
    return long, {**env, "LONGCTX_HOME": str(tmp_path / "one"), "LONGCTX_MODEL": str(model), "LONGCTX_SEGMENT_TOKENS": "300"}


def test_data_parallel_segments_make_the_same_group_as_one_process(qwen, tmp_path):
    root, env = qwen
    long, one_env = _long_document(env, tmp_path)
    two_env = {**one_env, "LONGCTX_HOME": str(tmp_path / "two")}
    assert _cli(one_env, "ingest", str(long)).returncode == 0
    refused = _launch(two_env, 2, "ingest", str(long))  # tensor ranks: one line saying how
    assert "ingest it with --parallel data" in refused.stderr and "Traceback" not in refused.stderr
    res = _launch(two_env, 2, "ingest", str(long), "--parallel", "data")
    assert res.returncode == 0 and "Traceback" not in res.stderr and "error" not in res.stderr, res.stderr

    def group(e: dict) -> dict:
        from longctx.store import Store, groups

        os.environ["LONGCTX_HOME"] = e["LONGCTX_HOME"]
        store = Store(cleanup=False)
        try:
            (g,) = groups.groups(store)
            return g
        finally:
            store.close()

    a, b = group(one_env), group(two_env)
    assert len(a.segments) >= 3
    assert [(s["id"], s["label"], s["tokens"]) for s in b.segments] == [(s["id"], s["label"], s["tokens"]) for s in a.segments]
    assert (b.id, b.tokens, b.bytes) == (a.id, a.tokens, a.bytes)
    for s in a.segments:  # every segment was ingested once, by one rank, as one process would
        want, got = _arrays(one_env, s["id"]), _arrays(two_env, s["id"])
        for i, layer in want.items():
            for name, arr in layer.items():
                _same(got[i][name], arr, f"segment {s['label']} layer {i} {name}")


def test_a_data_parallel_rank_killed_leaves_no_group_and_the_other_fails_in_one_line(qwen, tmp_path):
    root, env = qwen
    long, env = _long_document(env, tmp_path)
    base = _ports(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    ranks = [
        _spawn(env, hostfile, 0, {}, "ingest", str(long), "--parallel", "data"),
        _spawn(env, hostfile, 1, {"LONGCTX_FAILPOINT": "ingest:prefilled"}, "ingest", str(long), "--parallel", "data"),
    ]
    outs = [p.communicate(timeout=300) for p in ranks]
    assert ranks[0].returncode == 1 and "Another rank failed while ingesting 'long.txt'" in outs[0][1], outs[0][1]
    assert len([ln for ln in outs[0][1].splitlines() if ln.startswith("error")]) == 1 and "Traceback" not in outs[0][1]
    assert ranks[1].returncode != 0  # SIGKILLed
    from longctx.store import Store, groups

    os.environ["LONGCTX_HOME"] = env["LONGCTX_HOME"]
    store = Store(cleanup=False)
    try:
        assert groups.groups(store) == []  # the segments saved stay, for the next ingest to reuse
    finally:
        store.close()


# -- the demo model on the sample report: the README's question under the launcher -----------------

REPORT = Path(__file__).resolve().parent.parent / "samples" / "report.pdf"


@pytest.mark.slow
def test_the_demo_model_answers_the_report_alike_on_three_tensor_ranks(tmp_path):
    """SmolLM2-135M (9 query and 3 KV heads: N = 3) ingests the sample report on 3 ring ranks
    and answers the README's question with one process's greedy answer, which names the chief
    engineer; each rank holds a third of the cache. (The default model, 2 KV heads, runs N = 2
    the same way: benchmarks/distributed.py, results/distributed_cpu.json.)"""
    env = {**os.environ, "LONGCTX_HOME": str(tmp_path / "home"), "LONGCTX_MODEL": "smollm2", "LONGCTX_PEER_TIMEOUT": "60"}
    question = "Who is the chief engineer of the cooperative?"
    assert _cli(env, "ingest", str(REPORT), timeout=600).returncode == 0
    one = _answer(_cli(env, "ask", question, "--json", "--max-tokens", "24", timeout=600))
    assert "Marta Okonkwo" in one
    res = _launch(env, 3, "ingest", str(REPORT), timeout=900)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    shards = sorted((e for e in _entries(env) if e["topology"]), key=lambda e: e["topology"])
    whole = next(e for e in _entries(env) if not e["topology"])
    assert [e["topology"] for e in shards] == ["tensor:3:0", "tensor:3:1", "tensor:3:2"]
    assert all(abs(3 * e["bytes"] - whole["bytes"]) < 0.03 * whole["bytes"] for e in shards)  # a third each
    assert _answer(_launch(env, 3, "ask", question, "--json", "--max-tokens", "24", timeout=900)) == one
