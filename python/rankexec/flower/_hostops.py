"""The Flower node host's requests: one connection's handshake and request, and each
operation's answer (``execute``, ``close``, ``status``).

Why a module of its own: this is where the site's rules meet code the site did not
write (a ClientApp's, which can read the node's secret), so every check a request
passes is in one place. A request is plain data (the channel's JSON header and
buffers; nothing is unpickled). ``execute`` names its run, which gets its own group
(``_runs.Run``) up to the site's ``max_runs``, and the run checks the request's app
against the one it recorded; ``close`` names its run and its app, and a close that
names no app, or an app that is not the run's, ends nothing; a refusal never names
another run's app.

Caveats: the channel proves the caller's uid (``SO_PEERCRED``, the secret), not its
run: against a process of the host's own user this is a protocol, not a wall (see
``host``). The site's rules are read again for every ``execute`` (``Host.read_site``),
so an edit of the site file applies from the next message. A connection's handshake
slot (taken by the serving loop) is released when its handshake ends, pass or fail.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rankexec.flower import _channel, _site
from rankexec.flower._hostlog import log
from rankexec.flower._runs import Run, app_ref

if TYPE_CHECKING:
    import socket

    from rankexec.flower.host import Host

__all__ = ["close", "execute", "serve_conn", "status"]


def serve_conn(host: Host, conn: socket.socket) -> None:
    """One connection, on its own thread; it holds one of the handshake slots (taken
    by the serving loop) until its handshake ends."""
    with conn:
        try:
            try:
                _channel.accept_auth(conn, host.secret, host.handshake_s, allow=host.peers.allows)
            finally:
                host.unauthenticated.release()
            req = _channel.recv(conn, time.monotonic() + host.request_s)
            # The answer may wait for a task; sending it may not wait forever.
            conn.settimeout(host.request_s)
            op = req.get("op") if isinstance(req, dict) else None
            if op == "execute":
                out = execute(host, req)
                blobs = out.pop("blobs", {})
                out["blobs"] = {k: _pickle_buffer(v) for k, v in blobs.items()}
            elif op == "close":
                out = close(host, req)
            elif op == "status":
                out = status(host)
            else:
                out = {"error": f"unknown operation {op!r}", "rank": None}
            _channel.send(conn, out)
        except _channel.PeerRefused as e:
            log(str(e))
        except _channel.FrameRefused as e:
            log(f"a request was refused: {e}")
            with contextlib.suppress(Exception):
                conn.settimeout(host.request_s)
                _channel.send(conn, {"error": f"rankexec host: {e}", "rank": None})
        except (OSError, _channel.ChannelError) as e:
            log(f"a connection failed: {e}")
        except Exception as e:  # noqa: BLE001 - answered, logged, the host serves on
            log(f"a request failed: {type(e).__name__}: {e}")
            with contextlib.suppress(Exception):
                _channel.send(conn, {"error": f"rankexec host: {type(e).__name__}: {e}"})


def _pickle_buffer(v: Any) -> Any:
    import pickle

    # The blob itself (not a memoryview of it): the channel passes its memory file.
    return pickle.PickleBuffer(v)


def execute(host: Host, req: dict[str, Any]) -> dict[str, Any]:
    """Runs the request's message on its run's group (started for the run's first
    message, under the site's rules as they are now)."""
    try:
        run_id = int(req["run_id"])
    except (KeyError, TypeError, ValueError):
        return {"error": "the request names no run id", "rank": None}
    while True:
        with host.lock:
            host.last_active = time.monotonic()
            if host.stopping.is_set():
                return {"error": "the rankexec host is shutting down", "rank": None}
            try:
                site = host.read_site()
            except _site.SiteError as e:
                return {"error": str(e), "rank": None, "kind": "SiteError"}
            run = host.runs.get(run_id)
            if run is None:
                limit = int(site.get("max_runs", 4))
                if len(host.runs) >= limit:
                    return {
                        "error": f"run {run_id}: this node serves at most {limit} runs at"
                        f" once (rankexec-max-runs or `max_runs` in the site file) and"
                        f" runs {sorted(host.runs)} hold it; retry when one ends",
                        "rank": None,
                        "kind": "SiteError",
                    }
                keep = bool(site.get("log_dir"))
                logs = Path(site["log_dir"]) if keep else host.node.scratch_logs()
                run = Run(run_id, host.node_id, logs / f"run-{run_id}", keep)
                host.runs[run_id] = run
        with run.lock:
            if run.ended:
                continue  # closed while this message waited: a new group
            out = run.execute(site, req, host.stopping, log)
            if run.app is None or run.ended:
                # Refused before anything started, or ended by a shutdown.
                host.forget(run)
            return out


def close(host: Host, req: dict[str, Any]) -> dict[str, Any]:
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
    with host.lock:
        host.last_active = time.monotonic()
        run = host.runs.get(run_id)
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
        report = host.end_run(run, "closed by the ServerApp")
        return {"closed": True, "pids": report.get("pids", [])}


def status(host: Host) -> dict[str, Any]:
    with host.lock:
        runs = {rid: r.status() for rid, r in host.runs.items()}
    return {
        "pid": os.getpid(),
        "runs": runs,
        "run_ids": sorted(runs),
        "pids": [p for r in runs.values() for p in r["pids"]],
        "busy": any(r["busy"] for r in runs.values()),
        "supernode_pid": host.supernode_pid,
    }
