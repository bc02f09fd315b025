"""A bounded store: the size budget, least-recently-used eviction over units (groups), the lock
protocol (readers shared, evictors try-lock and skip busy entries), `gc`, `list`'s columns, and
a crash in the middle of an eviction."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from longctx import asking

from longctx import config, manage, session
from longctx.cli import app
from longctx.cli_render import ago, entries_table
from longctx.errors import ConfigError, EntryNotFound
from longctx.store import Entry, Store, budget

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def _put(store: Store, name: str, nbytes: int, used: float | None = None) -> Entry:
    """An entry whose cache file holds about `nbytes` (no model involved), last used at `used`."""
    eid = hashlib.sha256(name.encode()).hexdigest()[:16]
    entry = Entry(
        id=eid,
        name=name,
        path=f"/docs/{name}",
        document_sha256="d" * 64,
        kind="text",
        pages=1,
        tokens=nbytes // 4,
        model_id="tiny/model-with-a-long-name",
        model_spec="tiny",
        weights_sha256="w" * 64,
        tokenizer_sha256="t" * 64,
        kv_preset="tq4",
        file=f"{eid}.safetensors",
        bytes=0,
        created=0.0,
    )
    with store.lock(eid):
        entry = store.save(entry, {"tokens": mx.zeros((nbytes // 4,), dtype=mx.int32)}, {"document_name": name})
    if used is not None:
        store.record_use(eid, used)
    return entry


def _names(store: Store) -> list[str]:
    return sorted(e.name for e in store.entries())


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


# -- the budget setting --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("20GB", 20 * 10**9),
        ("500MiB", 500 * MiB),
        ("500M", 500 * MiB),
        ("1.5GiB", 3 * 2**29),
        ("123", 123),
        ("123B", 123),
        ("2kb", 2000),
        ("0", 0),
        ("none", 0),
        ("unlimited", 0),
    ],
)
def test_budget_setting_parses_sizes(raw, value, monkeypatch):
    monkeypatch.setenv("LONGCTX_MAX_STORE", raw)
    assert config.get("max_store") == value


@pytest.mark.parametrize("raw", ["lots", "-5GB", "5iB", "3Gi", "1e9", ""])
def test_budget_setting_refuses_non_sizes(raw, monkeypatch):
    monkeypatch.setenv("LONGCTX_MAX_STORE", raw)
    with pytest.raises(ConfigError, match="LONGCTX_MAX_STORE=.* is not valid"):
        config.get("max_store")


def test_default_budget_is_a_quarter_of_the_disk_capped_by_free_space(monkeypatch, tmp_path):
    usage = lambda total, free: lambda path: type("U", (), {"total": total, "free": free})()  # noqa: E731
    monkeypatch.setattr(budget.shutil, "disk_usage", usage(1000 * MiB, 900 * MiB))
    assert budget.default_budget(tmp_path, 0) == 250 * MiB
    monkeypatch.setattr(budget.shutil, "disk_usage", usage(1000 * MiB, 100 * MiB))
    assert budget.default_budget(tmp_path, 120 * MiB) == 170 * MiB  # the store + half the free
    assert budget.budget(tmp_path, 120 * MiB) == 170 * MiB
    monkeypatch.setenv("LONGCTX_MAX_STORE", "0")
    assert budget.budget(tmp_path, 120 * MiB) is None
    monkeypatch.setenv("LONGCTX_MAX_STORE", "5MiB")
    assert budget.budget(tmp_path, 120 * MiB) == 5 * MiB


# -- least recently used, over units ---------------------------------------------------------------
def test_evicts_least_recently_used_first_down_to_the_budget():
    store = Store()
    now = time.time()
    a = _put(store, "a.txt", MiB, used=now - 300)
    b = _put(store, "b.txt", MiB, used=now - 100)
    _put(store, "c.txt", MiB, used=now - 200)
    _put(store, "d.txt", MiB)  # never used since written: counts from now
    store.record_use(a.id, now - 10)  # asked again: a is now the most recent of the old three
    total = sum(e.bytes for e in store.entries())
    ev = budget.evict(store, total - b.bytes // 2)  # must free more than half an entry
    assert [u.entries[0].name for u in ev.removed] == ["c.txt"]
    ev = budget.evict(store, total - 2 * b.bytes)
    assert [u.entries[0].name for u in ev.removed] == ["b.txt"]
    assert _names(store) == ["a.txt", "d.txt"] and not ev.over_budget
    assert ev.freed == b.bytes and ev.bytes_after == sum(e.bytes for e in store.entries())
    assert sorted(os.listdir(store.caches)) == sorted(e.file for e in store.entries())
    assert set(store.last_used()) == {e.id for e in store.entries()}  # no use left behind
    assert budget.evict(store, 0, dry_run=True).removed and _names(store) == ["a.txt", "d.txt"]
    assert budget.evict(store, None).removed == []  # no limit


def test_the_entry_just_written_is_kept_even_alone_over_budget():
    store = Store()
    old = _put(store, "old.txt", MiB, used=time.time() - 60)
    new = _put(store, "new.txt", 2 * MiB)
    ev = budget.evict(store, MiB, keep=(new.id,))
    assert [u.key for u in ev.removed] == [old.id] and [u.key for u in ev.kept] == [new.id]
    assert ev.over_budget and ev.bytes_after == new.bytes and _names(store) == ["new.txt"]


def test_a_group_is_one_unit_sized_and_used_as_a_whole(monkeypatch):
    store = Store()
    now = time.time()
    parts = [_put(store, f"book.pdf#{i}", MiB, used=now - 500) for i in range(3)]
    lone = _put(store, "lone.txt", MiB, used=now - 400)
    store.record_use(parts[1].id, now - 5)  # one segment asked recently: the whole book is recent
    gid = "9" * 16
    real = Store.entries
    monkeypatch.setattr(
        Store, "entries", lambda self: [dataclasses.replace(e, group=gid) if e.name.startswith("book") else e for e in real(self)]
    )
    book = next(u for u in budget.units(store.entries(), store.last_used()) if u.key == gid)
    assert book.bytes == sum(p.bytes for p in parts) and book.last_used == now - 5
    ev = budget.evict(store, 3 * MiB + 4096)
    assert [u.key for u in ev.removed] == [lone.id] and len(store.entries()) == 3
    ev = budget.evict(store, 2 * MiB)  # the book goes as a whole, never one segment of it
    assert [u.key for u in ev.removed] == [gid] and real(store) == []
    assert os.listdir(store.caches) == []


def test_a_group_being_written_or_read_is_skipped_whole(monkeypatch):
    store = Store()
    parts = [_put(store, f"book.pdf#{i}", MiB, used=1.0) for i in range(2)]
    gid = "9" * 16
    real = Store.entries
    monkeypatch.setattr(Store, "entries", lambda self: [dataclasses.replace(e, group=gid) for e in real(self)])
    for busy in (gid, parts[1].id):  # its writer holds the group's lock; a reader one segment's
        with store.read_lock(busy) if busy != gid else store.lock(busy):
            ev = budget.evict(store, 0)
        assert ev.removed == [] and [u.key for u in ev.busy] == [gid] and len(real(store)) == 2


# -- the lock protocol ---------------------------------------------------------------------------
def test_busy_entries_are_skipped_not_waited_for(tmp_path):
    store = Store()
    a = _put(store, "a.txt", MiB, used=1.0)
    b = _put(store, "b.txt", MiB, used=2.0)
    c = _put(store, "c.txt", MiB, used=3.0)
    # Another process reads a (shared lock); this process writes b (exclusive, another fd).
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR);"
            "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); time.sleep(60)",
            str(store.locks / f"{a.id}.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with store.lock(b.id):
            ev = budget.evict(store, MiB + 4096)
        assert time.monotonic() - start < 5
    finally:
        holder.kill()
        holder.wait()
    assert [u.key for u in ev.busy] == [a.id, b.id] and [u.key for u in ev.removed] == [c.id]
    assert ev.over_budget and _names(store) == ["a.txt", "b.txt"]
    assert [u.key for u in budget.evict(store, MiB + 4096).removed] == [a.id]  # free again


def test_readers_hold_a_shared_lock_while_loading(tiny_model, text_doc):
    entry = session.ingest(text_doc, model=str(tiny_model)).entry
    store = Store(cleanup=False)
    seen = []

    def check(meta):  # runs while the file is being read
        with store.try_lock(entry.id) as free:
            seen.append(free)
        assert budget.evict(store, 0).busy

    arrays, _, pending = store.load_verifying(entry, check)
    pending.wait()
    assert seen == [False] and arrays
    with store.try_lock(entry.id) as free:
        assert free  # released once loaded


def test_an_entry_evicted_before_it_is_opened_says_so():
    store = Store()
    entry = _put(store, "gone.txt", MiB)
    assert budget.evict(store, 0).removed
    with pytest.raises(EntryNotFound, match="'gone.txt' was removed from the store.*ingest it again"):
        store.load_verifying(entry)


def test_ingest_evicts_after_saving_and_ask_counts_as_use(tiny_model, tmp_path, monkeypatch):
    docs = []
    for i, word in enumerate(["lighthouse", "ferry", "orchard"]):
        docs.append(tmp_path / f"{word}.txt")
        docs[-1].write_text(f"The {word} keeper is number {i}.\n" * 8)
    a = session.ingest(docs[0], model=str(tiny_model)).entry
    b = session.ingest(docs[1], model=str(tiny_model)).entry
    store = Store(cleanup=False)
    before = store.last_used()
    assert session.ingest(docs[1], model=str(tiny_model)).reused  # a reuse is a use
    assert "".join(asking.ask("Who?", doc=a.id, max_tokens=2)) is not None  # a: used after b
    after = store.last_used()
    assert before[b.id] < after[b.id] < after[a.id]
    store.close()
    monkeypatch.setenv("LONGCTX_MAX_STORE", str(a.bytes + b.bytes + a.bytes // 2))
    c = session.ingest(docs[2], model=str(tiny_model))
    assert [u.key for u in c.eviction.removed] == [b.id] and not c.eviction.over_budget
    assert sorted(e.id for e in manage.list_entries()) == sorted([a.id, c.entry.id])
    store = Store(cleanup=False)
    before = store.last_used()[a.id]
    manage.export(a.id, tmp_path / "a.safetensors")  # an export is a use
    assert store.last_used()[a.id] > before
    store.close()
    monkeypatch.setenv("LONGCTX_MAX_STORE", "1")  # the new entry alone is over: kept, and said
    result = CliRunner().invoke(app, ["ingest", str(docs[1]), "--model", str(tiny_model)])
    assert result.exit_code == 0, result.output
    warned = [ln for ln in result.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warned) == 1 and "ferry.txt alone" in warned[0] and "kept it" in warned[0]
    assert [e.name for e in manage.list_entries()] == ["ferry.txt"]


# -- gc and list ---------------------------------------------------------------------------------
def test_gc_evicts_to_the_given_size_and_dry_run_removes_nothing():
    store = Store()
    old = _put(store, "old.txt", MiB, used=time.time() - 7200)
    _put(store, "new.txt", MiB)
    leftover = store.caches / f".tmp-{'e' * 16}-999999-x.safetensors"
    leftover.write_bytes(b"partial")
    dry = _invoke("gc", "--max-size", "1.5MiB", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert f"would remove old.txt ({old.id}" in dry.stderr and "last used 2 h ago" in dry.stderr
    assert "would free 1.0 MiB" in dry.stderr
    assert _names(store) == ["new.txt", "old.txt"] and leftover.exists()
    done = _invoke("gc", "--max-size", "1.5MiB")
    assert done.exit_code == 0 and "removed old.txt" in done.stderr and "freed 1.0 MiB" in done.stderr
    assert "cleaned 1 crash leftovers" in done.stderr and not leftover.exists()
    assert _names(store) == ["new.txt"] and done.stdout == ""
    as_json = json.loads(_invoke("gc", "--max-size", "0", "--json").stdout)
    assert as_json["freed"] > MiB and [u["names"] for u in as_json["evicted"]] == [["new.txt"]]
    assert store.entries() == [] and os.listdir(store.caches) == []
    line = _invoke("gc", "--max-size", "lots").stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("error: --max-size 'lots' is not valid")


def test_list_shows_size_last_use_and_the_total_in_80_columns(monkeypatch):
    store = Store()
    now = time.time()
    _put(store, "a-rather-long-document-name-for-the-table.pdf", 3 * MiB, used=now - 3 * 3600 - 5)
    _put(store, "b.txt", MiB)
    monkeypatch.setenv("LONGCTX_MAX_STORE", "20GiB")
    result = CliRunner().invoke(app, ["list"], terminal_width=80, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 80 and len(lines) == 7  # table of 2 rows + total
    assert "on disk" in lines[1] and "last used" in lines[1]
    assert "3 h ago" in lines[4] and "3.0 MiB" in lines[4] and "just now" in lines[3]
    assert lines[-1] == "2 entries, 4.0 MiB of a 20.0 GiB budget (LONGCTX_MAX_STORE)"
    listed = json.loads(_invoke("list", "--json").stdout)
    assert [e["name"] for e in listed] == ["b.txt", "a-rather-long-document-name-for-the-table.pdf"]
    assert abs(listed[1]["last_used"] - (now - 3 * 3600 - 5)) < 1 and listed[0]["bytes"] >= MiB
    assert {f.name for f in dataclasses.fields(Entry)} <= set(listed[0])


@pytest.mark.parametrize("width", [60, 80, 120])
def test_list_table_fits_with_the_last_used_column(width):
    from rich.console import Console

    store = Store()
    entries = [_put(store, "report.pdf", MiB, used=time.time() - 50000)]
    console = Console(width=width, record=True, file=open(os.devnull, "w"))
    console.print(entries_table(entries, width, store.last_used()))
    lines = console.export_text().splitlines()
    assert max(len(ln) for ln in lines) <= width and len(lines) == 5
    assert ("13 h ago" in lines[3]) == (width >= 80)


def test_relative_times():
    assert [ago(1000 - s, now=1000) for s in (5, 61, 3 * 3600 + 1, 3 * 86400)] == ["just now", "1 min ago", "3 h ago", "3 d ago"]


# -- crashes -------------------------------------------------------------------------------------
def test_a_failure_between_unindexing_and_deleting_leaves_only_orphans(monkeypatch):
    store = Store()
    parts = [_put(store, f"book.pdf#{i}", MiB, used=1.0) for i in range(2)]
    real = Store.entries
    monkeypatch.setattr(Store, "entries", lambda self: [dataclasses.replace(e, group="9" * 16) for e in real(self)])
    monkeypatch.setenv("LONGCTX_FAILPOINT", "evict:unindexed:enospc")
    with pytest.raises(OSError):
        budget.evict(store, 0)
    monkeypatch.delenv("LONGCTX_FAILPOINT")
    assert real(store) == [] and store.last_used() == {}  # the whole group, in one transaction
    assert len(os.listdir(store.caches)) == 2
    assert Store(cleanup=False).cleanup()["orphans"] == 2 and os.listdir(store.caches) == []
    assert all(not store.cache_path(p.id).exists() for p in parts)


def test_sigkill_mid_eviction_leaves_a_consistent_store(tmp_path):
    store = Store()
    old = _put(store, "old.txt", MiB, used=1.0)
    new = _put(store, "new.txt", MiB)
    store.close()
    env = {**os.environ, "LONGCTX_FAILPOINT": "evict:unindexed"}
    proc = subprocess.run(
        [sys.executable, "-m", "longctx", "gc", "--max-size", "1.5MiB"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    raw = Store(cleanup=False)
    assert [e.id for e in raw.entries()] == [new.id]  # unindexed, its file not yet deleted
    assert sorted(os.listdir(raw.caches)) == sorted([old.file, new.file])
    raw.close()
    fresh = Store()  # the next start deletes the orphan
    assert os.listdir(fresh.caches) == [new.file] and list(fresh.last_used()) == [new.id]
    assert [u.key for u in budget.evict(fresh, 1.5 * MiB).removed] == []
