"""The cache store: file format and validation, index hardening, cleanup, locking, disk space,
permissions and names, mismatches. In-process, on a tiny random-weight model."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sqlite3
import stat
import struct
import time
from collections import namedtuple
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from longctx import asking

from longctx import kvcache, manage, session
from longctx.errors import CacheCorrupt, CacheFormatUnsupported, CacheMismatch, EntryNotFound, StoreError
from longctx.runtime import models
from longctx.store import Entry, Store, layout
from longctx.store import format as fmt
from longctx.store.index import SafeJSONDisk

PACKAGE = Path(__file__).resolve().parents[1] / "longctx"


def _ingest(doc, model, preset="fp16", **kw):
    return session.ingest(doc, model=str(model), preset=preset, **kw).entry


def _forge(path: Path, edit) -> None:
    """Rewrite a cache file's header through `edit(header)` with a valid header checksum."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]
    edit(header)

    def dump(h):
        raw = json.dumps(h, separators=(",", ":")).encode()
        return raw + b" " * (-len(raw) % 8)

    header["__metadata__"]["header_sha256"] = "0" * 64
    header["__metadata__"]["header_sha256"] = hashlib.sha256(dump(header)).hexdigest()
    head = dump(header)
    path.write_bytes(struct.pack("<Q", len(head)) + head + body)


def _restore(entry, model):
    lm = models.load(models.resolve(str(model)))
    store = Store()
    try:
        return session.restore(entry, lm, store)
    finally:
        store.close()


# -- format ------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", list(kvcache.PRESETS))
def test_every_preset_round_trips_and_matches_its_layout(tiny_model, text_doc, preset):
    """The layout expected from metadata is exactly what kvcache.to_arrays writes, per preset."""
    entry = _ingest(text_doc, tiny_model, preset)
    store = Store()
    with fmt.open_cache(store.cache_path(entry.id), entry.name, "hint") as reader:
        want = layout.expected(reader.header.meta)
        assert set(want) == set(reader.header.tensors)
        layout.check(reader.header, entry.name, "hint")
        reader.verify()
    cache = _restore(entry, tiny_model)
    assert all(c.offset == entry.tokens for c in cache)


def test_file_is_plain_safetensors_with_checksums(tiny_model, text_doc):
    from safetensors.numpy import load_file

    entry = _ingest(text_doc, tiny_model)
    path = Store().cache_path(entry.id)
    loaded, meta = mx.load(str(path), return_metadata=True)
    assert meta["format_version"] == fmt.FORMAT_VERSION and len(meta["header_sha256"]) == 64
    sums = json.loads(meta["checksums"])
    assert set(sums) == set(loaded) == set(load_file(str(path)))
    assert loaded["tokens"].shape == (entry.tokens,)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_every_header_byte_is_covered(tiny_model, text_doc):
    """Flip each byte of the header in turn: every single change is refused."""
    entry = _ingest(text_doc, tiny_model)
    store = Store()
    path = store.cache_path(entry.id)
    original = path.read_bytes()
    (n,) = struct.unpack("<Q", original[:8])
    for pos in range(8 + n):
        data = bytearray(original)
        data[pos] ^= 0x01 if pos % 2 else 0x20
        path.write_bytes(bytes(data))
        with pytest.raises(CacheCorrupt):
            store.load(entry)
    path.write_bytes(original)
    store.load(entry)


def test_data_bit_flips_are_refused(tiny_model, text_doc):
    """A flipped bit anywhere in the arrays' bytes fails that array's checksum (the reads run on
    worker threads; the error still names the array)."""
    import random

    entry = _ingest(text_doc, tiny_model)
    store = Store()
    path = store.cache_path(entry.id)
    want = {k: np.array(v) for k, v in store.load(entry)[0].items()}
    original = path.read_bytes()
    (n,) = struct.unpack("<Q", original[:8])
    rng = random.Random(7)
    for pos in [8 + n, len(original) - 1] + rng.sample(range(8 + n, len(original)), 8):
        data = bytearray(original)
        data[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        with pytest.raises(CacheCorrupt, match="array '.*' fails its checksum"):
            store.load(entry)
    path.write_bytes(original)
    got, _ = store.load(entry)
    for name, arr in want.items():
        np.testing.assert_array_equal(np.array(got[name]), arr, err_msg=name)


def test_load_verifying_hands_out_arrays_and_refuses_on_wait(tiny_model, text_doc):
    """`load_verifying` returns the arrays while their checksums run; `wait()` then refuses a
    flipped data bit (every call, once failed) and passes an intact file."""
    entry = _ingest(text_doc, tiny_model)
    store = Store()
    path = store.cache_path(entry.id)
    original = path.read_bytes()
    want, _ = store.load(entry)
    got, _, pending = store.load_verifying(entry)
    pending.wait()
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(np.array(got[name]), np.array(want[name]), err_msg=name)
    data = bytearray(original)
    data[len(data) - 3] ^= 0x04
    path.write_bytes(bytes(data))
    got, _, pending = store.load_verifying(entry)  # no error yet: the arrays come first
    assert set(got) == set(want)
    for _ in range(2):
        with pytest.raises(CacheCorrupt, match="array '.*' fails its checksum"):
            pending.wait()


def test_ask_shows_nothing_from_a_cache_that_fails_its_checksums(tiny_model, text_doc):
    """`ask` starts the question while the checksums run, but a damaged cache yields no text:
    the first token waits for every checksum."""
    entry = _ingest(text_doc, tiny_model)
    assert "".join(asking.ask("Who keeps the lighthouse?", max_tokens=4))  # intact: text comes
    path = Store().cache_path(entry.id)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x08
    path.write_bytes(bytes(data))
    shown = []
    with pytest.raises(CacheCorrupt, match="fails its checksum"):
        for piece in asking.ask("Who keeps the lighthouse?", max_tokens=4):
            shown.append(piece)
    assert shown == []


def test_without_dev_fd_arrays_come_through_numpy(tiny_model, text_doc, monkeypatch):
    """Where /dev/fd does not exist arrays are read on worker threads and copied through numpy:
    the same arrays as MLX's reader gives."""
    entry = _ingest(text_doc, tiny_model)
    store = Store()
    want, _ = store.load(entry)
    monkeypatch.setattr(fmt, "FD_DIR", "/nonexistent-fd-dir")
    got, _ = store.load(entry)
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(np.array(got[name]), np.array(want[name]), err_msg=name)


def test_a_file_edited_in_place_while_read_is_refused(tiny_model, text_doc):
    """Bytes rewritten in place after the arrays were read (even with the same values) change
    the file's modification time: `wait()` refuses it rather than vouch for bytes it may not
    have seen."""
    import time

    entry = _ingest(text_doc, tiny_model)
    store = Store()
    path = store.cache_path(entry.id)
    with fmt.open_cache(path, entry.name, "hint") as reader:
        arrays, pending = reader.arrays_verifying()
        time.sleep(0.01)
        with open(path, "r+b") as f:  # same bytes, written again
            f.seek(-4, os.SEEK_END)
            last = f.read(4)
            f.seek(-4, os.SEEK_END)
            f.write(last)
        with pytest.raises(CacheCorrupt, match="changed while it was being read"):
            pending.wait()


def test_abandoned_checks_stop_and_close_their_descriptor(tiny_model, text_doc):
    """Checks dropped without `wait()` stop and close their duplicate of the file descriptor."""
    import gc

    entry = _ingest(text_doc, tiny_model)
    path = Store().cache_path(entry.id)
    with fmt.open_cache(path, entry.name, "hint") as reader:
        pending = reader.checksums_running()
        fd = pending._fd
        os.fstat(fd)  # open while the checks run
    del pending
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.parametrize("where", ["empty", "7", "8", "header-1", "header", "data-1", "mid", "end-1"])
def test_truncated_file_is_corrupt(tiny_model, text_doc, where):
    entry = _ingest(text_doc, tiny_model)
    store = Store()
    path = store.cache_path(entry.id)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    cut = {
        "empty": 0,
        "7": 7,
        "8": 8,
        "header-1": 8 + n - 1,
        "header": 8 + n,
        "data-1": 8 + n + 1,
        "mid": len(data) // 2,
        "end-1": len(data) - 1,
    }[where]
    path.write_bytes(data[:cut])
    with pytest.raises(CacheCorrupt) as err:
        session.restore(entry, models.load(models.resolve(str(tiny_model))), store)
    message = str(err.value)
    assert "facts.txt" in message and f"longctx ingest --force {text_doc}" in message
    assert "\n" not in message


def test_huge_shapes_are_refused_before_allocating(tiny_model, text_doc, monkeypatch):
    import numpy as np

    entry = _ingest(text_doc, tiny_model)
    store = Store()
    path = store.cache_path(entry.id)

    def huge(h):
        h["0.k"]["shape"] = [1, 2, 1 << 40, 32]
        h["0.k"]["data_offsets"][1] = h["0.k"]["data_offsets"][0] + (1 << 47)

    _forge(path, huge)
    allocations = []
    real_empty = np.empty
    monkeypatch.setattr(np, "empty", lambda *a, **k: allocations.append(a) or real_empty(*a, **k))
    with pytest.raises(CacheCorrupt, match="outside the file"):
        store.load(entry)
    assert allocations == []


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda h: h["__metadata__"].update(tokens="5"), "tokens differ"),
        (lambda h: h.pop("1.v"), "leaves a gap|unexplained"),
        (lambda h: h["0.k"].update(dtype="F32"), "does not match its byte size"),
        (lambda h: h["0.k"].update(dtype="Q7"), "unknown dtype"),
        (lambda h: h["__metadata__"].pop("kv_config"), "lacks kv_config"),
        (lambda h: h["__metadata__"].update(checksums="{}"), "checksum table"),
    ],
)
def test_forged_headers_are_refused(tiny_model, text_doc, edit, match):
    entry = _ingest(text_doc, tiny_model)
    path = Store().cache_path(entry.id)
    _forge(path, edit)
    with pytest.raises(CacheCorrupt, match=match):
        Store().load(entry)


def test_layout_names_every_layer_and_token_axis(tiny_model, text_doc):
    """A consistent file whose metadata claims another layer count or token count is refused."""
    entry = _ingest(text_doc, tiny_model)
    path = Store().cache_path(entry.id)

    def three_layers(h):
        cfg = json.loads(h["__metadata__"]["kv_config"])
        cfg["head_dims"], cfg["kv_heads"] = cfg["head_dims"] * 2, cfg["kv_heads"] * 2
        h["__metadata__"]["kv_config"] = json.dumps(cfg)

    _forge(path, three_layers)
    with pytest.raises(CacheCorrupt, match="missing 2.k"):
        Store().load(entry)
    with pytest.raises(ValueError):
        layout.expected({"tokens": "0", "kv_config": "{}"})


@pytest.mark.parametrize(("version", "newer"), [("4", True), ("17", True), ("1", False)])
def test_other_format_versions(tiny_model, text_doc, version, newer):
    entry = _ingest(text_doc, tiny_model)
    _forge(Store().cache_path(entry.id), lambda h: h["__metadata__"].update(format_version=version))
    with pytest.raises(CacheFormatUnsupported) as err:
        Store().load(entry)
    message = str(err.value)
    assert ("upgrade longctx" in message) == newer and "longctx ingest --force" in message
    assert f"format {version}" in message


def test_compressed_layers_small_arrays_are_stacked(tiny_model, text_doc):
    """Format 3: means, sinks and norms of all compressed layers are one array each (the layers'
    arrays concatenated along the batch axis); the packed indices stay per layer."""
    entry = _ingest(text_doc, tiny_model, "tq3+qjl")
    with fmt.open_cache(Store().cache_path(entry.id), entry.name, "hint") as reader:
        tensors = reader.header.tensors
    n_layers = len(json.loads(reader.header.meta["kv_config"])["head_dims"])
    assert n_layers > 1
    for tag, parts in (("k", ("mu", "sink", "norm", "rnorm")), ("v", ("mu", "sink", "norm"))):
        for part in parts:
            assert tensors[f"turbo.{tag}.{part}"].shape[0] == n_layers
            assert not any(f"{i}.{tag}.{part}" in tensors for i in range(n_layers))
        assert all(f"{i}.{tag}.idx" in tensors for i in range(n_layers))
    assert "0.k.qjl" in tensors and "turbo.v.rnorm" not in tensors


@pytest.mark.parametrize("preset", ["tq4", "tq3+qjl"])
def test_format_2_files_still_restore(tiny_model, text_doc, monkeypatch, preset):
    """A file of format 2 (every array per layer) restores to the same caches as format 3."""
    entry = _ingest(text_doc, tiny_model, preset)
    path = Store().cache_path(entry.id)
    want = _restore(entry, tiny_model)
    arrays, meta = mx.load(str(path), return_metadata=True)
    per_layer = {}
    for name, arr in arrays.items():
        if name.startswith("turbo."):
            per_layer.update({f"{i}.{name[6:]}": arr[i : i + 1] for i in range(arr.shape[0])})
        else:
            per_layer[name] = arr
    assert len(per_layer) > len(arrays)
    keep = {k: v for k, v in meta.items() if k not in ("format_version", "checksums", "header_sha256")}

    def write_v2(arrays_v2):
        monkeypatch.setattr(fmt, "FORMAT_VERSION", "2")
        fmt.write(path, arrays_v2, keep)
        monkeypatch.setattr(fmt, "FORMAT_VERSION", "3")

    write_v2(per_layer)
    with fmt.open_cache(path, entry.name, "hint") as reader:
        assert reader.header.meta["format_version"] == "2"
        assert not any(n.startswith("turbo.") for n in reader.header.tensors)
    got = _restore(entry, tiny_model)
    for a, b in zip(want, got):
        assert a.offset == b.offset and set(a.arrays()) == set(b.arrays())
        for name, x in a.arrays().items():
            y = b.arrays()[name]
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(np.array(x), np.array(y), err_msg=name)
    # and the layout of format 2 is enforced as such: a stacked name in a format-2 file is refused
    arrays2 = dict(per_layer)
    arrays2["turbo.k.mu"] = mx.concatenate([arrays2.pop(f"{i}.k.mu") for i in range(arrays["turbo.k.mu"].shape[0])])
    write_v2(arrays2)
    with pytest.raises(CacheCorrupt, match="do not match its KV layout"):
        Store().load(entry)


def test_version_1_file_written_by_mlx(tiny_model, text_doc):
    """Caches of the first format (mx.save_safetensors, no checksums) ask to be rebuilt."""
    entry = _ingest(text_doc, tiny_model)
    path = Store().cache_path(entry.id)
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(path), arrays, {**meta, "format_version": "1"})
    with pytest.raises(CacheFormatUnsupported, match="older longctx"):
        Store().load(entry)


def test_fifo_or_symlink_in_place_of_the_file(tiny_model, text_doc, tmp_path):
    entry = _ingest(text_doc, tiny_model)
    store = Store()
    path = store.cache_path(entry.id)
    path.unlink()
    os.mkfifo(path)
    start = time.perf_counter()
    with pytest.raises(CacheCorrupt, match="not a regular file"):
        store.load(entry)
    assert time.perf_counter() - start < 5
    path.unlink()
    (tmp_path / "elsewhere").write_bytes(b"x" * 100)
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CacheCorrupt):
        store.load(entry)


def test_ingest_rebuilds_a_corrupt_cache_without_force(tiny_model, text_doc):
    entry = _ingest(text_doc, tiny_model)
    path = Store().cache_path(entry.id)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CacheCorrupt, match="fails its checksum"):
        list(asking.ask("q", max_tokens=2))
    again = session.ingest(text_doc, model=str(tiny_model))
    assert not again.reused
    assert "".join(asking.ask("q", max_tokens=2)) is not None


# -- mismatches: model, tokenizer, preset -------------------------------------------------------
def test_file_of_another_model_is_refused_naming_both(tiny_model, tiny_model_other, text_doc):
    mine = _ingest(text_doc, tiny_model)
    other = _ingest(text_doc, tiny_model_other)
    store = Store()
    shutil.copy(store.cache_path(other.id), store.cache_path(mine.id))
    with pytest.raises(CacheMismatch) as err:
        _restore(mine, tiny_model)
    assert tiny_model.name in str(err.value) and tiny_model_other.name in str(err.value)
    assert other.weights_sha256[:12] in str(err.value) and mine.weights_sha256[:12] in str(err.value)


def test_other_tokenizer_is_refused_naming_both(tiny_model, text_doc, tmp_path):
    entry = _ingest(text_doc, tiny_model)
    twin = tmp_path / "tiny-llama-retok"
    shutil.copytree(tiny_model, twin)
    cfg = json.loads((twin / "tokenizer_config.json").read_text())
    (twin / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 77}))
    with pytest.raises(CacheMismatch, match="tokenizer") as err:
        list(asking.ask("q", model=str(twin)))
    ref = models.resolve(str(twin))
    message = str(err.value)
    assert entry.tokenizer_sha256[:12] in message and ref.tokenizer_sha256[:12] in message
    assert "tiny-llama-retok" in message and "tiny-llama" in message


def test_file_of_another_preset_is_refused_naming_both(tiny_model, text_doc):
    fp16 = _ingest(text_doc, tiny_model, "fp16")
    tq4 = _ingest(text_doc, tiny_model, "tq4")
    store = Store()
    shutil.copy(store.cache_path(tq4.id), store.cache_path(fp16.id))
    with pytest.raises(CacheMismatch, match="'tq4'.*'fp16'"):
        _restore(fp16, tiny_model)


def test_changed_preset_definition_is_refused(tiny_model, text_doc, monkeypatch):
    entry = _ingest(text_doc, tiny_model, "tq4")
    import dataclasses

    changed = dataclasses.replace(kvcache.PRESETS["tq4"], key_bits=3)
    monkeypatch.setitem(kvcache.PRESETS, "tq4", changed)
    with pytest.raises(CacheMismatch, match="key_bits 4 vs 3"):
        _restore(entry, tiny_model)


# -- disk space --------------------------------------------------------------------------------
def _store_is_empty() -> None:
    store = Store(cleanup=False)
    assert store.entries() == []
    assert os.listdir(store.caches) == []


def test_not_enough_free_space_is_refused_before_prefill(tiny_model, text_doc, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(fmt.shutil, "disk_usage", lambda p: Usage(10 << 30, 10 << 30, 1 << 20))
    prefilled = []
    monkeypatch.setattr(session.engine, "prefill", lambda *a, **k: prefilled.append(1))
    with pytest.raises(StoreError, match="Not enough disk space.*LONGCTX_HOME"):
        session.ingest(text_doc, model=str(tiny_model))
    assert prefilled == []
    _store_is_empty()


@pytest.mark.parametrize("point", ["write:arrays", "write:mid", "write:written"])
def test_disk_full_mid_write_leaves_nothing(tiny_model, text_doc, monkeypatch, point):
    monkeypatch.setenv("LONGCTX_FAILPOINT", f"{point}:enospc")
    with pytest.raises(StoreError, match="disk filled up") as err:
        session.ingest(text_doc, model=str(tiny_model))
    assert "\n" not in str(err.value)
    monkeypatch.delenv("LONGCTX_FAILPOINT")
    _store_is_empty()
    assert not session.ingest(text_doc, model=str(tiny_model)).reused


def test_index_full_removes_the_new_file(tiny_model, text_doc, monkeypatch):
    def failing_set(self, key, value):
        with self.guard():
            raise sqlite3.OperationalError("database or disk is full")

    # Only this patch is undone after the ingest: `monkeypatch.undo()` would also drop the
    # autouse fixture's LONGCTX_HOME and check the user's real store instead of the test's.
    with monkeypatch.context() as patch:
        patch.setattr(Store, "set_value", failing_set)
        with pytest.raises(StoreError, match="is full"):
            session.ingest(text_doc, model=str(tiny_model))
    _store_is_empty()


# -- permissions, names, removal ---------------------------------------------------------------
def test_directories_are_private(tiny_model, text_doc, longctx_home):
    entry = _ingest(text_doc, tiny_model)
    store = Store()
    for d in (longctx_home, store.root, store.caches, store.locks, store.root / "index"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE(store.cache_path(entry.id).stat().st_mode) == 0o600
    os.chmod(store.caches, 0o755)
    Store()
    assert stat.S_IMODE(store.caches.stat().st_mode) == 0o700


@pytest.mark.parametrize("ref", ["../../etc/passwd", "..", "/etc", "", " ", "facts.txt/../x"])
def test_names_never_become_paths(tiny_model, text_doc, ref, tmp_path):
    entry = _ingest(text_doc, tiny_model)
    with pytest.raises(EntryNotFound):
        manage.find_entry(ref)
    with pytest.raises(EntryNotFound):
        manage.remove_entry(ref)
    assert [e.id for e in manage.list_entries()] == [entry.id]
    with pytest.raises(StoreError):
        Store().cache_path("../" + entry.id)


def test_index_entry_naming_another_file_is_dropped(tiny_model, text_doc, tmp_path):
    entry = _ingest(text_doc, tiny_model)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    store = Store()
    store.index.set(f"entry:{entry.id}", {**entry.to_json(), "file": "../../../victim.txt"})
    assert Entry.from_json(store.index.get(f"entry:{entry.id}")) is None
    assert store.cleanup()["invalid"] == 1
    assert manage.list_entries() == [] and victim.read_text() == "keep me"


def test_remove_deletes_file_and_entry_and_orphans_are_cleaned(tiny_model, text_doc, monkeypatch):
    entry = _ingest(text_doc, tiny_model)
    store = Store()
    path = store.cache_path(entry.id)
    monkeypatch.setenv("LONGCTX_FAILPOINT", "remove:unindexed:enospc")  # dies between the steps
    with pytest.raises(OSError):
        store.remove(entry)
    monkeypatch.delenv("LONGCTX_FAILPOINT")
    assert path.exists() and store.get(entry.id) is None
    assert Store(cleanup=False).cleanup()["orphans"] == 1
    assert not path.exists()
    entry = _ingest(text_doc, tiny_model)
    manage.remove_entry(entry.name)
    assert not path.exists() and manage.list_entries() == []


def test_entry_whose_file_vanished_is_dropped(tiny_model, text_doc):
    entry = _ingest(text_doc, tiny_model)
    Store().cache_path(entry.id).unlink()
    assert Store(cleanup=False).cleanup()["dangling"] == 1
    assert manage.list_entries() == []
    assert not session.ingest(text_doc, model=str(tiny_model)).reused


# -- cleanup and locks -------------------------------------------------------------------------
def test_cleanup_spares_temp_files_of_live_writers(tiny_model, text_doc):
    entry = _ingest(text_doc, tiny_model)
    store = Store()
    eid = entry.id
    dead = store.caches / f".tmp-{eid}-999999-abc.safetensors"  # lock free: its writer is gone
    live = store.caches / f".tmp-{'f' * 16}-{os.getpid()}-abc.safetensors"
    legacy_old = store.caches / ".tmp-abc123.safetensors"  # first-format temp, abandoned
    legacy_new = store.caches / f".tmp-{os.getpid()}-fresh.safetensors"
    for p in (dead, live, legacy_old, legacy_new):
        p.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(legacy_old, (old, old))
    with store.lock("f" * 16):  # a writer of entry ffff... is at work
        done = Store(cleanup=False).cleanup()
    assert done["temps"] == 2
    assert not dead.exists() and not legacy_old.exists()
    assert live.exists() and legacy_new.exists()
    assert Store(cleanup=False).cleanup()["temps"] == 1 and not live.exists()


def test_lock_is_exclusive_across_open_files(tiny_model, text_doc):
    store = Store()
    with store.lock("a" * 16):
        with store.try_lock("a" * 16) as got:
            assert not got
        with store.try_lock("b" * 16) as got:
            assert got
    with store.try_lock("a" * 16) as got:
        assert got


# -- nothing is unpickled ----------------------------------------------------------------------
def test_index_uses_the_json_only_disk_and_string_keys(tiny_model, text_doc):
    _ingest(text_doc, tiny_model)
    store = Store()
    assert type(store.index.disk) is SafeJSONDisk
    keys = list(store.index.iterkeys())
    assert keys and all(type(k) is str for k in keys)
    with pytest.raises(TypeError):
        store.index.set(("tuple", "key"), 1)


def _plant_pickle_row(store: Store, marker: Path, raw_key: bool) -> None:
    """Insert a row that would run code if diskcache unpickled it (as stock JSONDisk would)."""
    import pickle  # builds the hostile payload only; the package itself never imports pickle
    import zlib

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Boom())
    key = zlib.compress(json.dumps("entry:" + "e" * 16).encode()) if raw_key else payload
    db = sqlite3.connect(store.root / "index" / "cache.db")
    db.execute(
        "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, "
        "tag, size, mode, filename, value) VALUES (?, ?, 0, NULL, 0, 0, NULL, 0, 4, NULL, ?)",
        (sqlite3.Binary(key), int(raw_key), sqlite3.Binary(payload)),
    )
    db.commit()
    db.close()


@pytest.mark.parametrize("raw_key", [True, False])
def test_planted_pickle_rows_never_execute(tiny_model, text_doc, tmp_path, raw_key):
    _ingest(text_doc, tiny_model)
    marker = tmp_path / "pwned"
    store = Store()
    _plant_pickle_row(store, marker, raw_key)
    store.close()
    try:
        entries = manage.list_entries()  # a pickled value: dropped unread
        assert len(entries) == 1 and raw_key
    except StoreError as err:  # a pickled key: the index is reported damaged
        assert not raw_key and "damaged" in str(err)
    assert not marker.exists()


def test_no_pickle_eval_or_exec_in_the_package():
    """No module of longctx imports pickle-like loaders or calls eval/exec/globals()[...]
    (so nothing on the load path can run code from a file)."""
    banned_modules = {"pickle", "cPickle", "dill", "shelve", "marshal", "joblib", "cloudpickle"}
    problems = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                if any(n.split(".")[0] in banned_modules for n in names):
                    problems.append(f"{path}:{node.lineno} imports {names}")
            elif isinstance(node, ast.Call):
                f = node.func  # the builtins, not methods such as mx.eval
                if isinstance(f, ast.Name) and f.id in ("eval", "exec", "compile", "__import__"):
                    problems.append(f"{path}:{node.lineno} calls {f.id}")
                if any(k.arg == "allow_pickle" for k in node.keywords):
                    problems.append(f"{path}:{node.lineno} passes allow_pickle")
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call):
                f = node.value.func
                if isinstance(f, ast.Name) and f.id in ("globals", "locals"):
                    problems.append(f"{path}:{node.lineno} indexes {f.id}()")
    assert problems == []


def test_reading_a_known_entry_leaves_the_index_closed(tiny_model, text_doc):
    """The index opens on first use: restoring an entry already at hand never opens it (diskcache's
    open writes its settings back), and `ask`'s store skips the cleanup scan."""
    entry = _ingest(text_doc, tiny_model, "tq4")
    store = Store(cleanup=False)
    try:
        arrays, meta, pending = store.load_verifying(entry)
        pending.wait()
        assert arrays and store._index is None
        assert store.find(entry.name).id == entry.id and store._index is not None
    finally:
        store.close()
    assert store._index is None


@pytest.mark.parametrize("field", ["windows", "kv_heads"])
def test_a_file_for_other_layer_shapes_is_a_mismatch(tiny_model, text_doc, field):
    """Sliding windows or KV heads other than the model's are refused as a mismatch (not a
    traceback from unstacking the arrays)."""
    entry = _ingest(text_doc, tiny_model, "tq4")

    def edit(header):
        cfg = json.loads(header["__metadata__"]["kv_config"])
        n = len(cfg["head_dims"])
        cfg[field] = [0] * (n - 1) + [64] if field == "windows" else [h + 1 for h in cfg["kv_heads"]]
        header["__metadata__"]["kv_config"] = json.dumps(cfg)

    _forge(Store().cache_path(entry.id), edit)
    with pytest.raises(CacheMismatch, match="sliding windows" if field == "windows" else "KV heads"):
        _restore(entry, tiny_model)


def test_checks_started_after_the_read_still_refuse_a_damaged_file(tiny_model, text_doc, monkeypatch):
    entry = _ingest(text_doc, tiny_model, "tq4")
    path = Store().cache_path(entry.id)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CacheCorrupt, match="fails its checksum"):
        Store().load(entry, checks="after")


def test_a_stacked_array_of_the_wrong_layer_count_is_refused(tiny_model, text_doc):
    entry = _ingest(text_doc, tiny_model, "tq4")
    path = Store().cache_path(entry.id)
    arrays, meta = mx.load(str(path), return_metadata=True)
    arrays["turbo.k.norm"] = arrays["turbo.k.norm"][:-1]
    keep = {k: v for k, v in meta.items() if k not in ("format_version", "checksums", "header_sha256")}
    fmt.write(path, arrays, keep)
    with pytest.raises(CacheCorrupt, match="turbo.k.norm"):
        Store().load(entry)
    with pytest.raises(ValueError, match="does not stack"):
        kvcache.split_layers({"turbo.k.mu": mx.zeros((4, 1, 1, 8))}, [0, 1, 2])


def test_guard_shows_nothing_before_the_checks_pass_and_checks_at_the_end():
    from longctx.store.format import PendingChecksums

    class Failing:
        waits = 0

        def wait(self):
            self.waits += 1
            raise CacheCorrupt("array 'x' fails its checksum")

    produced = []

    def pieces():
        for p in ("a", "b"):
            produced.append(p)
            yield p

    fail = Failing()
    shown = []
    with pytest.raises(CacheCorrupt):
        for piece in PendingChecksums.guard(fail, pieces()):
            shown.append(piece)
    assert shown == [] and produced == ["a"]  # computed, never shown
    empty = Failing()
    with pytest.raises(CacheCorrupt):
        list(PendingChecksums.guard(empty, iter(())))  # no piece at all: still checked
    assert empty.waits == 1
