"""The Flower node host's serving loop: ``accept`` on the node's socket, a thread per
connection, and what keeps the loop going when the process runs short of resources.

Why a module of its own: the loop is where issue 39's "one ``accept()`` error ends the
node's host" was, and its rules are their own: an ``accept`` that fails for want of
resources (``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``) or a connection aborted in
the queue (``TRANSIENT_ACCEPT``) is logged once per episode and retried after a
back-off (``BACKOFF_FIRST_S`` doubling to ``BACKOFF_MAX_S``, on the host's ``stopping``
event, so a shutdown ends the wait), as the Rust core does; any other failure ends the
host through its ``shutdown``, which removes its files. At most the host's
``max_unauthenticated`` connections are in their handshake at once: further ones are
closed at once (logged once per episode). ``raise_nofile`` raises the soft descriptor
limit to the hard one at start (the host holds about ten descriptors per rank).

Caveats: a connection closed for want of a handshake slot or of a thread gets no
answer (its ClientApp sees the channel closed); the loop wakes every quarter second
(the listening socket's timeout, set by ``Host.serve``) to see ``stopping``.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import TYPE_CHECKING

from rankexec.flower import _hostops
from rankexec.flower._hostlog import log

if TYPE_CHECKING:
    import socket

    from rankexec.flower.host import Host

__all__ = ["TRANSIENT_ACCEPT", "accept_loop", "nofile", "raise_nofile"]

#: ``accept`` errors that pass: resources run out (descriptors, buffers, memory) or a
#: connection was aborted while queued. Others end the host (through ``shutdown``).
TRANSIENT_ACCEPT = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
)
#: The back-off after a failed ``accept``: doubling from the first to the last.
BACKOFF_FIRST_S = 0.01
BACKOFF_MAX_S = 1.0
#: The soft descriptor limit to take when the hard one is unlimited.
NOFILE_UNLIMITED = 1 << 20


def raise_nofile() -> None:
    """Raises this process's soft ``RLIMIT_NOFILE`` to its hard one (logged): the host
    holds about ten descriptors per rank, and the usual soft limit of 1024 is short of
    what a site's ``max_processes`` and ``max_runs`` allow. Its ranks inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, NOFILE_UNLIMITED)
    if soft == resource.RLIM_INFINITY or soft >= want:
        log(f"descriptor limit {soft} (the hard limit)")
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as e:
        log(f"descriptor limit {soft}: raising it to {want} failed: {e}")
        return
    log(f"descriptor limit raised from {soft} to {want} (the hard limit)")


def nofile() -> str:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


def accept_loop(host: Host, srv: socket.socket) -> None:
    """Accepts until the host stops. A failed ``accept`` that may pass (see
    ``TRANSIENT_ACCEPT``) is logged once per episode and retried after a back-off on
    ``stopping`` (a shutdown ends the wait); any other ends the host through
    ``shutdown``. Connections past ``max_unauthenticated`` in their handshake at
    once are closed at once (logged once per episode)."""
    failed = 0  # accepts failed in this episode
    backoff = 0.0
    episode_start = 0.0
    refused = 0  # connections closed in this episode for want of a handshake slot
    while not host.stopping.is_set():
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            conn = None
        except OSError as e:
            if e.errno not in TRANSIENT_ACCEPT:
                host.shutdown(f"the listening socket failed: {e}")
                return
            if failed == 0:
                episode_start = time.monotonic()
                log(
                    f"accept failed: {e} ({errno.errorcode.get(e.errno or 0, '?')},"
                    f" descriptor limit {nofile()}); retrying with a back-off up to"
                    f" {BACKOFF_MAX_S:g}s, logged once until it passes"
                )
            failed += 1
            backoff = min(max(backoff * 2, BACKOFF_FIRST_S), BACKOFF_MAX_S)
            host.stopping.wait(backoff)
            continue
        if failed:
            log(
                f"accepting again after {failed} failed accepts over"
                f" {time.monotonic() - episode_start:.2f}s"
            )
            failed, backoff = 0, 0.0
        if conn is None:
            continue
        if not host.unauthenticated.acquire(blocking=False):
            if refused == 0:
                log(
                    f"{host.max_unauthenticated} connections are in their handshake at"
                    " once (--max-unauthenticated); closing new ones until one ends"
                )
            refused += 1
            conn.close()
            continue
        if refused:
            log(f"taking connections again ({refused} closed while the handshakes were full)")
            refused = 0
        try:
            threading.Thread(target=_hostops.serve_conn, args=(host, conn), daemon=True).start()
        except RuntimeError as e:  # no thread to be had: like a failed accept
            host.unauthenticated.release()
            conn.close()
            log(f"a connection was closed: no thread to serve it ({e})")
            backoff = min(max(backoff * 2, BACKOFF_FIRST_S), BACKOFF_MAX_S)
            host.stopping.wait(backoff)
