"""Per-entry `fcntl.flock` locks: `locks/<id>.lock`, one file per entry id (macOS and Linux).

Exclusive: a writer of the entry (ingest, from deciding to build it until the index says so), an
evictor or `rm` (unindex, then delete), the crash cleanup (try-lock only). Shared: a reader
(ask, export) while it opens the entry's file; once open, the file stays readable whatever
happens to its name (POSIX), so evicting it then would free nothing until the reader is done.
Evictors only try-lock, so they skip entries in use instead of waiting for them.

flock locks belong to an open file description: a second `os.open` of the same lock in the
same process conflicts with the first, which is what lets one process test another's lock.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from longctx.errors import StoreError

READ_WAIT_SECONDS = 1.0  # a reader waits this long for an exclusive holder, then reads unlocked
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def _open(directory: Path, eid: str) -> int:
    try:
        return os.open(directory / f"{eid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        raise StoreError(f"Cannot create a lock in {directory}: {err.strerror or err}.") from err


def _no_locking(directory: Path, err: OSError) -> StoreError:
    return StoreError(
        f"Cannot lock files in {directory} ({err.strerror or err}); the data "
        "directory must be on a local disk: set LONGCTX_HOME to one."
    )


def _take(directory: Path, fd: int, mode: int) -> bool:
    """flock `fd` without waiting; whether it was taken."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno not in _BUSY:
            raise _no_locking(directory, err) from err
        return False


@contextmanager
def exclusive(directory: Path, eid: str) -> Iterator[None]:
    """Hold `eid`'s exclusive lock (waits for any other holder)."""
    fd = _open(directory, eid)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            raise _no_locking(directory, err) from err
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def try_exclusive(directory: Path, eid: str) -> Iterator[bool]:
    """Take `eid`'s exclusive lock if nobody holds it; yields whether it was taken."""
    fd = _open(directory, eid)
    try:
        yield _take(directory, fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


@contextmanager
def shared(directory: Path, eid: str, wait: float = READ_WAIT_SECONDS) -> Iterator[bool]:
    """Hold `eid`'s shared lock, waiting up to `wait` seconds for an exclusive holder; yields
    whether it is held. An evictor or `rm` holds the lock for milliseconds, after which the
    entry is gone (the caller finds its file missing and says so); only an ingest rebuilding
    the entry (`--force`) holds it for long, and reading the current file meanwhile is safe:
    the rebuilt one replaces it by an atomic rename."""
    fd = _open(directory, eid)
    try:
        deadline = time.monotonic() + wait
        held = _take(directory, fd, fcntl.LOCK_SH)
        while not held and time.monotonic() < deadline:
            time.sleep(0.01)
            held = _take(directory, fd, fcntl.LOCK_SH)
        yield held
    finally:
        os.close(fd)
