"""Named crash points for the reliability tests: `LONGCTX_FAILPOINT=<point>[:<action>]`.

At the named point the process SIGKILLs itself (`kill`, the default), stops itself with SIGSTOP
(`stop`: a test holds it there, e.g. mid-write with its lock held, and sends SIGCONT), or raises
`OSError(ENOSPC)` (`enospc`: a disk that fills up right there). Unset, a failpoint is one
environment lookup. Points: `ingest:locked`, `ingest:prefilled`, `write:opened`, `write:mid`,
`write:arrays`, `write:written`, `write:synced`, `write:renamed`, `save:written`, `save:indexed`,
`save:done`, `remove:unindexed`, `evict:unindexed`.
"""

from __future__ import annotations

import errno
import os
import signal
from longctx import config

ENV = "LONGCTX_FAILPOINT"


def failpoint(name: str) -> None:
    """Act as `$LONGCTX_FAILPOINT` says if it names this point; otherwise do nothing."""
    spec = config.get("failpoint")
    if not spec:
        return
    point, _, action = spec.rpartition(":") if spec.count(":") > 1 else (spec, "", "")
    if point != name:
        return
    if action in ("", "kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
