"""Fuzz the cache-file reader with damaged copies of a real cache, and time its checksums.

A tiny random-weight model ingests a short document; every case then writes a mutated copy of the
cache file in place and restores it through `session.restore` (header checks, checksums, layout,
model checks, rebuilding the per-layer caches). Outcomes:

- rejected: `CacheCorrupt` or `CacheMismatch`, the only acceptable errors;
- crash: any other exception (a bug);
- accepted: the restore succeeded. For raw mutations (truncation, byte flips, inserted or deleted
  bytes, edited header text or length, all without fixing anything up) the file must then be
  byte-identical to the original; for forged headers (fields edited, swapped or dropped and the
  header checksum recomputed, as a buggy or hostile writer would) the restored arrays and the
  metadata the restore relies on must equal the original's. Anything else is accepted-corrupt.

The seeded random campaign here must end with 0 crashes and 0 accepted-corrupt files. By default
it is short (`CASES`, a few seconds on a 2-core CPU); `LONGCTX_FUZZ_CASES=20000
LONGCTX_FUZZ_SEED=11` runs the longer campaign once recorded (20,000 cases in 37 s, all clean) and
`LONGCTX_FUZZ_MB=100` the checksum timing on a ~100 MB cache (then: sha256 0.71 GB/s, a verified
load 0.150 s vs an unverified `mx.load` 0.014 s). `tests/test_reliability_fuzz.py` runs the same
mutations (imported from here) under hypothesis.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from longctx.errors import CacheCorrupt, CacheMismatch

CASES = int(os.environ.get("LONGCTX_FUZZ_CASES", "5000"))  # ~2 ms each on a 2-core CPU: ~10 s
SEED = int(os.environ.get("LONGCTX_FUZZ_SEED", "0"))
CHECKSUM_MB = int(os.environ.get("LONGCTX_FUZZ_MB", "8"))

DTYPE_NAMES = ["BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16", "F32", "F64", "C64", "XX", ""]
RAW_KINDS = ("truncate", "flip", "insert", "delete", "header_len", "json_text", "append", "zero_run", "deep_json", "forge_nofix")
FORGE_OPS = (
    "shape",
    "dtype",
    "offsets",
    "swap_offsets",
    "swap_names",
    "swap_checksums",
    "drop_tensor",
    "meta_value",
    "drop_meta",
    "add_meta",
    "reorder",
    "kv_config",
    "version",
    "nesting",
)


# -- the file's structure, parsed independently of longctx.store.format --------------------------
def split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(header: dict, body: bytes, fix_checksum: bool = True) -> bytes:
    """Serialize like the writer; with fix_checksum, recompute `header_sha256` over the new header."""

    def dump(h: dict) -> bytes:
        raw = json.dumps(h, separators=(",", ":"), ensure_ascii=True).encode()
        return raw + b" " * (-len(raw) % 8)

    meta = header.get("__metadata__")
    if fix_checksum and isinstance(meta, dict) and "header_sha256" in meta:
        meta["header_sha256"] = "0" * 64
        meta["header_sha256"] = hashlib.sha256(dump(header)).hexdigest()
    head = dump(header)
    return struct.pack("<Q", len(head)) + head + body


# -- mutations -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutation:
    kind: str  # one of RAW_KINDS, or "forge"
    op: str = ""  # forge op
    a: int = 0  # integer parameters, interpreted per kind (always reduced modulo sizes)
    b: int = 0
    c: int = 0

    @property
    def raw(self) -> bool:
        return self.kind != "forge"


def _tensor_names(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


def _forge(header: dict, m: Mutation) -> None:
    """Edit a parsed header in place (`op`, parameters a/b/c)."""
    names = _tensor_names(header)
    meta = header["__metadata__"]
    t1, t2 = names[m.a % len(names)], names[m.b % len(names)]
    deltas = [-1, 1, 2, -2, 1 << 20, -(1 << 20), 1 << 40, 7]
    if m.op == "shape":
        shape = header[t1]["shape"]
        if shape:
            i = m.b % len(shape)
            shape[i] = [0, shape[i] + 1, max(shape[i] - 1, 0), shape[i] * 2, 1 << 40, -1][m.c % 6]
        else:
            shape.append(1 + m.c % 3)
    elif m.op == "dtype":
        header[t1]["dtype"] = DTYPE_NAMES[m.b % len(DTYPE_NAMES)]
    elif m.op == "offsets":
        off = header[t1]["data_offsets"]
        off[m.b % 2] += deltas[m.c % len(deltas)]
    elif m.op == "swap_offsets":
        header[t1]["data_offsets"], header[t2]["data_offsets"] = header[t2]["data_offsets"], header[t1]["data_offsets"]
    elif m.op == "swap_names":
        header[t1], header[t2] = header[t2], header[t1]
    elif m.op == "swap_checksums":
        sums = json.loads(meta["checksums"])
        sums[t1], sums[t2] = sums[t2], sums[t1]
        meta["checksums"] = json.dumps(sums, separators=(",", ":"), sort_keys=True)
    elif m.op == "drop_tensor":
        del header[t1]
    elif m.op == "meta_value":
        keys = sorted(meta)
        key = keys[m.b % len(keys)]
        meta[key] = ["", "0", "-1", "99999999", meta[key][:-1], meta[key] + "0", "{}", "[]", "1" * 5000, "x"][m.c % 10]
    elif m.op == "drop_meta":
        keys = sorted(meta)
        del meta[keys[m.b % len(keys)]]
    elif m.op == "add_meta":
        meta[f"extra{m.b % 3}"] = "value"
    elif m.op == "reorder":
        items = list(header.items())
        random.Random(m.b).shuffle(items)
        header.clear()
        header.update(items)
    elif m.op == "kv_config":
        cfg = json.loads(meta["kv_config"])
        field = ["head_dims", "kv_heads", "name", "kind", "key_bits", "value_bits", "window", "seed"][m.b % 8]
        value = cfg.get(field)
        if isinstance(value, list):
            value = [[], value[:-1], value + value[-1:], [v + 1 for v in value], [0] * len(value), ["x"] * len(value)][m.c % 6]
        elif isinstance(value, int) and not isinstance(value, bool):
            value = [value + 1, 0, -1, 1 << 62, 9][m.c % 5]
        else:
            value = ["fp16", "tq4", "affine", "turbo", "", None][m.c % 6]
        cfg[field] = value
        meta["kv_config"] = json.dumps(cfg)
    elif m.op == "version":
        meta["format_version"] = ["1", "3", "10", "", "2.0", "02", "v2"][m.b % 7]
    elif m.op == "nesting":
        header[t1]["shape"] = json.loads("[" * 500 + "]" * 500) if m.b % 2 else [[1, 2]]


def mutate(original: bytes, m: Mutation) -> bytes:
    """The damaged copy of `original` that `m` describes."""
    data = bytearray(original)
    size = len(data)
    (n,) = struct.unpack("<Q", original[:8])
    if m.kind == "truncate":
        return bytes(data[: m.a % size])
    if m.kind == "flip":
        rng = random.Random(m.a)
        for _ in range(1 + m.b % 8):
            # Half the flips land in the header, where the structure lives.
            pos = rng.randrange(8 + n) if rng.random() < 0.5 else rng.randrange(size)
            data[pos] ^= rng.randrange(1, 256)
        return bytes(data)
    if m.kind == "insert":
        pos = m.a % (size + 1)
        return bytes(data[:pos] + bytes([m.c % 256]) * (1 + m.b % 16) + data[pos:])
    if m.kind == "delete":
        pos = m.a % size
        return bytes(data[:pos] + data[pos + 1 + m.b % 16 :])
    if m.kind == "header_len":
        new = [n + 1, n - 1, n + 8, n - 8, 0, 1, 1 << 63, size, size - 8, n ^ (1 << (m.b % 64))][m.a % 10]
        return struct.pack("<Q", new % (1 << 64)) + bytes(data[8:])
    if m.kind == "json_text":
        pos = 8 + m.a % n
        data[pos] = b'{}[]",:0123456789 \\-eE.tfn'[m.b % 26]
        return bytes(data)
    if m.kind == "append":
        return bytes(data) + bytes([m.b % 256]) * (1 + m.a % 64)
    if m.kind == "deep_json":  # nesting deep enough to exhaust a recursive parser
        depth = 1000 + m.a % 100_000
        head = b'{"__metadata__":' + b"[" * depth + b"]" * depth + b"}"
        head += b" " * (-len(head) % 8)
        return struct.pack("<Q", len(head)) + head + original[8 + n :]
    if m.kind == "zero_run":
        pos = m.a % size
        length = 1 + m.b % 4096
        data[pos : pos + length] = bytes(len(data[pos : pos + length]))
        return bytes(data)
    header, body = split(original)
    _forge(header, m)
    return join(header, body, fix_checksum=(m.kind == "forge"))


def random_mutation(rng: random.Random) -> Mutation:
    a, b, c = (rng.randrange(1 << 30) for _ in range(3))
    if rng.random() < 0.45:
        return Mutation("forge", rng.choice(FORGE_OPS), a, b, c)
    kind = rng.choice(RAW_KINDS)
    return Mutation(kind, rng.choice(FORGE_OPS) if kind == "forge_nofix" else "", a, b, c)


# -- the target ----------------------------------------------------------------------------------
@dataclass
class Target:
    """A real saved cache and what a correct restore of it yields."""

    store: object
    entry: object
    lm: object
    original: bytes
    arrays: dict  # name -> numpy array, as restored from the original
    meta: dict

    @property
    def path(self) -> Path:
        return self.store.cache_path(self.entry.id)


def make_target(workdir: Path, preset: str = "fp16") -> Target:
    """Ingest a short document with a tiny model under `workdir` (sets LONGCTX_HOME)."""
    from conftest import make_tiny_model

    from longctx import session
    from longctx.runtime import models
    from longctx.store import Store

    os.environ["LONGCTX_HOME"] = str(workdir / "home")
    model = make_tiny_model(workdir / "tiny")
    doc = workdir / "fuzz.txt"
    doc.write_text("The lighthouse keeper is Ada Quill. The island has 412 sheep.\n" * 2)
    entry = session.ingest(doc, model=str(model), preset=preset).entry
    store = Store()
    lm = models.load(models.resolve(str(model)))
    target = Target(store, entry, lm, b"", {}, {})
    target.original = target.path.read_bytes()
    target.arrays, target.meta = _snapshot(store.load(entry))
    return target


def _snapshot(loaded: tuple[dict, dict]) -> tuple[dict, dict]:
    import numpy as np

    import mlx.core as mx

    def raw(v) -> bytes:
        return np.asarray(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v).tobytes()

    arrays, meta = loaded
    return {k: (str(v.dtype), tuple(v.shape), raw(v)) for k, v in arrays.items()}, meta


RELIED_ON = ("format_version", "model_id", "weights_sha256", "tokenizer_sha256", "document_sha256", "tokens", "kv_config")


def run_case(target: Target, m: Mutation) -> str:
    """Write the mutated file, restore it; return "rejected", "accepted", "accepted_corrupt" or
    "crash: <error>"."""
    from longctx import session

    data = mutate(target.original, m)
    target.path.write_bytes(data)
    try:
        session.restore(target.entry, target.lm, target.store)
    except (CacheCorrupt, CacheMismatch):
        return "rejected"
    except Exception as err:  # anything else is the bug this harness looks for
        return f"crash: {type(err).__name__}: {str(err)[:200]}"
    if m.raw:
        return "accepted" if data == target.original else "accepted_corrupt"
    arrays, meta = _snapshot(target.store.load(target.entry))
    same = arrays == target.arrays and all(meta.get(k) == target.meta.get(k) for k in RELIED_ON)
    return "accepted" if same else "accepted_corrupt"


def fuzz(target: Target, cases: int, seed: int) -> dict:
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    crashes, accepted_corrupt = [], []
    slowest = 0.0
    start = time.perf_counter()
    for _ in range(cases):
        m = random_mutation(rng)
        t = time.perf_counter()
        outcome = run_case(target, m)
        slowest = max(slowest, time.perf_counter() - t)
        key = m.kind if m.kind != "forge" else f"forge:{m.op}"
        row = counts.setdefault(key, {"tried": 0, "rejected": 0, "accepted": 0})
        row["tried"] += 1
        if outcome.startswith("crash"):
            crashes.append({"mutation": m.__dict__, "error": outcome})
        elif outcome == "accepted_corrupt":
            accepted_corrupt.append(m.__dict__)
        else:
            row[outcome] += 1
    target.path.write_bytes(target.original)
    return {
        "cases": cases,
        "seed": seed,
        "seconds": time.perf_counter() - start,
        "slowest_case_seconds": slowest,
        "crashes": len(crashes),
        "accepted_corrupt": len(accepted_corrupt),
        "by_kind": counts,
        "crash_examples": crashes[:20],
        "accepted_corrupt_examples": accepted_corrupt[:20],
        "file_bytes": len(target.original),
    }


def checksum_cost(workdir: Path, megabytes: int, repeats: int = 5) -> dict:
    """Restore-time cost of verification on a synthetic fp16 cache of about `megabytes` MB."""
    import mlx.core as mx

    from longctx.store import Entry, Store
    from longctx.store import format as fmt

    layers, heads, dim = 16, 4, 64
    tokens = megabytes * 10**6 // (layers * 2 * heads * dim * 2)
    arrays = {"tokens": mx.zeros((tokens,), dtype=mx.int32)}
    for i in range(layers):
        for tag in ("k", "v"):
            arrays[f"{i}.{tag}"] = mx.random.normal((1, heads, tokens, dim)).astype(mx.float16)
    kv = {"name": "fp16", "kind": "fp16", "head_dims": [dim] * layers, "kv_heads": [heads] * layers}
    meta = {
        "model_id": "synthetic",
        "weights_sha256": "0" * 64,
        "tokenizer_sha256": "0" * 64,
        "document_sha256": "1" * 64,
        "tokens": str(tokens),
        "kv_config": json.dumps(kv),
    }
    store = Store(workdir / "bench-store")
    entry = Entry(
        id="0123456789abcdef",
        name="bench",
        path="bench.txt",
        document_sha256="1" * 64,
        kind="text",
        pages=1,
        tokens=tokens,
        model_id="synthetic",
        model_spec="-",
        weights_sha256="0" * 64,
        tokenizer_sha256="0" * 64,
        kv_preset="fp16",
        file="0123456789abcdef.safetensors",
        bytes=0,
        created=0.0,
    )
    path = store.cache_path(entry.id)
    size = fmt.write(path, arrays, meta, tag=entry.id)
    del arrays
    rows = {"unverified_mx_load": [], "sha256_only": [], "verified_load": [], "verify_only": []}
    for _ in range(repeats):
        t = time.perf_counter()
        loaded = mx.load(str(path))
        mx.eval(list(loaded.values()))
        rows["unverified_mx_load"].append(time.perf_counter() - t)
        del loaded
        t = time.perf_counter()
        with open(path, "rb") as f:
            digest = hashlib.sha256()
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        rows["sha256_only"].append(time.perf_counter() - t)
        t = time.perf_counter()
        loaded, _ = store.load(entry)
        mx.eval(list(loaded.values()))
        rows["verified_load"].append(time.perf_counter() - t)
        del loaded
        t = time.perf_counter()
        store.verify(entry)
        rows["verify_only"].append(time.perf_counter() - t)
    store.close()
    path.unlink()
    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    return {
        "file_bytes": size,
        "repeats": repeats,
        "median_seconds": med,
        "verified_over_unverified": med["verified_load"] / med["unverified_mx_load"],
        "checksum_gb_per_s": size / med["sha256_only"] / 1e9,
    }


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    work = tmp_path_factory.mktemp("fuzz-campaign")
    mp.setenv("LONGCTX_HOME", str(work / "home"))
    t = make_target(work)
    yield t
    t.store.close()
    mp.undo()


@pytest.fixture(autouse=True)
def _same_home(target, monkeypatch):
    # The autouse per-test LONGCTX_HOME would point elsewhere; the target's store is what counts.
    monkeypatch.setenv("LONGCTX_HOME", str(target.store.root.parent))


def test_seeded_campaign_has_no_crash_and_accepts_no_corrupt_file(target):
    result = fuzz(target, CASES, SEED)
    by_kind = result["by_kind"]
    print(
        f"{result['cases']} cases in {result['seconds']:.1f} s (seed {SEED}, slowest case "
        f"{result['slowest_case_seconds'] * 1e3:.1f} ms): "
        + ", ".join(f"{k} {r['rejected']}/{r['tried']} rejected" for k, r in sorted(by_kind.items()))
    )
    assert result["crashes"] == 0, result["crash_examples"]
    assert result["accepted_corrupt"] == 0, result["accepted_corrupt_examples"]
    assert sum(r["tried"] for r in by_kind.values()) == CASES
    if CASES >= 1000:  # every raw mutation and forged field was tried
        assert set(by_kind) == set(RAW_KINDS) | {f"forge:{op}" for op in FORGE_OPS}
    assert result["slowest_case_seconds"] < 5.0  # no pathological parse (deep nesting, huge sizes)
    assert target.path.read_bytes() == target.original  # left as it was


def test_checksums_verify_a_cache_at_a_cost_the_load_can_carry(tmp_path):
    cost = checksum_cost(tmp_path, CHECKSUM_MB, repeats=3)
    med = cost["median_seconds"]
    print(
        f"checksums on {cost['file_bytes'] / 1e6:.0f} MB: sha256 alone {med['sha256_only']:.3f} s "
        f"({cost['checksum_gb_per_s']:.2f} GB/s), verified load {med['verified_load']:.3f} s vs "
        f"unverified mx.load {med['unverified_mx_load']:.3f} s, verify only {med['verify_only']:.3f} s"
    )
    assert cost["file_bytes"] >= 0.9 * CHECKSUM_MB * 1e6
    assert all(s > 0 for s in med.values()) and cost["checksum_gb_per_s"] > 0
