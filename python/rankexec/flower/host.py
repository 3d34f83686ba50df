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
path, ``_hostnode.lock_name``: no file, so removing the folder does not free it, and it goes with
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
own service user is what makes the boundary real: ``--allow-uid``/``--allow-gid``
(``_peer.PeerPolicy``) name the SuperNode's user, every connection's peer credentials
(``SO_PEERCRED``) are checked before a byte of it is read and a peer that is neither
this uid nor allowed is refused and logged with its pid, uid and gid; the folder is
then shared with the host's group (``_peer.shared_dir``). ``--service`` keeps such a
host up when it has no run (a systemd unit, ``examples/flower/systemd``). ``host.log`` is cut back to its last
``_hostlog.LOG_KEEP`` bytes when it passes ``_hostlog.LOG_MAX``. The lock socket's name can be taken
first by another user's process (abstract names have no owner): the host then refuses
to start, naming that pid and uid. On shutdown the host waits up to
``--shutdown-wait`` (``_hostcli.SHUTDOWN_WAIT_S``) for each task in flight to return after its
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

Modules: this one holds ``Host`` (its state, ``serve``, ``shutdown``) and ``main``;
``_hostnode`` the node's lock and files, ``_hostserve`` the serving loop and its
back-off, ``_hostops`` each operation (``execute``, ``close``, ``status``),
``_hostwatch`` the watch and the sentinel, ``_hostcli`` the command line,
``_hostlog`` the bounded log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rankexec.flower import _channel, _hostcli, _hostserve, _hostwatch, _peer, _runcheck, _site
from rankexec.flower._hostlog import log as _log
from rankexec.flower._hostnode import MADE, HostTaken, NodeFiles
from rankexec.flower._runs import Run

__all__ = ["HOST_TAKEN_EXIT", "Host", "HostTaken", "main"]

HOST_TAKEN_EXIT = 3
#: After the SuperNode's death: seconds the groups' kill (closed with no grace) and then
#: the serving threads have, each; nobody waits for a task's result from a node that is
#: gone (``--shutdown-wait`` is for an orderly stop).
_GONE_KILL_S = 10.0
_GONE_WAIT_S = 5.0


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
        shutdown_wait_s: float = _hostcli.SHUTDOWN_WAIT_S,
        handshake_s: float = _hostcli.HANDSHAKE_S,
        request_s: float = _hostcli.REQUEST_S,
        max_unauthenticated: int = _hostcli.MAX_UNAUTHENTICATED,
        peers: _peer.PeerPolicy | None = None,
        service: bool = False,
    ) -> None:
        self.dir = directory
        self.peers = peers if peers is not None else _peer.PeerPolicy()
        self.service = service
        self.shutdown_wait_s = shutdown_wait_s
        self.handshake_s = handshake_s
        self.request_s = request_s
        self.max_unauthenticated = max_unauthenticated
        # One slot per connection in its handshake, taken by the serving loop at accept.
        self.unauthenticated = threading.BoundedSemaphore(max_unauthenticated)
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
        self.node = NodeFiles(directory, node_id)  # the node's lock and the files made
        self.pidfd: int | None = None  # the SuperNode's, where pidfds work
        self.wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)  # ends the sentinel's wait

    def read_site(self) -> dict[str, Any]:
        """The site's rules as they are now (read for every message)."""
        return _site.load(self.node_config, self.site_file)

    def forget(self, run: Run) -> None:
        with self.lock:
            if self.runs.get(run.run_id) is run:
                del self.runs[run.run_id]

    def end_run(self, run: Run, why: str) -> dict[str, Any]:
        """Under ``run.lock``: the run's group closes for good and the run is forgotten."""
        report = run.end(why, _log)
        self.forget(run)
        return report

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
                            self.end_run(run, why)
                    finally:
                        run.lock.release()
                else:
                    _log(
                        f"run {run.run_id}'s task did not return within"
                        f" {wait}s of its abort; the host exits without"
                        " closing its group under it (its ranks follow their parent)"
                    )
            for name in MADE:
                self.node.unlink_ours(name)
            if self.runcheck is not None:
                self.runcheck.close()
        finally:
            self.shut_down.set()

    # ---- the node's files (``_hostnode``) ---------------------------------------------

    def _take_node(self) -> None:
        """Holds the node for this process's life, or raises ``HostTaken`` (see
        ``NodeFiles.take``)."""
        self.node.take()

    def _release_node(self) -> None:
        """Lets the node go (the process's exit does it too)."""
        self.node.release()

    def serve(self) -> int:
        if self.node.lock_fd is None:
            self._take_node()
        self.node.note_dir()
        shared = self.peers.shared
        self.secret = _channel.write_secret(
            self.dir / "secret", _peer.SECRET_MODE if shared else 0o600
        )
        self.node.note_made("secret")
        path = self.dir / "host.sock"
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _channel.socket_path(self.dir) as address:
            srv.bind(address)
        self.node.note_made("host.sock")
        os.chmod(path, _peer.SOCKET_MODE if shared else 0o600)
        # Room in the queue for the connections that wait while accepting backs off.
        srv.listen(max(16, self.max_unauthenticated))
        srv.settimeout(0.25)
        (self.dir / "host.pid").write_text(str(os.getpid()))
        self.node.note_made("host.pid")
        _log(
            f"serving node {self.node_id} on {path} (SuperNode pid {self.supernode_pid},"
            f" SuperLink {self.superlink}, lease {self.lease_s}s, site file"
            f" {self.site_file}, node config {self.node_config}; peers:"
            f" {self.peers.describe()}{'; a service: no idle exit' if self.service else ''})"
        )
        if self.supernode_pid is not None:
            self.pidfd = _hostwatch.open_pidfd(self.supernode_pid)
            how = "a pidfd" if self.pidfd is not None else "/proc, every 0.25s (no pidfd)"
            _log(f"watching the SuperNode (pid {self.supernode_pid}) through {how}")
        threading.Thread(
            target=_hostwatch.sentinel, args=(self,), name="sentinel", daemon=True
        ).start()
        threading.Thread(target=_hostwatch.watch, args=(self,), name="watch", daemon=True).start()
        try:
            _hostserve.accept_loop(self, srv)
        except Exception as e:  # noqa: BLE001 - the host shuts down, removing its files
            self.shutdown(f"the serving loop failed: {type(e).__name__}: {e}")
        finally:
            srv.close()
        # The shutdown (a signal's thread, or the watch's) waits for tasks in flight;
        # returning before it ends would end the process under them.
        if not self.shut_down.wait(self.shutdown_wait_s + 30.0):
            _log("the shutdown did not end in time; the host exits")
        return 0


def main(argv: list[str] | None = None) -> int:
    a, peers = _hostcli.parse(argv, __doc__)
    try:
        if peers.shared:
            directory = _peer.shared_dir(a.dir)
        else:
            directory = _channel.private_dir(a.dir) if a.dir else _channel.node_dir(a.node_id)
    except _channel.ChannelError as e:
        _log(str(e))
        return 2
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
            peers=peers,
            service=a.service,
        )
        host._take_node()
    except (HostTaken, _site.SiteError) as e:
        _log(str(e))
        return HOST_TAKEN_EXIT if isinstance(e, HostTaken) else 2

    def on_signal(signum: int, _frame: Any) -> None:
        threading.Thread(target=host.shutdown, args=(f"signal {signum}",), daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _hostserve.raise_nofile()
    return host.serve()


if __name__ == "__main__":
    sys.exit(main())
