"""The on-disk cache file: a safetensors container in which every byte is checksummed.

Layout (standard safetensors, readable by any safetensors reader): an 8-byte little-endian header
length N, N bytes of JSON header (padded with spaces to a multiple of 8), then the arrays' bytes,
contiguous and in header order. The header's string metadata holds `format_version`, `model_id`,
`weights_sha256`, `tokenizer_sha256`, `document_sha256`, `tokens`, `kv_config` (JSON), plus:

- `checksums`: JSON {array name: sha256 hex of its bytes};
- `header_sha256`: sha256 of the header JSON as written, with this field's value set to 64 zeros.

A reader (`open_cache`) checks the header before allocating anything: bounded size, JSON whose
canonical serialization is byte-for-byte the header (so a changed byte cannot hide in padding,
whitespace or a duplicate key), its checksum, the version, known dtypes, shapes that match byte
sizes, offsets that tile the data region exactly up to the end of the file. The arrays are then
read into MLX by MLX's own safetensors reader (through /dev/fd: this very file), their names,
shapes and dtypes checked against the validated header, while worker threads read every array's
bytes again and check its sha256. Every byte of the file is covered, so a truncated, bit-flipped
or edited file is refused with `CacheCorrupt` (by `Reader.arrays()` before it returns, or by
`PendingChecksums.wait()` of `arrays_verifying()`, which hands the arrays out while their
checksums are still being checked: `ask` starts its question meanwhile); nothing is
ever unpickled or memory-mapped (a file truncated under a mapping would crash the reader with
SIGBUS). sha256 rather than a CRC: OpenSSL's SHA-NI / ARMv8 code runs at ~1.5 GB/s, hashlib
releases the GIL, and it rules out accidental collisions outright.

Writers stream the arrays (hashing each on the way) into a temp file
`.tmp-<tag>-<pid>-<random>.safetensors` in the same directory (the tag is the entry id, so a
cleaner can tell whose it is), write the header last, fsync, rename, fsync the directory: readers
see the old file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import shutil
import stat
import struct
import tempfile
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from longctx.errors import CacheCorrupt, CacheFormatUnsupported, StoreError
from longctx.store.failpoints import failpoint
from longctx.units import human_bytes

FORMAT_VERSION = "3"  # 3: compressed layers' small arrays stacked (`longctx.kvcache`)
READABLE_VERSIONS = ("2", "3")  # 2: every array per layer
REQUIRED_META = (
    "format_version",
    "model_id",
    "weights_sha256",
    "tokenizer_sha256",
    "document_sha256",
    "tokens",
    "kv_config",
    "checksums",
    "header_sha256",
)
MAX_HEADER_BYTES = 16 << 20  # ~100 bytes per array: room for 100k+ arrays
MAX_NDIM = 8
CHUNK = 4 << 20  # bytes a checksum task reads at a time
FD_DIR = "/dev/fd"  # MLX's reader opens the already-opened file through it
FREE_SPACE_MARGIN = 64 << 20  # left free after a write, for the index and everything else
TEMP_PREFIX = ".tmp-"
_ZERO_SHA = "0" * 64
# When `arrays_verifying` starts the checksum threads (its `checks`): "overlap" (before MLX reads
# the arrays, the checks running alongside; any value but "after" means this) or "after" (once the
# arrays are in: the checks then run while the caller computes, not against the reader; measured
# no steadier on a GPU: benchmarks/restore.py --checks, its results in git history).
CHECKS = "overlap"

# safetensors dtype -> (bytes per element, numpy dtype used to carry the bytes into MLX)
DTYPES = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "U16": (2, "uint16"),
    "I16": (2, "int16"),
    "U32": (4, "uint32"),
    "I32": (4, "int32"),
    "U64": (8, "uint64"),
    "I64": (8, "int64"),
    "F16": (2, "float16"),
    "BF16": (2, "uint16"),
    "F32": (4, "float32"),
}
_MX_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
}


@dataclass(frozen=True)
class Tensor:
    """One array's header entry."""

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    begin: int  # offsets within the data region
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A validated header: metadata (strings), tensors in file order, and where data starts."""

    meta: dict[str, str]
    tensors: dict[str, Tensor]
    data_start: int
    file_size: int
    checksums: dict[str, str]


def _canonical(header: dict) -> bytes:
    """The header JSON exactly as `write` lays it out, padded to a multiple of 8 bytes."""
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return raw + b" " * (-len(raw) % 8)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def _raw_bytes(arr) -> memoryview:
    """An MLX array's bytes in C order (bfloat16 carried as uint16)."""
    import mlx.core as mx
    import numpy as np

    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    return memoryview(np.ascontiguousarray(np.asarray(arr))).cast("B")


def check_free_space(directory: Path, nbytes: int, what: str) -> None:
    """Raise StoreError unless `directory`'s disk has `nbytes` plus a margin free."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return  # cannot tell; the write itself will report ENOSPC
    if free < nbytes + FREE_SPACE_MARGIN:
        raise StoreError(
            f"Not enough disk space for {what}: it needs {human_bytes(nbytes)} (plus a "
            f"{human_bytes(FREE_SPACE_MARGIN)} margin) but {directory} has {human_bytes(free)} free; free "
            "some space or set LONGCTX_HOME to a directory on a larger disk."
        )


def _layout(specs: dict[str, tuple[str, tuple]], metadata: dict) -> tuple[dict, int, dict]:
    """(header tensor entries, data bytes, metadata) for arrays `name -> (dtype, shape)`."""
    tensors, offset = {}, 0
    for name, (dtype, shape) in specs.items():
        nbytes = DTYPES[dtype][0] * math.prod(shape)
        tensors[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    meta = {
        **{k: str(v) for k, v in metadata.items()},
        "format_version": FORMAT_VERSION,
        "checksums": "",
        "header_sha256": _ZERO_SHA,
    }
    return tensors, offset, meta


def _header_bytes(tensors: dict, meta: dict, checksums: dict[str, str]) -> bytes:
    meta["checksums"] = json.dumps(checksums, separators=(",", ":"), sort_keys=True)
    meta["header_sha256"] = _ZERO_SHA
    header = {"__metadata__": meta, **tensors}
    meta["header_sha256"] = hashlib.sha256(_canonical(header)).hexdigest()
    return _canonical(header)


def predicted_size(specs: dict[str, tuple[str, tuple]], metadata: dict[str, str]) -> int:
    """The exact size `write` gives a file of arrays `name -> (dtype, shape)` and `metadata`."""
    tensors, offset, meta = _layout(specs, metadata)
    return 8 + len(_header_bytes(tensors, meta, {n: _ZERO_SHA for n in tensors})) + offset


def write(path: Path, arrays: dict, metadata: dict[str, str], tag: str = "") -> int:
    """Write `arrays` + `metadata` to `path` atomically, every byte checksummed.

    Args:
        path: the destination `.safetensors` file.
        arrays: name -> MLX array.
        metadata: string metadata (values are converted with `str`).
        tag: goes into the temp file's name (the entry id, for the store's cleaner).

    Returns:
        bytes written.

    Raises:
        StoreError: not enough free space, or the write failed (nothing is left behind).
    """
    import mlx.core as mx

    mx.eval(list(arrays.values()))
    specs = {}
    for name, arr in arrays.items():
        dtype = _MX_NAMES.get(str(arr.dtype).rsplit(".", 1)[-1])
        if dtype is None:
            raise StoreError(f"Cannot store array {name} of dtype {arr.dtype}.")
        specs[name] = (dtype, tuple(arr.shape))
    tensors, offset, meta = _layout(specs, metadata)

    def header_bytes(checksums: dict[str, str]) -> bytes:
        return _header_bytes(tensors, meta, checksums)

    # Digests have a fixed length, so the header's size is known before the arrays are hashed:
    # arrays stream to disk one at a time (memory: one array), the header goes in last.
    head_len = len(header_bytes({name: _ZERO_SHA for name in tensors}))
    size = 8 + head_len + offset
    check_free_space(path.parent, size, f"the cache file {path.name}")

    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(
            prefix=f"{TEMP_PREFIX}{tag + '-' if tag else ''}{os.getpid()}-", suffix=".safetensors", dir=path.parent
        )
        with os.fdopen(fd, "wb") as f:
            failpoint("write:opened")
            f.write(bytes(8 + head_len))  # placeholder: a crash here leaves an unreadable file
            checksums = {}
            for i, (name, arr) in enumerate(arrays.items()):
                blob = _raw_bytes(arr)
                checksums[name] = hashlib.sha256(blob).hexdigest()
                f.write(blob)
                del blob
                if i == len(arrays) // 2:
                    f.flush()
                    failpoint("write:mid")
            f.flush()
            failpoint("write:arrays")
            head = header_bytes(checksums)
            if len(head) != head_len:
                raise StoreError(f"Internal error: the header of {path.name} changed size.")
            f.seek(0)
            f.write(struct.pack("<Q", head_len) + head)
            f.flush()
            failpoint("write:written")
            os.fsync(f.fileno())
        failpoint("write:synced")
        os.replace(tmp, path)
        tmp = None
        failpoint("write:renamed")
        _fsync_dir(path.parent)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreError(
                f"The disk filled up while writing the cache file {path.name} "
                f"({human_bytes(size)}) in {path.parent}; nothing was kept. Free some "
                "space or set LONGCTX_HOME to a directory on a larger disk."
            ) from err
        raise StoreError(f"Cannot write the cache file {path}: {err.strerror or err}; nothing was kept.") from err
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return size


# -- reading ------------------------------------------------------------------------------------
class Reader:
    """An open, header-validated cache file. Use through `open_cache` (a context manager)."""

    def __init__(self, path: Path, label: str, hint: str):
        self.path, self.label, self.hint = path, label, hint
        try:
            # O_NONBLOCK: a FIFO planted in place of the file must not hang the open.
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
        except FileNotFoundError:
            raise CacheCorrupt(f"The cache file of '{label}' is missing ({path}); {hint}.") from None
        except OSError as err:
            raise self.corrupt(f"cannot be opened ({err.strerror or err})") from err
        self.file = io.FileIO(fd, "rb", closefd=True)
        try:
            self.header = self._read_header()
        except BaseException:
            self.file.close()
            raise

    def corrupt(self, problem: str) -> CacheCorrupt:
        return CacheCorrupt(f"The cache of '{self.label}' is corrupt ({problem}); {self.hint}.")

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read_into(self, view: memoryview, offset: int, what: str) -> None:
        """Fill `view` from `offset` (see `_read_fully`)."""
        _read_fully(self.file.fileno(), view, offset, lambda: self.corrupt(f"truncated inside {what}"))

    def _read_exact(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self._read_into(memoryview(buf), offset, "the header")
        return bytes(buf)

    def _read_header(self) -> Header:
        st = os.fstat(self.file.fileno())
        self.opened = (st.st_size, st.st_mtime_ns)  # PendingChecksums refuses a file changed since
        if not stat.S_ISREG(st.st_mode):
            raise self.corrupt("not a regular file")
        size = st.st_size
        if size < 8:
            raise self.corrupt(f"truncated to {size} bytes")
        (n,) = struct.unpack("<Q", self._read_exact(0, 8))
        if n < 2 or n > MAX_HEADER_BYTES:
            raise self.corrupt(f"header length {n} is impossible")
        if n > size - 8:
            raise self.corrupt(f"truncated: {size} bytes, shorter than its own header")
        raw = self._read_exact(8, n)
        try:
            header = json.loads(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise self.corrupt("the header is not valid JSON") from None
        if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
            raise self.corrupt("the header has no metadata")
        meta = header["__metadata__"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise self.corrupt("the metadata holds non-string values")
        self._check_version(meta.get("format_version"))
        if _canonical(header) != raw:
            raise self.corrupt("the header's bytes were altered")
        missing = [k for k in REQUIRED_META if k not in meta]
        if missing:
            raise self.corrupt(f"the header lacks {', '.join(missing)}")
        stored = meta["header_sha256"]
        zeroed = {**header, "__metadata__": {**meta, "header_sha256": _ZERO_SHA}}
        if hashlib.sha256(_canonical(zeroed)).hexdigest() != stored:
            raise self.corrupt("the header fails its checksum")
        tensors = self._tensors(header, size - 8 - n)
        checksums = self._checksums(meta["checksums"], tensors)
        return Header(meta, tensors, 8 + n, size, checksums)

    def _check_version(self, version) -> None:
        if version in READABLE_VERSIONS:
            return
        if isinstance(version, str) and version.isdigit() and len(version) < 6:
            newer = int(version) > int(FORMAT_VERSION)
            raise CacheFormatUnsupported(
                f"The cache of '{self.label}' was written by {'a newer' if newer else 'an older'} "
                f"longctx (cache format {version}; this one reads formats "
                f"{' and '.join(READABLE_VERSIONS)}); "
                f"{'upgrade longctx, or ' if newer else ''}{self.hint}."
            )
        raise self.corrupt("the header has no valid format version")

    def _tensors(self, header: dict, data_size: int) -> dict[str, Tensor]:
        found = []
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
                raise self.corrupt(f"array {name!r} has a malformed entry")
            dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
            if dtype not in DTYPES:
                raise self.corrupt(f"array {name!r} has unknown dtype {dtype!r}")
            if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
                raise self.corrupt(f"array {name!r} has an invalid shape")
            if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
                raise self.corrupt(f"array {name!r} has invalid offsets")
            begin, end = offsets
            if not 0 <= begin <= end:
                raise self.corrupt(f"array {name!r} has invalid offsets")
            if end > data_size:
                raise self.corrupt(f"truncated, or array {name!r} lies outside the file")
            if math.prod(shape) * DTYPES[dtype][0] != end - begin:
                raise self.corrupt(f"array {name!r}: shape {shape} does not match its byte size")
            found.append(Tensor(name, dtype, tuple(shape), begin, end))
        # The arrays must tile the data region: no gaps, no overlaps, nothing after the last.
        pos = 0
        for t in sorted(found, key=lambda t: (t.begin, t.end)):
            if t.begin != pos:
                raise self.corrupt(f"array {t.name!r} {'overlaps another' if t.begin < pos else 'leaves a gap'}")
            pos = t.end
        if pos != data_size:
            raise self.corrupt(f"{data_size - pos} unexplained bytes after the arrays")
        return {t.name: t for t in found}

    def _checksums(self, text: str, tensors: dict[str, Tensor]) -> dict[str, str]:
        try:
            sums = json.loads(text)
        except (ValueError, RecursionError):
            raise self.corrupt("the checksum table is not valid JSON") from None
        if (
            not isinstance(sums, dict)
            or set(sums) != set(tensors)
            or not all(isinstance(v, str) and len(v) == 64 for v in sums.values())
        ):
            raise self.corrupt("the checksum table does not list exactly the file's arrays")
        return sums

    def checksums_running(self) -> "PendingChecksums":
        """Start checking every array's checksum on worker threads (see `PendingChecksums`)."""
        return PendingChecksums(self)

    def verify(self) -> None:
        """Check every array's checksum without keeping anything (reuse check on ingest)."""
        self.checksums_running().wait()

    def arrays(self) -> dict:
        """Every array, read once, checksum-verified, as MLX arrays (in file order)."""
        arrays, pending = self.arrays_verifying()
        pending.wait()
        return arrays

    def arrays_verifying(self, checks: str = CHECKS) -> tuple[dict, "PendingChecksums"]:
        """Every array as (evaluated) MLX arrays, in file order, while their checksums are
        still being checked on other threads: `wait()` on the second value before anything
        computed from the arrays is shown (checking then overlaps their first use).

        MLX's own safetensors reader fills the arrays (one copy, file to array memory; on CUDA
        that memory is managed, and a copy through numpy costs twice the page faults), reading
        this very file through /dev/fd, after the header was validated here; its names, shapes
        and dtypes must match. The checksums cover the bytes as this reader reads them, from
        the same file. `checks`: when the checksum threads start (`CHECKS`)."""
        after = checks == "after"
        pending = None if after else self.checksums_running()
        try:
            out = self._load_mlx()
        except BaseException:
            # a damaged file explains MLX's failure: report that instead
            (pending or self.checksums_running()).wait()
            raise
        return out, pending or self.checksums_running()

    def _load_mlx(self) -> dict:
        import mlx.core as mx
        import numpy as np

        tensors = self.header.tensors
        fd_path = f"{FD_DIR}/{self.file.fileno()}"
        if not os.path.exists(fd_path):
            # no /dev/fd: read each array into numpy, then copy it into MLX, one at a time (reading
            # on 8 threads first was slower on the CPU and, holding every buffer at once, took
            # twice the memory; on a GPU that route was slower to a first token than MLX's
            # reader: docs/performance.md; the probe, restore.py --readers, in git history)
            out = {}
            for t in tensors.values():
                arr = mx.array(self._read(t).view(np.dtype(DTYPES[t.dtype][1])).reshape(t.shape))
                out[t.name] = arr.view(mx.bfloat16) if t.dtype == "BF16" else arr
            return out
        # Where /dev/fd/N duplicates the descriptor (macOS), MLX reads from its current offset.
        os.lseek(self.file.fileno(), 0, os.SEEK_SET)
        # MLX's errors stay as they are (out of memory is not a damaged file); a damaged or
        # truncated file is reported by the checksums, which the caller then waits for.
        loaded = mx.load(fd_path, format="safetensors")
        if set(loaded) != set(tensors):
            raise self.corrupt("MLX reads other arrays than its header lists")
        out = {}
        for t in tensors.values():
            arr = loaded[t.name]
            if tuple(arr.shape) != t.shape or _MX_NAMES.get(str(arr.dtype).rsplit(".", 1)[-1]) != t.dtype:
                raise self.corrupt(f"array {t.name!r} reads back as {arr.dtype} {arr.shape}")
            out[t.name] = arr
        mx.eval(list(out.values()))
        return out

    def _read(self, t: Tensor):
        import numpy as np

        buf = np.empty(t.nbytes, dtype=np.uint8)
        self._read_into(memoryview(buf), self.header.data_start + t.begin, f"array {t.name!r}")
        return buf


def _read_fully(fd: int, view: memoryview, offset: int, truncated) -> None:
    """Fill `view` from `offset` of `fd` with positional reads (thread-safe, the descriptor's
    offset untouched); a short read means the file shrank under us: raise `truncated()`."""
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            got = os.preadv(fd, [view[done:]], offset + done)
        else:
            chunk = os.pread(fd, len(view) - done, offset + done)
            got = len(chunk)
            view[done : done + got] = chunk
        if not got:
            raise truncated()
        done += got


def _groups(tensors: list, workers: int) -> list:
    """Runs of consecutive arrays of about equal bytes, one per worker."""
    total = sum(t.nbytes for t in tensors) or 1
    groups, run, acc = [], [], 0
    for t in tensors:
        run.append(t)
        acc += t.nbytes
        if acc * workers >= total * (len(groups) + 1) and len(groups) < workers - 1:
            groups.append(run)
            run = []
    if run:
        groups.append(run)
    return groups


class PendingChecksums:
    """Checksums of a cache file's arrays, checked on worker threads while the caller goes on.

    One task per worker over runs of consecutive arrays of about equal bytes; each reads its
    arrays in chunks into one reused buffer (positional reads on a duplicate of the reader's
    descriptor, so the checks outlive the reader; hashlib releases the GIL) and stops early once
    any check fails or the checks are abandoned. `wait()` also refuses a file whose size or
    modification time changed since it was opened (edited in place while it was read).
    """

    def __init__(self, reader: "Reader"):
        import numpy as np

        header, corrupt = reader.header, reader.corrupt
        tensors = list(header.tensors.values())
        self._corrupt, self._opened = corrupt, reader.opened
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._done = False
        stop = self._stop = threading.Event()  # set by a failed check, or by abandoning them
        fd = self._fd = os.dup(reader.file.fileno())
        self._futures: list = []

        def task(group):
            scratch = np.empty(min(CHUNK, max((t.nbytes for t in group), default=1)), dtype=np.uint8)
            for t in group:
                try:
                    digest = hashlib.sha256()
                    for lo in range(0, t.nbytes, len(scratch)):
                        if stop.is_set():
                            return
                        view = memoryview(scratch)[: min(len(scratch), t.nbytes - lo)]
                        _read_fully(
                            fd, view, header.data_start + t.begin + lo, lambda: corrupt(f"truncated inside array {t.name!r}")
                        )
                        digest.update(view)
                    if digest.hexdigest() != header.checksums[t.name]:
                        raise corrupt(f"array {t.name!r} fails its checksum")
                except BaseException:
                    stop.set()
                    raise

        try:
            workers = max(1, min(8, os.cpu_count() or 1, len(tensors)))
            groups = _groups(tensors, workers) if tensors else []
            pool = ThreadPoolExecutor(max_workers=max(1, len(groups)))
        except BaseException:
            os.close(fd)
            raise
        # Dropped without wait(): stop the tasks, let them finish their chunk, close the fd.
        self._finalizer = weakref.finalize(self, PendingChecksums._release, (stop, pool, fd))
        try:
            self._futures = [pool.submit(task, group) for group in groups]
        except BaseException:
            self._finalizer()
            raise

    @staticmethod
    def _release(resources: tuple) -> None:
        stop, pool, fd = resources
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        os.close(fd)

    def guard(self, pieces):
        """Yield from `pieces` (e.g. the streamed answer computed from the arrays these checksums
        cover), showing nothing before every check has passed, and checking at the end whatever
        happens (no piece, an error, an abandoned stream): the one place the rule lives that no
        text computed from an unverified cache reaches the user.

        Raises:
            CacheCorrupt: a check failed (before the first piece, or at the end).
        """
        try:
            first = True
            for piece in pieces:
                if first:
                    self.wait()
                    first = False
                yield piece
        finally:
            self.wait()

    def wait(self) -> None:
        """Block until every checksum is checked; raise CacheCorrupt if any failed or the file
        changed (every call does, once one has). Interrupted, the checks stop and every later
        call raises too: an unfinished check never passes for a finished one."""
        with self._lock:
            if not self._done:
                try:
                    for future in self._futures:
                        error = future.exception()
                        if error is not None and self._error is None:
                            self._error = error
                    if self._error is None:
                        st = os.fstat(self._fd)
                        if (st.st_size, st.st_mtime_ns) != self._opened:
                            self._error = self._corrupt("it changed while it was being read")
                except BaseException:
                    self._stop.set()
                    if self._error is None:
                        self._error = RuntimeError("the cache's checksum checks were interrupted")
                    raise
                finally:
                    self._done = True
                    self._futures = []
                    self._finalizer()  # stops and joins the tasks, closes the fd
            if self._error is not None:
                raise self._error


def open_cache(path: Path, label: str, hint: str) -> Reader:
    """Open `path` and validate its header (no array is read yet).

    Args:
        path: the `.safetensors` file.
        label: the document's name, for messages.
        hint: what to do about a bad file ("rebuild it with `longctx ingest --force FILE`").

    Raises:
        CacheCorrupt: the file is missing or fails any check (`CacheFormatUnsupported` for
            another format version).
    """
    return Reader(path, label, hint)
