"""``python -m rankexec.flower.host``: the per-node host that keeps a run's rank group.

Why: Flower 1.42 runs every message in a new ``flwr-clientapp`` process, so a rank
group kept across rounds must live elsewhere. One host runs per SuperNode (per node
id), started by the first ClientApp process that needs it (see
``rankexec.flower.ClientApp``), in its own session, with the SuperNode's environment.
It owns at most one ``RankGroup``, keyed by (run id, node id), and serves the
ClientApp processes over the authenticated channel of ``rankexec.flower._channel``.

The group ends, and nothing is left, when:

- the run ends: the ServerApp's ``rankexec.flower.close_groups(grid)`` sends every
  node a ``query.rankexec_close`` message; a message of a new run id also closes the
  old run's group first;
- ``flwr stop``: the host asks the SuperLink's Control API for the run's status every
  couple of seconds while it holds a group; a finished run's task in flight gets
  rankexec's abort (ranks that ignore it are killed after ``deadlines.abort_grace``)
  and the group closes;
- the SuperNode dies: the host watches its pid and closes everything, then exits;
- the idle lease runs out (no message for ``lease`` seconds): the group closes, and
  after another lease without a group the host exits.

A site that wants the host explicit starts it beside the SuperNode (the node id is in
the SuperNode's log): ``python -m rankexec.flower.host --node-id ID --supernode-pid PID``;
the ClientApp processes then find it instead of starting one.

A rank that raises or dies fails the message (the ClientApp answers with Flower's
``Error``); the group is closed and the next message starts a new one. Messages are
served one at a time: a message for a group being torn down waits for the lock and
then gets a new group.

Caveats: the run-status check speaks to an ``--insecure`` SuperLink only (the
address comes from the SuperNode's ``--superlink`` or the site's ``superlink``); with
TLS or account auth, ``flwr stop`` is covered by the idle lease only. If the host
itself is SIGKILLed, its ranks see their parent gone and exit (rankexec's parent
watch).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rankexec.flower import _channel, _control

__all__ = ["Host", "main"]


def _log(text: str) -> None:
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} rankexec.flower.host[{os.getpid()}]: {text}\n")
    sys.stderr.flush()


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
        superlink: str | None,
        lease_s: float,
    ) -> None:
        self.dir = directory
        self.node_id = node_id
        self.supernode_pid = supernode_pid
        self.superlink = superlink
        self.lease_s = lease_s
        self.lock = threading.Lock()  # one message (or close) at a time
        self.group: Any = None
        self.group_key: Any = None
        self.run_id: int | None = None
        self.busy = False
        self.abort_reason: str | None = None
        self.last_active = time.monotonic()
        self.stopping = threading.Event()
        self.secret = b""

    # ---- the group -------------------------------------------------------------------

    def _close_group(self, why: str) -> dict[str, Any]:
        group, self.group, self.group_key = self.group, None, None
        if group is None:
            return {"pids": []}
        if not self.busy:
            # Lets the ranks leave their process groups, so they exit at once on close.
            with contextlib.suppress(Exception):
                group.fire_event("_end_run")
        report = group.close()
        _log(f"closed the group of run {self.run_id} ({why}): {report}")
        return dict(report)

    def _execute(self, req: dict[str, Any]) -> dict[str, Any]:
        from rankexec.host import Aborted, RankexecError, RankFailed, RankGroup, StartupFailed

        run_id = int(req["run_id"])
        with self.lock:
            self.last_active = time.monotonic()
            if self.stopping.is_set():
                return {"error": "the rankexec host is shutting down", "rank": None}
            if self.run_id is not None and run_id != self.run_id:
                self._close_group(f"run {run_id} started on this node")
            self.run_id = run_id
            key = (req["config_key"], run_id)
            if self.group is not None and self.group_key != key:
                self._close_group("the app's group settings changed")
            self.abort_reason = None
            try:
                if self.group is None:
                    cfg = req["config"]
                    _log(f"starting {cfg['num_of_processes']} ranks for run {run_id}")
                    self.group = RankGroup(cfg, site=f"node-{self.node_id}", job_id=str(run_id))
                    self.group_key = key
                    self.group.start()
                self.busy = True
                res = self.group.execute(
                    "flower",
                    {},
                    req["blobs"],
                    abort_check=lambda: self.abort_reason is not None,
                    poll_s=0.05,
                    abort_reason="the Flower run was stopped",
                )
                blobs = {k: v for k, v in res.blobs.items()}
                return {"ok": True, "blobs": blobs, "pids": self.group.pids()}
            except (RankFailed, StartupFailed) as e:
                rank = getattr(e, "rank", None)
                pid = getattr(e, "pid", None)
                remote = getattr(e, "remote_message", None)
                cause = getattr(e, "cause", None) or str(e)
                if remote:
                    # The rank's traceback: its last line first (the exception), then all.
                    lines = [ln for ln in str(remote).strip().splitlines() if ln.strip()]
                    cause = f"{lines[-1].strip()}\n{remote}" if lines else cause
                self._close_group(f"rank {rank} failed")
                return {"error": str(cause), "rank": rank, "pid": pid, "kind": type(e).__name__}
            except Aborted as e:
                self._close_group("aborted")
                return {"error": f"aborted: {e.reason}", "rank": None, "kind": "Aborted"}
            except RankexecError as e:
                self._close_group(type(e).__name__)
                return {"error": str(e), "rank": None, "kind": type(e).__name__}
            finally:
                self.busy = False
                self.last_active = time.monotonic()

    def _close(self, run_id: int | None) -> dict[str, Any]:
        with self.lock:
            self.last_active = time.monotonic()
            if run_id is not None and self.run_id is not None and run_id != self.run_id:
                return {"closed": False, "pids": []}
            report = self._close_group("closed by the ServerApp")
            return {"closed": True, "pids": report.get("pids", [])}

    def _status(self) -> dict[str, Any]:
        group = self.group
        return {
            "pid": os.getpid(),
            "run_id": self.run_id,
            "pids": group.pids() if group is not None else [],
            "busy": self.busy,
            "supernode_pid": self.supernode_pid,
        }

    # ---- serving ---------------------------------------------------------------------

    def _serve_conn(self, conn: socket.socket) -> None:
        with conn:
            try:
                _channel.accept_auth(conn, self.secret)
                req = _channel.recv(conn)
                op = req.get("op")
                if op == "execute":
                    out = self._execute(req)
                    blobs = out.pop("blobs", {})
                    out["blobs"] = {k: _pickle_buffer(v) for k, v in blobs.items()}
                elif op == "close":
                    out = self._close(req.get("run_id"))
                elif op == "status":
                    out = self._status()
                else:
                    out = {"error": f"unknown operation {op!r}", "rank": None}
                _channel.send(conn, out)
            except (OSError, _channel.ChannelError) as e:
                _log(f"a connection failed: {e}")
            except Exception as e:  # noqa: BLE001 - answered, logged, the host serves on
                _log(f"a request failed: {type(e).__name__}: {e}")
                with contextlib.suppress(Exception):
                    _channel.send(conn, {"error": f"rankexec host: {type(e).__name__}: {e}"})

    def _watch(self) -> None:
        next_status = 0.0
        while not self.stopping.wait(0.25):
            if self.supernode_pid is not None and not _pid_alive(self.supernode_pid):
                self.shutdown(f"the SuperNode (pid {self.supernode_pid}) is gone")
                return
            now = time.monotonic()
            if self.group is not None and self.superlink and self.run_id and now >= next_status:
                next_status = now + 2.0
                status = _control.run_status(self.superlink, self.run_id)
                if status is not None and status.startswith("finished"):
                    self._run_ended(f"run {self.run_id} is finished (flwr stop or its end)")
            if not self.busy and now - self.last_active > self.lease_s:
                if self.group is not None:
                    if self.lock.acquire(timeout=1):
                        try:
                            if not self.busy:
                                self._close_group("the idle lease ran out")
                                self.last_active = time.monotonic()
                        finally:
                            self.lock.release()
                else:
                    self.shutdown("idle, no group, the lease ran out")
                    return

    def _run_ended(self, why: str) -> None:
        if self.busy:
            _log(f"aborting the task in flight: {why}")
            self.abort_reason = why
            group = self.group
            if group is not None:
                group.abort("the Flower run was stopped")
            return  # the serving thread closes the group when the abort lands
        if self.lock.acquire(timeout=1):
            try:
                if not self.busy:
                    self._close_group(why)
            finally:
                self.lock.release()

    def shutdown(self, why: str) -> None:
        if self.stopping.is_set():
            return
        _log(f"shutting down: {why}")
        self.stopping.set()
        self.abort_reason = why
        group = self.group
        if group is not None and self.busy:
            group.abort(why)
        got = self.lock.acquire(timeout=30)
        try:
            self._close_group(why)
        finally:
            if got:
                self.lock.release()
        for name in ("host.sock", "secret", "host.pid"):
            with contextlib.suppress(OSError):
                (self.dir / name).unlink()

    def serve(self) -> int:
        self.secret = _channel.write_secret(self.dir / "secret")
        path = self.dir / "host.sock"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        os.chmod(path, 0o600)
        srv.listen(16)
        srv.settimeout(0.25)
        (self.dir / "host.pid").write_text(str(os.getpid()))
        _log(
            f"serving node {self.node_id} on {path} (SuperNode pid {self.supernode_pid},"
            f" SuperLink {self.superlink}, lease {self.lease_s}s)"
        )
        threading.Thread(target=self._watch, name="watch", daemon=True).start()
        while not self.stopping.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()
        srv.close()
        return 0


def _pickle_buffer(v: Any) -> Any:
    import pickle

    return pickle.PickleBuffer(memoryview(v))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rankexec.flower.host", description=__doc__)
    p.add_argument(
        "--dir", type=Path, default=None, help="default: the node's folder under the base"
    )
    p.add_argument("--node-id", required=True, type=int)
    p.add_argument("--supernode-pid", type=int, default=None)
    p.add_argument("--superlink", default=None, help="an insecure SuperLink's address")
    p.add_argument("--lease", type=float, default=300.0, help="idle seconds")
    a = p.parse_args(argv)
    directory = _channel.private_dir(a.dir) if a.dir else _channel.node_dir(a.node_id)
    host = Host(directory, a.node_id, a.supernode_pid, a.superlink, a.lease)

    def on_signal(signum: int, _frame: Any) -> None:
        threading.Thread(target=host.shutdown, args=(f"signal {signum}",), daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return host.serve()


if __name__ == "__main__":
    sys.exit(main())
