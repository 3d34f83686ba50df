"""``python -m rankexec.flower.host``: the per-node host that keeps the runs' rank groups
and decides, for the site, what they run.

Why: Flower 1.42 runs every message in a new ``flwr-clientapp`` process, so a rank
group kept across rounds must live elsewhere. One host runs per SuperNode (per node
id), started by the first ClientApp process that needs it (see ``_start``), in its own
session, with the SuperNode's environment, or started by the site beside the SuperNode.

The host is the site's authority: it reads the site's rules itself (``_site``: the
SuperNode's ``--node-config`` from its command line, the site file it or the
SuperNode's ``$RANKEXEC_FLOWER_SITE`` names) and builds each group's configuration
from them and the app's *requests*; a request that asks for more than the site allows
is refused with the rule named, whoever sent it.

Runs apart: each run keeps its own group (``_runs.Run``, keyed by run id on this
node), up to the site's ``max_runs``; a message of one run never closes, reuses or
imports into another run's group, and each run's end closes its own.

One host per node: the host holds ``host.lock`` (an exclusive ``flock``, with its pid
in it) for its whole life; a second host refuses to start naming the first's pid
(exit code 3), and a host removes only the socket and secret it made.

A run's group ends, and nothing of it is left (its rank logs included, unless the
site's ``log_dir`` keeps them), when:

- the run ends: the ServerApp's ``rankexec.flower.close_groups(grid)`` sends every
  node a ``query.rankexec_close`` message;
- ``flwr stop`` (or the run's end without ``close_groups``): the host asks the
  SuperLink's Fleet API, as the node, whether each run it knows still runs (a live
  group or one closed by a failure or an abort), every couple of seconds (``_runcheck``: with TLS and SuperNode authentication, with
  the SuperNode's own settings and key, never the Control API); a finished run's task
  in flight gets rankexec's abort (ranks that ignore it are killed after
  ``deadlines.abort_grace``) and the group closes;
- the idle lease runs out (no message of the run for ``lease`` seconds).

The host ends, with every group, when its SuperNode dies (it watches its pid), on
SIGTERM/SIGINT, or after a lease with no run. A rank that raises or dies fails the
message (the ClientApp answers with Flower's ``Error``); that run's group is closed and
its next message starts a new one.

Caveats: the run-status check needs the SuperLink to answer (a SuperLink that cannot
be reached leaves the run to the idle lease) and, with SuperNode authentication, the
node's key (the SuperNode's ``--auth-supernode-private-key``, or ``--node-key`` for a
host the site starts); without node authentication it registers a probe key that is
never online (see ``_runcheck``). The channel proves the
caller's uid, not its run (see ``_runs``). ``host.log`` is cut back to its last
``_LOG_KEEP`` bytes when it passes ``_LOG_MAX``. On shutdown the host waits up to
``--shutdown-wait`` (``_SHUTDOWN_WAIT_S``) for each task in flight to return after its
abort, and its serving thread closes its group; a task that does not return by then
keeps its group (nothing closes it under the task) and the host exits: its ranks see
their parent gone and exit (rankexec's parent watch), as they do when the host is
SIGKILLed.

Resilience (the serving loop ends only through ``shutdown``, which removes the host's
files): at start the host raises its soft ``RLIMIT_NOFILE`` to the hard one (about ten
descriptors per rank); an ``accept`` that fails for want of resources (``EMFILE``,
``ENFILE``, ``ENOBUFS``, ``ENOMEM``) or a connection aborted in the queue is logged
once per episode and retried after a back-off (10 ms doubling to 1 s), and the host
serves on; at most ``--max-unauthenticated`` connections are in their handshake at
once (further ones are closed at once, logged once per episode), each has
``--handshake-deadline`` seconds for the whole exchange and then ``--request-deadline``
seconds to send its request; a frame is refused past the channel's limits
(``_channel.MAX_HEAD``, raw buffers under ``_channel.SHARE_FROM``) and the refusal,
which names the limit, is the answer.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import os
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rankexec.flower import _channel, _runcheck, _site
from rankexec.flower._runs import Run

__all__ = ["HOST_TAKEN_EXIT", "Host", "HostTaken", "main"]

HOST_TAKEN_EXIT = 3
_SHUTDOWN_WAIT_S = 30.0
_LOG_MAX = 4 << 20
_LOG_KEEP = 1 << 20
#: Seconds a connection has for the whole handshake (nonce, answer, OK).
_HANDSHAKE_S = 10.0
#: Seconds an authenticated connection has to send its whole request.
_REQUEST_S = 60.0
#: Connections in their handshake at once; further ones are closed at once.
_MAX_UNAUTHENTICATED = 64
#: ``accept`` errors that pass: resources run out (descriptors, buffers, memory) or a
#: connection was aborted while queued. Others end the host (through ``shutdown``).
_TRANSIENT_ACCEPT = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
)
#: The back-off after a failed ``accept``: doubling from the first to the last.
_BACKOFF_FIRST_S = 0.01
_BACKOFF_MAX_S = 1.0
#: The soft descriptor limit to take when the hard one is unlimited.
_NOFILE_UNLIMITED = 1 << 20


class HostTaken(RuntimeError):
    """Another live host holds the node's ``host.lock``."""


def _log(text: str) -> None:
    _bound_stderr()
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} rankexec.flower.host[{os.getpid()}]: {text}\n")
    sys.stderr.flush()


def _bound_stderr() -> None:
    """Keeps a regular file on stderr (``host.log``) to its last ``_LOG_KEEP`` bytes."""
    with contextlib.suppress(OSError, ValueError):
        fd = sys.stderr.fileno()
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_size > _LOG_MAX):
            return
        # stderr is often write-only (opened for appending): read through /proc.
        with open(f"/proc/self/fd/{fd}", "rb") as f:
            f.seek(st.st_size - _LOG_KEEP)
            tail = f.read(_LOG_KEEP)
        sys.stderr.flush()
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"[host.log cut to its last bytes]\n" + tail)


def _raise_nofile() -> None:
    """Raises this process's soft ``RLIMIT_NOFILE`` to its hard one (logged): the host
    holds about ten descriptors per rank, and the usual soft limit of 1024 is short of
    what a site's ``max_processes`` and ``max_runs`` allow. Its ranks inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, _NOFILE_UNLIMITED)
    if soft == resource.RLIM_INFINITY or soft >= want:
        _log(f"descriptor limit {soft} (the hard limit)")
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as e:
        _log(f"descriptor limit {soft}: raising it to {want} failed: {e}")
        return
    _log(f"descriptor limit raised from {soft} to {want} (the hard limit)")


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Host:
    """Serves one node's ClientApp processes (see the module docs)."""

    def __init__(
        self,
        directory: Path,
        node_id: int,
        supernode_pid: int | None,
        superlink: str | None = None,
        lease_s: float | None = None,
        site_file: str | None = None,
        node_config: str | None = None,
        *,
        root_certificates: str | None = None,
        node_key: str | None = None,
        shutdown_wait_s: float = _SHUTDOWN_WAIT_S,
        handshake_s: float = _HANDSHAKE_S,
        request_s: float = _REQUEST_S,
        max_unauthenticated: int = _MAX_UNAUTHENTICATED,
    ) -> None:
        self.dir = directory
        self.shutdown_wait_s = shutdown_wait_s
        self.handshake_s = handshake_s
        self.request_s = request_s
        self.max_unauthenticated = max_unauthenticated
        # One slot per connection in its handshake, taken by the serving loop at accept.
        self._unauthenticated = threading.BoundedSemaphore(max_unauthenticated)
        # Set when ``shutdown`` has done everything it does: ``serve`` returns (and the
        # process exits) only then, or a task in flight would lose its host under it.
        self.shut_down = threading.Event()
        self.node_id = node_id
        self.supernode_pid = supernode_pid
        # Where the site's rules come from: the operator's arguments, else the
        # SuperNode's own command line and environment, else this process's environment.
        config: dict[str, Any] = {}
        env_site = _site.site_file_from_env(os.environ)
        from_supernode = (
            _site.supernode_settings(supernode_pid) if supernode_pid is not None else None
        )
        if from_supernode is not None:
            config, env_site, link = from_supernode
            superlink = superlink or link
        if node_config is not None:
            config = _site.parse_node_config(node_config)
        self.node_config = config
        self.site_file = site_file or env_site
        try:
            site = self.read_site()
        except _site.SiteError as e:
            _log(f"the site's rules cannot be read (every request is refused): {e}")
            site = {}
        self.superlink = site.get("superlink") or superlink
        fleet = _runcheck.settings(supernode_pid, site, superlink, root_certificates, node_key)
        self.runcheck = _runcheck.RunCheck(fleet, node_id, _log) if fleet is not None else None
        if fleet is not None:
            self.superlink = fleet.superlink
        self.lease_s = float(lease_s if lease_s is not None else site.get("lease_s", 300.0))
        self.lock = threading.Lock()  # guards self.runs (short sections only)
        self.runs: dict[int, Run] = {}
        self.last_active = time.monotonic()
        self.stopping = threading.Event()
        self.secret = b""
        self._made: dict[str, int] = {}  # file name -> inode of what this host created
        self._lock_fd: int | None = None

    def read_site(self) -> dict[str, Any]:
        """The site's rules as they are now (read for every message)."""
        return _site.load(self.node_config, self.site_file)

    # ---- requests --------------------------------------------------------------------

    def _execute(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            run_id = int(req["run_id"])
        except (KeyError, TypeError, ValueError):
            return {"error": "the request names no run id", "rank": None}
        while True:
            with self.lock:
                self.last_active = time.monotonic()
                if self.stopping.is_set():
                    return {"error": "the rankexec host is shutting down", "rank": None}
                try:
                    site = self.read_site()
                except _site.SiteError as e:
                    return {"error": str(e), "rank": None, "kind": "SiteError"}
                run = self.runs.get(run_id)
                if run is None:
                    limit = int(site.get("max_runs", 4))
                    if len(self.runs) >= limit:
                        return {
                            "error": f"run {run_id}: this node serves at most {limit} runs at"
                            f" once (rankexec-max-runs or `max_runs` in the site file) and"
                            f" runs {sorted(self.runs)} hold it; retry when one ends",
                            "rank": None,
                            "kind": "SiteError",
                        }
                    keep = bool(site.get("log_dir"))
                    logs = Path(site["log_dir"]) if keep else self.dir
                    run = Run(run_id, self.node_id, logs / f"run-{run_id}", keep)
                    self.runs[run_id] = run
            with run.lock:
                if run.ended:
                    continue  # closed while this message waited: a new group
                out = run.execute(site, req, self.stopping, _log)
                if run.app is None or run.ended:
                    # Refused before anything started, or ended by a shutdown.
                    self._forget(run)
                return out

    def _forget(self, run: Run) -> None:
        with self.lock:
            if self.runs.get(run.run_id) is run:
                del self.runs[run.run_id]

    def _end_run(self, run: Run, why: str) -> dict[str, Any]:
        """Under ``run.lock``: the run's group closes for good and the run is forgotten."""
        report = run.end(why, _log)
        self._forget(run)
        return report

    def _close(self, req: dict[str, Any]) -> dict[str, Any]:
        run_id = req.get("run_id")
        with self.lock:
            self.last_active = time.monotonic()
            run = self.runs.get(run_id) if isinstance(run_id, int) else None
        if run is None:
            return {"closed": False, "pids": []}
        with run.lock:
            app = req.get("app")
            if run.app is not None and app is not None and dict(app) != run.app:
                return {
                    "error": f"run {run_id}'s group serves another app; this close is refused",
                    "rank": None,
                }
            if run.ended:
                return {"closed": False, "pids": []}
            report = self._end_run(run, "closed by the ServerApp")
            return {"closed": True, "pids": report.get("pids", [])}

    def _status(self) -> dict[str, Any]:
        with self.lock:
            runs = {rid: r.status() for rid, r in self.runs.items()}
        return {
            "pid": os.getpid(),
            "runs": runs,
            "run_ids": sorted(runs),
            "pids": [p for r in runs.values() for p in r["pids"]],
            "busy": any(r["busy"] for r in runs.values()),
            "supernode_pid": self.supernode_pid,
        }

    # ---- serving ---------------------------------------------------------------------

    def _serve_conn(self, conn: socket.socket) -> None:
        """One connection, on its own thread; it holds one of the handshake slots (taken
        by the serving loop) until its handshake ends."""
        with conn:
            try:
                try:
                    _channel.accept_auth(conn, self.secret, self.handshake_s)
                finally:
                    self._unauthenticated.release()
                req = _channel.recv(conn, time.monotonic() + self.request_s)
                # The answer may wait for a task; sending it may not wait forever.
                conn.settimeout(self.request_s)
                op = req.get("op") if isinstance(req, dict) else None
                if op == "execute":
                    out = self._execute(req)
                    blobs = out.pop("blobs", {})
                    out["blobs"] = {k: _pickle_buffer(v) for k, v in blobs.items()}
                elif op == "close":
                    out = self._close(req)
                elif op == "status":
                    out = self._status()
                else:
                    out = {"error": f"unknown operation {op!r}", "rank": None}
                _channel.send(conn, out)
            except _channel.FrameRefused as e:
                _log(f"a request was refused: {e}")
                with contextlib.suppress(Exception):
                    conn.settimeout(self.request_s)
                    _channel.send(conn, {"error": f"rankexec host: {e}", "rank": None})
            except (OSError, _channel.ChannelError) as e:
                _log(f"a connection failed: {e}")
            except Exception as e:  # noqa: BLE001 - answered, logged, the host serves on
                _log(f"a request failed: {type(e).__name__}: {e}")
                with contextlib.suppress(Exception):
                    _channel.send(conn, {"error": f"rankexec host: {type(e).__name__}: {e}"})

    def _run_finished(self, run_id: int) -> bool:
        """Whether the SuperLink says the run is over (``flwr stop`` or its end)."""
        return self.runcheck is not None and self.runcheck.finished(run_id) is True

    def _watch(self) -> None:
        next_status: dict[int, float] = {}
        while not self.stopping.wait(0.25):
            if self.supernode_pid is not None and not _pid_alive(self.supernode_pid):
                self.shutdown(f"the SuperNode (pid {self.supernode_pid}) is gone")
                return
            now = time.monotonic()
            with self.lock:
                runs = list(self.runs.values())
                idle = now - self.last_active
            for run in runs:
                # Every run the host knows, with or without a live group (one whose task
                # was aborted, or whose rank failed): a finished run is forgotten at once.
                if now >= next_status.get(run.run_id, 0.0):
                    next_status[run.run_id] = now + 2.0
                    if self._run_finished(run.run_id):
                        self._run_ended(run, f"run {run.run_id} is finished (flwr stop or its end)")
                        continue
                if now - run.last_active > self.lease_s and run.lock.acquire(blocking=False):
                    try:
                        if not run.ended and time.monotonic() - run.last_active > self.lease_s:
                            self._end_run(run, "the idle lease ran out")
                    finally:
                        run.lock.release()
            if not runs and idle > self.lease_s:
                self.shutdown("idle, no run, the lease ran out")
                return

    def _run_ended(self, run: Run, why: str) -> None:
        if run.lock.acquire(blocking=False):
            try:
                if not run.ended:
                    self._end_run(run, why)
            finally:
                run.lock.release()
            return
        # A task of the run is in flight: abort it; its serving thread closes the group
        # when the abort lands, and the next check ends the run.
        _log(f"aborting run {run.run_id}'s task in flight: {why}")
        run.abort(why)

    def shutdown(self, why: str) -> None:
        if self.stopping.is_set():
            return
        _log(f"shutting down: {why}")
        self.stopping.set()
        try:
            with self.lock:
                runs = list(self.runs.values())
            for run in runs:
                if run.busy:
                    run.abort(why)
            deadline = time.monotonic() + self.shutdown_wait_s
            for run in runs:
                if run.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    try:
                        if not run.ended:
                            self._end_run(run, why)
                    finally:
                        run.lock.release()
                else:
                    _log(
                        f"run {run.run_id}'s task did not return within"
                        f" {self.shutdown_wait_s}s of its abort; the host exits without"
                        " closing its group under it (its ranks follow their parent)"
                    )
            for name in ("host.sock", "secret", "host.pid"):
                self._unlink_ours(name)
            if self.runcheck is not None:
                self.runcheck.close()
        finally:
            self.shut_down.set()

    # ---- the node's files ------------------------------------------------------------

    def _take_node(self) -> None:
        """Holds ``host.lock`` for this process's life, or raises ``HostTaken``."""
        path = self.dir / "host.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise HostTaken(
                f"another rankexec host (pid {other}) serves node {self.node_id} from"
                f" {self.dir} (it holds {path}); this one does not start"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        # The lock is ours, so a socket or secret left here is a dead host's.
        for name in ("host.sock", "secret", "host.pid"):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()

    def _note_made(self, name: str) -> None:
        self._made[name] = (self.dir / name).lstat().st_ino

    def _unlink_ours(self, name: str) -> None:
        ino = self._made.pop(name, None)
        path = self.dir / name
        with contextlib.suppress(OSError):
            if ino is not None and path.lstat().st_ino == ino:
                path.unlink()

    def serve(self) -> int:
        if self._lock_fd is None:
            self._take_node()
        self.secret = _channel.write_secret(self.dir / "secret")
        self._note_made("secret")
        path = self.dir / "host.sock"
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _channel.socket_path(self.dir) as address:
            srv.bind(address)
        self._note_made("host.sock")
        os.chmod(path, 0o600)
        # Room in the queue for the connections that wait while accepting backs off.
        srv.listen(max(16, self.max_unauthenticated))
        srv.settimeout(0.25)
        (self.dir / "host.pid").write_text(str(os.getpid()))
        self._note_made("host.pid")
        _log(
            f"serving node {self.node_id} on {path} (SuperNode pid {self.supernode_pid},"
            f" SuperLink {self.superlink}, lease {self.lease_s}s, site file"
            f" {self.site_file}, node config {self.node_config})"
        )
        threading.Thread(target=self._watch, name="watch", daemon=True).start()
        try:
            self._accept_loop(srv)
        except Exception as e:  # noqa: BLE001 - the host shuts down, removing its files
            self.shutdown(f"the serving loop failed: {type(e).__name__}: {e}")
        finally:
            srv.close()
        # The shutdown (a signal's thread, or the watch's) waits for tasks in flight;
        # returning before it ends would end the process under them.
        if not self.shut_down.wait(self.shutdown_wait_s + 30.0):
            _log("the shutdown did not end in time; the host exits")
        return 0

    def _accept_loop(self, srv: socket.socket) -> None:
        """Accepts until the host stops. A failed ``accept`` that may pass (see
        ``_TRANSIENT_ACCEPT``) is logged once per episode and retried after a back-off on
        ``stopping`` (a shutdown ends the wait); any other ends the host through
        ``shutdown``. Connections past ``max_unauthenticated`` in their handshake at
        once are closed at once (logged once per episode)."""
        failed = 0  # accepts failed in this episode
        backoff = 0.0
        episode_start = 0.0
        refused = 0  # connections closed in this episode for want of a handshake slot
        while not self.stopping.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                conn = None
            except OSError as e:
                if e.errno not in _TRANSIENT_ACCEPT:
                    self.shutdown(f"the listening socket failed: {e}")
                    return
                if failed == 0:
                    episode_start = time.monotonic()
                    _log(
                        f"accept failed: {e} ({errno.errorcode.get(e.errno or 0, '?')},"
                        f" descriptor limit {_nofile()}); retrying with a back-off up to"
                        f" {_BACKOFF_MAX_S:g}s, logged once until it passes"
                    )
                failed += 1
                backoff = min(max(backoff * 2, _BACKOFF_FIRST_S), _BACKOFF_MAX_S)
                self.stopping.wait(backoff)
                continue
            if failed:
                _log(
                    f"accepting again after {failed} failed accepts over"
                    f" {time.monotonic() - episode_start:.2f}s"
                )
                failed, backoff = 0, 0.0
            if conn is None:
                continue
            if not self._unauthenticated.acquire(blocking=False):
                if refused == 0:
                    _log(
                        f"{self.max_unauthenticated} connections are in their handshake at"
                        " once (--max-unauthenticated); closing new ones until one ends"
                    )
                refused += 1
                conn.close()
                continue
            if refused:
                _log(f"taking connections again ({refused} closed while the handshakes were full)")
                refused = 0
            try:
                threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()
            except RuntimeError as e:  # no thread to be had: like a failed accept
                self._unauthenticated.release()
                conn.close()
                _log(f"a connection was closed: no thread to serve it ({e})")
                backoff = min(max(backoff * 2, _BACKOFF_FIRST_S), _BACKOFF_MAX_S)
                self.stopping.wait(backoff)


def _nofile() -> str:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


def _pickle_buffer(v: Any) -> Any:
    import pickle

    # The blob itself (not a memoryview of it): the channel passes its memory file.
    return pickle.PickleBuffer(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rankexec.flower.host", description=__doc__)
    p.add_argument(
        "--dir", type=Path, default=None, help="default: the node's folder under the base"
    )
    p.add_argument("--node-id", required=True, type=int)
    p.add_argument("--supernode-pid", type=int, default=None)
    p.add_argument(
        "--superlink", default=None, help="the SuperLink's address (default: the SuperNode's)"
    )
    p.add_argument(
        "--root-certificates",
        default=None,
        help="the CA that signs the SuperLink's certificate (default: the SuperNode's)",
    )
    p.add_argument(
        "--node-key",
        default=None,
        help="the node's private key, with SuperNode authentication (default: the SuperNode's)",
    )
    p.add_argument("--lease", type=float, default=None, help="idle seconds (default: the site's)")
    p.add_argument("--site", default=None, help="the site file (default: the SuperNode's)")
    p.add_argument(
        "--shutdown-wait",
        type=float,
        default=_SHUTDOWN_WAIT_S,
        help="on SIGTERM, seconds a task in flight has to return after its abort"
        f" (default {_SHUTDOWN_WAIT_S:g})",
    )
    p.add_argument(
        "--handshake-deadline",
        type=float,
        default=_HANDSHAKE_S,
        help="seconds a connection has for the whole handshake before it is closed"
        f" (default {_HANDSHAKE_S:g})",
    )
    p.add_argument(
        "--request-deadline",
        type=float,
        default=_REQUEST_S,
        help="seconds an authenticated connection has to send its request"
        f" (default {_REQUEST_S:g})",
    )
    p.add_argument(
        "--max-unauthenticated",
        type=int,
        default=_MAX_UNAUTHENTICATED,
        help="connections in their handshake at once; further ones are closed at once"
        f" (default {_MAX_UNAUTHENTICATED})",
    )
    p.add_argument(
        "--node-config", default=None, help="the SuperNode's --node-config (default: read it)"
    )
    a = p.parse_args(argv)
    if a.max_unauthenticated < 1 or a.handshake_deadline <= 0 or a.request_deadline <= 0:
        p.error("--max-unauthenticated, --handshake-deadline and --request-deadline are positive")
    directory = _channel.private_dir(a.dir) if a.dir else _channel.node_dir(a.node_id)
    try:
        host = Host(
            directory,
            a.node_id,
            a.supernode_pid,
            a.superlink,
            a.lease,
            a.site,
            a.node_config,
            root_certificates=a.root_certificates,
            node_key=a.node_key,
            shutdown_wait_s=a.shutdown_wait,
            handshake_s=a.handshake_deadline,
            request_s=a.request_deadline,
            max_unauthenticated=a.max_unauthenticated,
        )
        host._take_node()
    except (HostTaken, _site.SiteError) as e:
        _log(str(e))
        return HOST_TAKEN_EXIT if isinstance(e, HostTaken) else 2

    def on_signal(signum: int, _frame: Any) -> None:
        threading.Thread(target=host.shutdown, args=(f"signal {signum}",), daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _raise_nofile()
    return host.serve()


if __name__ == "__main__":
    sys.exit(main())
