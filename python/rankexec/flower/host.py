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

One host per node, whatever happens to the node's folder: the host holds, for its whole
life, a lock socket (a Linux abstract Unix socket named from the uid and the folder's
path, ``_lock_name``: no file, so removing the folder does not free it, and it goes with
the process) and ``host.lock`` (an exclusive ``flock``, with its pid in it). A second
host refuses to start naming the first's pid (exit code 3; it reads it from the lock
socket, ``SO_PEERCRED``), and a host removes only the socket and secret it made. A host
whose folder, ``host.lock``, socket or secret is removed or replaced (logind removes
``/run/user/<uid>`` at the user's last logout) serves nobody any more and shuts down
(its watch checks them every quarter second).

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

The host ends, with every group, when its SuperNode dies (a pidfd of it wakes the host
at once; ``/proc`` every quarter second where no pidfd can be had), on SIGTERM/SIGINT,
when its folder goes, or after a lease with no run. After the SuperNode's death its
groups are killed at once (closed with no grace, a task in flight included): the node
is gone, nobody takes a result, and ``--shutdown-wait`` does not apply. A rank that
raises or dies fails the message (the ClientApp answers with Flower's ``Error``); that
run's group is closed and its next message starts a new one.

Caveats: the run-status check needs the SuperLink to answer (a SuperLink that cannot
be reached leaves the run to the idle lease) and, with SuperNode authentication, the
node's key (the SuperNode's ``--auth-supernode-private-key``, or ``--node-key`` for a
host the site starts); without node authentication it registers a probe key that is
never online (see ``_runcheck``). The channel proves the
caller's uid, not its run (see ``_runs``): requests are plain data (the channel's JSON
header and buffers; the host unpickles nothing), every request and every close names
its run and app and is checked against the app the host recorded for the run, and the
host writes the spec its ranks read. Against a process of the host's own user this is
a protocol, not a wall (it can read the secret, signal the host); a host run as its
own service user is what makes the boundary real. ``host.log`` is cut back to its last
``_LOG_KEEP`` bytes when it passes ``_LOG_MAX``. The lock socket's name can be taken
first by another user's process (abstract names have no owner): the host then refuses
to start, naming that pid and uid. On shutdown the host waits up to
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
import hashlib
import os
import select
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rankexec.flower import _channel, _runcheck, _site
from rankexec.flower._runs import Run, app_ref

__all__ = ["HOST_TAKEN_EXIT", "Host", "HostTaken", "main"]

HOST_TAKEN_EXIT = 3
_SHUTDOWN_WAIT_S = 30.0
#: After the SuperNode's death: seconds the groups' kill (closed with no grace) and then
#: the serving threads have, each; nobody waits for a task's result from a node that is
#: gone (``--shutdown-wait`` is for an orderly stop).
_GONE_KILL_S = 10.0
_GONE_WAIT_S = 5.0
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
    """Another live host holds the node (its lock socket, or its ``host.lock``)."""


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


def _lock_name(directory: Path) -> bytes:
    """The node's lock: a Linux abstract Unix socket name (no file, so nothing can
    remove it under the host; it goes with the host's process). From this uid and the
    node folder's path (hashed): the hosts of one folder exclude each other whatever
    happens to the folder, while separate base folders (separate deployments, test
    suites) stay apart."""
    path = os.fsencode(os.path.abspath(directory))
    digest = hashlib.sha256(path).hexdigest()[:24]
    return f"\0rankexec-flower-{os.getuid()}-{directory.name[:40]}-{digest}".encode()


def _lock_holder(name: bytes) -> str:
    """Who holds the lock socket ``name``: its listener's pid (``SO_PEERCRED``), with
    its uid when that is not ours; ``unknown`` when it does not answer in time."""
    import struct

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(name)
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return "unknown"
    pid, uid, _gid = struct.unpack("3i", creds)
    return str(pid) if uid == os.getuid() else f"{pid}, of uid {uid}, not this user"


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exits), or None where none can be had (an
    old kernel, the process already gone): then the watch reads ``/proc`` instead."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


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
        self._lock_sock: socket.socket | None = None  # the node's abstract lock
        self._dir_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the folder
        self._pidfd: int | None = None  # the SuperNode's, where pidfds work
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)  # ends the sentinel's wait

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
                    logs = Path(site["log_dir"]) if keep else self._scratch_logs()
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
        """A close names its run and its app, and is checked like any request: one that
        names no app, or an app that is not the run's, ends nothing."""
        run_id = req.get("run_id")
        app = app_ref(req.get("app"))
        if not isinstance(run_id, int) or isinstance(run_id, bool) or app is None:
            return {
                "error": "a close names its run id and its app (app_dir, module, attr);"
                " this one is refused",
                "closed": False,
                "rank": None,
            }
        with self.lock:
            self.last_active = time.monotonic()
            run = self.runs.get(run_id)
        if run is None:
            return {"closed": False, "pids": []}
        with run.lock:
            if run.ended:
                return {"closed": False, "pids": []}
            if run.app != app:
                return {
                    "error": f"run {run_id}: this run's app does not match the app the close"
                    " names; refused",
                    "closed": False,
                    "rank": None,
                }
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
        """Every quarter second: the node's folder and files (``_node_lost``), each run's
        status and lease, the host's own lease; the SuperNode's pid too where no pidfd
        could be had (the sentinel watches it otherwise)."""
        next_status: dict[int, float] = {}
        while not self.stopping.wait(0.25):
            if (
                self._pidfd is None
                and self.supernode_pid is not None
                and not _pid_alive(self.supernode_pid)
            ):
                self.shutdown(f"the SuperNode (pid {self.supernode_pid}) is gone", node_gone=True)
                return
            lost = self._node_lost()
            if lost is not None:
                self.shutdown(lost)
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

    def _sentinel(self) -> None:
        """Wakes for the SuperNode's death (its pidfd turns readable), for a host that
        asks who holds the node (a connection to the lock socket: accepted and closed,
        it read this pid from it), or for this host's stop (``shutdown`` writes the wake
        pipe). The wait has no timeout: one of these ends it, nothing else is waited for."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if self._pidfd is not None:
            poller.register(self._pidfd, select.POLLIN)
        lock = self._lock_sock
        if lock is not None:
            poller.register(lock.fileno(), select.POLLIN)
        while not self.stopping.is_set():
            for fd, _events in poller.poll():
                if fd == self._pidfd:
                    why = f"the SuperNode (pid {self.supernode_pid}) is gone"
                    self.shutdown(why, node_gone=True)
                    return
                if lock is not None and fd == lock.fileno():
                    with contextlib.suppress(OSError):
                        lock.accept()[0].close()

    def _node_lost(self) -> str | None:
        """Why the node's folder, ``host.lock``, socket or secret is no longer what this
        host made or opened (removed, or replaced), or None while they all are: a host
        whose folder is gone serves nobody (its socket cannot be reached) and leaves."""
        if self._dir_id is None:
            return None
        try:
            st = self.dir.lstat()
        except OSError:
            return f"its folder {self.dir} was removed"
        if (st.st_dev, st.st_ino) != self._dir_id:
            return f"its folder {self.dir} was replaced"
        made = dict(self._made)
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                made["host.lock"] = os.fstat(self._lock_fd).st_ino
        for name in ("host.lock", "host.sock", "secret"):
            if name not in made:
                continue
            try:
                ino = (self.dir / name).lstat().st_ino
            except OSError:
                return f"its folder {self.dir} lost its {name} (removed)"
            if ino != made[name]:
                return f"its folder {self.dir} holds another {name} (replaced)"
        return None

    def _kill_groups(self, runs: list[Run], why: str) -> None:
        """The node is gone: every run's group is closed now with no grace (``SIGTERM``
        at once, ``SIGKILL`` after the term grace), its task in flight or not (the
        executor fails the task: ``the job is ending``), all at once, each within
        ``_GONE_KILL_S``."""

        def kill(run: Run, group: Any) -> None:
            try:
                report = group.close(0.0)
                _log(f"killed the group of run {run.run_id} ({why}): {report}")
            except Exception as e:  # noqa: BLE001 - logged; the host's exit ends the rest
                _log(f"killing the group of run {run.run_id} failed: {type(e).__name__}: {e}")

        threads = []
        for run in runs:
            run.abort(why)
            group = run.group
            if group is not None:
                t = threading.Thread(target=kill, args=(run, group), daemon=True)
                t.start()
                threads.append(t)
        deadline = time.monotonic() + _GONE_KILL_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def shutdown(self, why: str, *, node_gone: bool = False) -> None:
        """Stops the host (once): aborts each task in flight and waits up to
        ``shutdown_wait_s`` for it, closes every group, removes the host's files. With
        ``node_gone`` (the SuperNode died) the groups are killed at once instead and no
        task is waited for beyond ``_GONE_WAIT_S``: nobody takes its result."""
        if self.stopping.is_set():
            return
        _log(f"shutting down: {why}")
        self.stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        try:
            with self.lock:
                runs = list(self.runs.values())
            if node_gone:
                self._kill_groups(runs, why)
            else:
                for run in runs:
                    if run.busy:
                        run.abort(why)
            wait = _GONE_WAIT_S if node_gone else self.shutdown_wait_s
            deadline = time.monotonic() + wait
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
                        f" {wait}s of its abort; the host exits without"
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
        """Holds the node for this process's life, or raises ``HostTaken``: first its
        lock socket (``_lock_name``: an abstract Unix socket, which no removal of the
        folder frees; a second host reads the holder's pid from it), then ``host.lock``
        (an exclusive ``flock``, with the pid in it: hosts in other network namespaces,
        while the folder lives)."""
        lock_name = _lock_name(self.dir)
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lock.bind(lock_name)
        except OSError as e:
            lock.close()
            if e.errno != errno.EADDRINUSE:
                raise
            raise HostTaken(
                f"another rankexec host (pid {_lock_holder(lock_name)}) serves node"
                f" {self.node_id} from {self.dir} (it holds the lock socket"
                f" @{lock_name[1:].decode()}); this one does not start"
            ) from None
        lock.listen(8)
        lock.setblocking(False)
        self._lock_sock = lock
        path = self.dir / "host.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            self._release_node()
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

    def _release_node(self) -> None:
        """Lets the node go (the process's exit does it too)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._lock_sock is not None:
            self._lock_sock.close()
            self._lock_sock = None

    def _note_made(self, name: str) -> None:
        self._made[name] = (self.dir / name).lstat().st_ino

    def _unlink_ours(self, name: str) -> None:
        ino = self._made.pop(name, None)
        path = self.dir / name
        with contextlib.suppress(OSError):
            if ino is not None and path.lstat().st_ino == ino:
                path.unlink()

    def _scratch_logs(self) -> Path:
        """Where a run's rank logs go when the site keeps none: the node's folder when
        the operator chose it (``RANKEXEC_FLOWER_DIR``), else a private folder on disk
        (``$XDG_STATE_HOME/rankexec-flower/node-<id>``, else ``~/.local/state/...``),
        not the default node folder, which is memory (tmpfs under ``$XDG_RUNTIME_DIR``)
        beside the user's admission ledger; the run's logs are removed with its group
        all the same. A home that cannot be written falls back to the node's folder,
        logged once."""
        if os.environ.get("RANKEXEC_FLOWER_DIR"):
            return self.dir  # the operator chose the node's folder: the logs go there too
        state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        folder = Path(state) / "rankexec-flower" / f"node-{self.node_id}"
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            return _channel.private_dir(folder)
        except (OSError, _channel.ChannelError) as e:
            if not getattr(self, "_scratch_warned", False):
                self._scratch_warned = True
                _log(f"rank logs stay in the node's folder {self.dir}: {e}")
            return self.dir

    def serve(self) -> int:
        if self._lock_fd is None:
            self._take_node()
        st = self.dir.lstat()
        self._dir_id = (st.st_dev, st.st_ino)
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
        if self.supernode_pid is not None:
            self._pidfd = _open_pidfd(self.supernode_pid)
            how = "a pidfd" if self._pidfd is not None else "/proc, every 0.25s (no pidfd)"
            _log(f"watching the SuperNode (pid {self.supernode_pid}) through {how}")
        threading.Thread(target=self._sentinel, name="sentinel", daemon=True).start()
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
        help="on SIGTERM, seconds a task in flight has to return after its abort (not"
        " after the SuperNode's death: its groups are killed at once)"
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
