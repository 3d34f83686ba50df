"""One run's rank group on a node: the host's unit of work.

Why: two Flower runs may reach one SuperNode at once; each keeps its own group, its
own lock (one message of that run at a time), its own lease and its own app. A group
belongs to one (run, node) for its life: the host records the run's app at its first
request that the site allows (``app_ref``: a module and an attribute, from the
request's plain header) and writes the spec its ranks read itself, naming that app; a
request or a close of the run that names another app is refused (never imported into
the run's live ranks), and the refusal does not name the run's app. A request's spec
is plain data (``_spec``: the message and context as ``_codec`` writes them, no app,
no spec blob of the peer's). A run's end (``close_groups``, ``flwr stop``, the idle
lease) removes the run's rank logs unless the site keeps them (``log_dir``).

Caveats: the channel proves the caller's uid, not its run: a request is taken at its
word about which run it belongs to, and can only ever touch the group of the run and
app it names. Every method that touches ``group`` holds ``lock``.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rankexec.flower import _codec, _site

__all__ = ["Run", "app_ref"]


class Run:
    """A run's group on this node (see the module docs)."""

    def __init__(self, run_id: int, node_id: int, log_dir: Path, keep_logs: bool) -> None:
        self.run_id = run_id
        self.node_id = node_id
        self.log_dir = log_dir
        self.keep_logs = keep_logs
        self.lock = threading.Lock()  # held while a message or a close uses the group
        self.group: Any = None
        self.key: str | None = None
        self.app: dict[str, Any] | None = None
        self.busy = False
        self.ended = False  # closed for good; a new message makes a new Run
        self.abort_reason: str | None = None
        self.last_active = time.monotonic()

    # ---- under self.lock ---------------------------------------------------------------

    def close_group(self, why: str, log: Callable[[str], None]) -> dict[str, Any]:
        group, self.group, self.key = self.group, None, None
        if group is None:
            return {"pids": []}
        if not self.busy:
            # Lets the ranks leave their process groups, so they exit at once on close.
            with contextlib.suppress(Exception):
                group.fire_event("_end_run")
        report = group.close()
        log(f"closed the group of run {self.run_id} ({why}): {report}")
        return dict(report)

    def end(self, why: str, log: Callable[[str], None]) -> dict[str, Any]:
        """Closes the group for good and removes the run's logs (unless kept)."""
        report = self.close_group(why, log)
        self.ended = True
        if not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return report

    def execute(
        self,
        site: Mapping[str, Any],
        req: Mapping[str, Any],
        stopping: threading.Event,
        log: Callable[[str], None],
    ) -> dict[str, Any]:
        from rankexec.host import Aborted, RankexecError, RankFailed, RankGroup, StartupFailed

        self.last_active = time.monotonic()
        app = app_ref(req.get("app"))
        if app is None:
            return {"error": "the request names no app (app_dir, module, attr)", "rank": None}
        if self.app is not None and app != self.app:
            return {
                "error": f"run {self.run_id}: this run's app does not match the app the"
                " request names; refused (one app per run)",
                "rank": None,
                "kind": "SiteError",
            }
        try:
            cfg = _site.group_config(site, req.get("request") or {}, str(self.log_dir))
        except _site.SiteError as e:
            log(f"refused a request of run {self.run_id}: {e}")
            return {"error": str(e), "rank": None, "kind": "SiteError"}
        spec, why = _spec(req)
        if spec is None:
            log(f"refused a request of run {self.run_id}: {why}")
            return {"error": why, "rank": None}
        key = json.dumps(cfg, sort_keys=True)
        if self.group is not None and self.key != key:
            self.close_group("the site's settings or the app's requests changed", log)
        self.app = dict(app)
        self.abort_reason = None
        try:
            if self.group is None:
                log(f"starting {cfg['num_of_processes']} ranks for run {self.run_id}")
                self.group = RankGroup(cfg, site=f"node-{self.node_id}", job_id=str(self.run_id))
                self.key = key
                self.group.start()
            self.busy = True
            # The ranks read the spec the host writes: the run's recorded app, and the
            # message as plain data (nothing of the peer's is unpickled anywhere).
            # (The request's own map: ``consume`` lets go of what the host read.)
            blobs: dict[str, Any] = req["blobs"]
            blobs[_codec.SPEC_BLOB] = _codec.pack({"app": self.app, **spec})
            res = self.group.execute(
                "flower",
                {},
                blobs,
                abort_check=lambda: self.abort_reason is not None,
                poll_s=0.05,
                abort_reason="the Flower run was stopped",
                # The message's arrays arrived as memory files (passed on as they are);
                # anything else this host read is let go once in shared memory.
                consume=True,
            )
            blobs = {k: v for k, v in res.blobs.items()}
            retries = [_plain(dict(r)) for r in res.retries]
            if retries:
                # restart.retry_task: a rank's death from outside cost a retry, not the
                # message; the reply is the relaunched group's.
                log(f"run {self.run_id}: the task ran again after {_tries(retries)}")
            return {"ok": True, "blobs": blobs, "pids": self.group.pids(), "retries": retries}
        except (RankFailed, StartupFailed) as e:
            rank = getattr(e, "rank", None)
            pid = getattr(e, "pid", None)
            remote = getattr(e, "remote_message", None)
            cause = getattr(e, "cause", None) or str(e)
            if remote:
                # The rank's traceback: its last line first (the exception), then all.
                lines = [ln for ln in str(remote).strip().splitlines() if ln.strip()]
                cause = f"{lines[-1].strip()}\n{remote}" if lines else cause
            retries = [_plain(dict(r)) for r in getattr(e, "retries", None) or []]
            if retries:
                cause = f"{cause} (after {_tries(retries)})"
            self.close_group(f"rank {rank} failed", log)
            return {"error": str(cause), "rank": rank, "pid": pid, "kind": type(e).__name__}
        except Aborted as e:
            self.close_group("aborted", log)
            return {"error": f"aborted: {e.reason}", "rank": None, "kind": "Aborted"}
        except RankexecError as e:
            self.close_group(type(e).__name__, log)
            return {"error": str(e), "rank": None, "kind": type(e).__name__}
        finally:
            self.busy = False
            self.last_active = time.monotonic()
            if stopping.is_set() and self.group is not None:
                # The host is shutting down and could not wait for this task: the
                # group is closed here, by the thread that used it.
                self.end("the host is shutting down", log)

    # ---- without the lock --------------------------------------------------------------

    def abort(self, why: str) -> None:
        """Aborts the task in flight (the serving thread closes the group after it)."""
        self.abort_reason = why
        group = self.group
        if group is not None:
            with contextlib.suppress(Exception):
                group.abort(why)

    def status(self) -> dict[str, Any]:
        group = self.group
        return {
            "run_id": self.run_id,
            "pids": group.pids() if group is not None else [],
            "busy": self.busy,
        }


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
#: What a request's ``spec`` may hold: the message and context as ``_codec`` writes them.
_SPEC_KEYS = {"message", "context", "task_id", "arrays_to"}


def app_ref(app: Any) -> dict[str, str] | None:
    """A request's app (``app_dir``, ``module``, ``attr``: strings, a dotted module name
    and an identifier), or None when it names none or a malformed one."""
    if not isinstance(app, Mapping) or set(app) != {"app_dir", "module", "attr"}:
        return None
    ref = {k: app[k] for k in ("app_dir", "module", "attr")}
    if not all(isinstance(v, str) for v in ref.values()) or "\0" in ref["app_dir"]:
        return None
    if not _MODULE.fullmatch(ref["module"]) or not _NAME.fullmatch(ref["attr"]):
        return None
    return ref


def _spec(req: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The request's message spec, checked: plain data (the channel reads nothing else)
    with only the keys ``_codec`` writes; the app is the host's to name, and the spec
    blob the host's to write."""
    spec = req.get("spec")
    if not isinstance(spec, Mapping) or not {"message", "context"} <= set(spec):
        return None, "the request carries no message spec (message, context)"
    extra = sorted(set(spec) - _SPEC_KEYS)
    if extra:
        return None, (
            f"the request's spec holds {extra}; a spec holds only {sorted(_SPEC_KEYS)}"
            " (the host names the run's app to its ranks)"
        )
    if spec.get("arrays_to", "all") not in ("all", "rank0"):
        return None, f"the request's spec has arrays_to {spec['arrays_to']!r}, not 'all' or 'rank0'"
    blobs = req.get("blobs")
    if not isinstance(blobs, Mapping) or not all(isinstance(k, str) for k in blobs):
        return None, "the request's blobs are not a map of names to buffers"
    if _codec.SPEC_BLOB in blobs:
        return None, f"the request carries a blob named {_codec.SPEC_BLOB}; the host writes it"
    return dict(spec), ""


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    """A retry's report as JSON values (what is not one, as its text)."""
    return {
        str(k): v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
        for k, v in d.items()
    }


def _tries(retries: list[Any]) -> str:
    """``retry_task``'s tries in one line: each try's rank, pid and cause."""
    parts = [
        f"rank {r.get('rank')} (pid {r.get('pid')}): {r.get('cause')}"
        for r in retries
        if isinstance(r, Mapping)
    ]
    n = len(retries)
    return f"{n} {'try' if n == 1 else 'tries'} a rank's death ended: " + "; ".join(parts)
