"""The Flower node host's log: one line per event on stderr, which a host started by a
ClientApp (``_start``) points at ``host.log`` in the node's folder.

Why a module of its own: every part of the host (``host``, ``_hostnode``,
``_hostserve``, ``_hostops``, ``_hostwatch``) logs through ``log``, and the bound on the
log's size belongs with the writing.

Caveats: the bound holds only where stderr is a regular file: ``host.log`` is cut back
to its last ``LOG_KEEP`` bytes when it passes ``LOG_MAX`` (checked before each line);
a pipe or a terminal is left to whoever reads it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time

__all__ = ["LOG_KEEP", "LOG_MAX", "bound_stderr", "log"]

LOG_MAX = 4 << 20
LOG_KEEP = 1 << 20


def log(text: str) -> None:
    bound_stderr()
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} rankexec.flower.host[{os.getpid()}]: {text}\n")
    sys.stderr.flush()


def bound_stderr() -> None:
    """Keeps a regular file on stderr (``host.log``) to its last ``LOG_KEEP`` bytes."""
    with contextlib.suppress(OSError, ValueError):
        fd = sys.stderr.fileno()
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_size > LOG_MAX):
            return
        # stderr is often write-only (opened for appending): read through /proc.
        with open(f"/proc/self/fd/{fd}", "rb") as f:
            f.seek(st.st_size - LOG_KEEP)
            tail = f.read(LOG_KEEP)
        sys.stderr.flush()
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"[host.log cut to its last bytes]\n" + tail)
