"""Crashes and concurrency with real processes: `python -m longctx` killed with SIGKILL at named
points (via `LONGCTX_FAILPOINT`, see `longctx.store.failpoints`), four concurrent ingests of one
document, and `ask` while another document is being written.

Each process start costs ~2-3 s on a 2-core CPU, so processes run a few at a time, in homes
copied from one warmed-up data dir (model hash and CPU weights already built).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from longctx import asking

from longctx import manage, session
from longctx.runtime import models
from longctx.store import Store

ROOT = Path(__file__).resolve().parents[1]
INGEST_POINTS = [
    "ingest:locked",
    "ingest:prefilled",
    "write:opened",
    "write:mid",
    "write:arrays",
    "write:written",
    "write:synced",
    "write:renamed",
    "save:written",
    "save:indexed",
    "save:done",
]
TEMP_LEFT = {"write:opened", "write:mid", "write:arrays", "write:written", "write:synced"}
FILE_UNINDEXED = {"write:renamed", "save:written"}
INDEXED = {"save:indexed", "save:done"}
BATCH = 4


@pytest.fixture(scope="module")
def warm_home(tmp_path_factory, tiny_model):
    home = tmp_path_factory.mktemp("warm") / "home"
    mp = pytest.MonkeyPatch()
    mp.setenv("LONGCTX_HOME", str(home))
    models.load(models.resolve(str(tiny_model)))  # builds the hash cache and the CPU weights
    mp.undo()
    return home


def _home(warm_home: Path, path: Path) -> Path:
    shutil.copytree(warm_home, path)
    return path


def _cli(args: list[str], home: Path, failpoint: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LONGCTX_FAILPOINT"}
    env["LONGCTX_HOME"] = str(home)
    if failpoint:
        env["LONGCTX_FAILPOINT"] = failpoint
    return subprocess.Popen(
        [sys.executable, "-m", "longctx", *map(str, args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_all(jobs: list[tuple[list[str], Path, str | None]]) -> list[tuple[int, str, str]]:
    """Run CLI jobs `BATCH` at a time; (returncode, stdout, stderr) each."""
    results = []
    for i in range(0, len(jobs), BATCH):
        procs = [_cli(*job) for job in jobs[i : i + BATCH]]
        for p in procs:
            out, err = p.communicate(timeout=180)
            results.append((p.returncode, out, err))
    return results


def _files(store: Store) -> tuple[list[str], list[str]]:
    names = sorted(os.listdir(store.caches))
    return [n for n in names if n.startswith(".tmp-")], [n for n in names if not n.startswith(".")]


def test_sigkill_at_any_point_leaves_a_consistent_store(warm_home, tiny_model, text_doc, tmp_path, monkeypatch):
    jobs, homes = [], {}
    for point in INGEST_POINTS:
        homes[point] = _home(warm_home, tmp_path / point.replace(":", "-"))
        jobs.append((["ingest", text_doc, "--model", tiny_model], homes[point], point))
    # rm killed between unindexing and deleting: starts from an ingested document.
    homes["remove:unindexed"] = rm_home = _home(warm_home, tmp_path / "remove")
    monkeypatch.setenv("LONGCTX_HOME", str(rm_home))
    session.ingest(text_doc, model=str(tiny_model))
    jobs.append((["rm", text_doc.name], rm_home, "remove:unindexed"))

    results = _run_all(jobs)
    assert len(homes) >= 10
    for (point, home), (rc, out, err) in zip(homes.items(), results):
        assert rc == -signal.SIGKILL, (point, rc, err[-2000:])
        monkeypatch.setenv("LONGCTX_HOME", str(home))
        raw = Store(cleanup=False)
        temps, caches = _files(raw)
        indexed = [e.id for e in raw.entries()]
        raw.close()
        # The process died where it was told to: what it left proves it.
        assert bool(temps) == (point in TEMP_LEFT), (point, temps)
        assert len(caches) == (point in FILE_UNINDEXED | INDEXED | {"remove:unindexed"}), (point, caches)
        assert len(indexed) == (point in INDEXED), (point, indexed)

        store = Store()  # the next start cleans up
        temps, caches = _files(store)
        entries = store.entries()
        assert temps == [], point
        assert caches == [f"{e.id}.safetensors" for e in entries], point
        assert all(store.verify(e) for e in entries), point
        store.close()
        assert [e.name for e in manage.list_entries()] == (["facts.txt"] if point in INDEXED else [])

        again = session.ingest(text_doc, model=str(tiny_model))  # the document ingests again
        assert again.reused == (point in INDEXED), point
        assert "".join(asking.ask("Who keeps the lighthouse?", max_tokens=3)) is not None


def test_four_concurrent_ingests_build_one_entry(warm_home, tiny_model, text_doc, tmp_path):
    home = _home(warm_home, tmp_path / "home4")
    results = _run_all([(["ingest", text_doc, "--model", tiny_model, "--json"], home, None)] * 4)
    assert [rc for rc, _, _ in results] == [0] * 4, [err[-1500:] for _, _, err in results]
    outs = [json.loads(out) for _, out, _ in results]
    assert sorted(o["reused"] for o in outs) == [False, True, True, True]
    assert len({o["id"] for o in outs}) == 1
    store = Store(home / "store", cleanup=False)
    temps, caches = _files(store)
    assert temps == [] and caches == [f"{outs[0]['id']}.safetensors"]
    assert [e.id for e in store.entries()] == [outs[0]["id"]]
    assert store.verify(store.entries()[0])


def test_ask_while_another_document_is_mid_write(warm_home, tiny_model, text_doc, tmp_path, monkeypatch):
    home = _home(warm_home, tmp_path / "busy")
    monkeypatch.setenv("LONGCTX_HOME", str(home))
    first = session.ingest(text_doc, model=str(tiny_model)).entry
    other = tmp_path / "other.txt"
    other.write_text("The ferry leaves at noon from the north pier.\n" * 5)

    writer = _cli(["ingest", other, "--model", tiny_model], home, "write:mid:stop")
    try:
        _, status = os.waitpid(writer.pid, os.WUNTRACED)  # returns once it stops itself mid-write
        assert os.WIFSTOPPED(status), writer.communicate()
        store = Store(cleanup=False)
        temps, _ = _files(store)
        assert len(temps) == 1

        answer = session.Answer()
        text = "".join(asking.ask("Who keeps the lighthouse?", doc=first.id, max_tokens=4, answer=answer))
        assert answer.entry.id == first.id and text is not None
        # Neither that ask's store nor an explicit cleanup touched the live writer's temp file.
        assert store.cleanup()["temps"] == 0 and _files(store)[0] == temps
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    _, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err[-2000:]
    names = sorted(e.name for e in manage.list_entries())
    assert names == ["facts.txt", "other.txt"]
    store = Store()
    assert _files(store)[0] == [] and all(store.verify(e) for e in store.entries())
