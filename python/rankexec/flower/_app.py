"""``rankexec.flower.ClientApp``: Flower's ClientApp whose handlers run on the node's
rank group.

Why: Flower runs each message in a new ``flwr-clientapp`` process; this class's
``__call__`` turns the message into a request to the node's host
(``rankexec.flower.host``, found or started by ``_start``), which keeps the run's
group across messages, and turns the host's answer back into Flower's reply (rank 0's
``Message`` and ``context.state``) or Flower's ``Error``. ``CLOSE_MESSAGE_TYPE``
messages (``close_groups``) close the run's group instead.

Caveats: the app must be one module-level name of an importable module (the ranks
import it); its settings are requests the host matches against the site's rules.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp as FlowerClientApp

from rankexec._staging import stage_in_parts
from rankexec.flower import _channel, _codec, _peer, _start
from rankexec.flower._channel import ChannelError
from rankexec.flower._server import CLOSE_MESSAGE_TYPE

__all__ = ["ClientApp"]

# Flower's ErrorCode.CLIENT_APP_RAISED_EXCEPTION (flwr.common.constant).
_RAISED = 2


class ClientApp(FlowerClientApp):
    """Flower's ``ClientApp`` whose handlers run on the node's rank group (see the
    module docs). ``num_of_processes`` ranks; ``launcher``, ``gpu``, ``resources``,
    ``deadlines`` and ``restart`` are rankexec's ``MultiProcessExecutor`` settings, sent
    to the node's host as requests: the host matches them against the site's rules and
    refuses what the site does not allow (the reply is Flower's ``Error`` naming the
    rule)."""

    def __init__(
        self,
        client_fn: Any = None,
        mods: Any = None,
        *,
        num_of_processes: int = 1,
        launcher: Any = None,
        gpu: Mapping[str, Any] | None = None,
        resources: Mapping[str, Any] | None = None,
        deadlines: Mapping[str, Any] | None = None,
        restart: Mapping[str, Any] | None = None,
        arrays_to: str = "all",
    ) -> None:
        """A Flower ClientApp whose handlers run on the node's rank group.

        Args:
            client_fn, mods: Flower's own (`flwr.clientapp.ClientApp`).
            num_of_processes: ranks in the node's group; the site's `max_processes`
                bounds it.
            launcher: a rankexec `launcher` the app asks for; the node's site allows it
                or refuses the message (default: the site's launcher, else the built-in
                one).
            gpu: rankexec's `gpu` settings the app asks for; the site's keys win and
                only the site names devices.
            resources, deadlines, restart: rankexec's `resources`, `deadlines` and
                `restart`, the app's own bounds (passed as they are).
            arrays_to: who receives the message's arrays: `"all"` (default: every
                rank, read-only views of one shared copy) or `"rank0"` (rank 0 alone,
                as its own writable copy, taken part by part while the input is let
                go: `ndarrays(record, writable=True)` updates it in place and
                `shared_array_record` of those arrays sends it back without a copy;
                the other ranks see the message's `ArrayRecord`s empty).
        """
        if arrays_to not in ("all", "rank0"):
            raise ValueError(f"arrays_to is 'all' or 'rank0', not {arrays_to!r}")
        super().__init__(client_fn=client_fn, mods=mods)
        self._arrays_to = arrays_to
        caller = sys._getframe(1).f_globals
        self._module: str = caller.get("__name__", "__main__")
        self._file: str | None = caller.get("__file__")
        self._settings: dict[str, Any] = {
            "num_of_processes": int(num_of_processes),
            "launcher": launcher,
            "gpu": dict(gpu) if gpu else None,
            "resources": dict(resources) if resources else None,
            "deadlines": dict(deadlines) if deadlines else None,
            "restart": dict(restart) if restart else None,
        }

    def _ref(self) -> dict[str, str]:
        """Where the ranks find this app: the folder to put on ``sys.path``, the module
        and the attribute (found by identity, else the module's one ``ClientApp`` of
        this class: the Simulation Engine hands actors a copy of the app)."""
        module = sys.modules.get(self._module)
        names = [k for k, v in vars(module).items() if v is self] if module is not None else []
        if module is not None and not names:
            names = [k for k, v in vars(module).items() if isinstance(v, ClientApp)]
        file = self._file or (getattr(module, "__file__", None) if module is not None else None)
        if len(names) != 1 or not file:
            raise RuntimeError(
                "rankexec.flower.ClientApp must be one module-level name of an importable"
                f" module (found in {self._module!r}: {names or 'no name'})"
            )
        root = Path(str(file)).resolve().parent
        depth = self._module.count(".") + (1 if Path(str(file)).name == "__init__.py" else 0)
        for _ in range(depth):
            root = root.parent
        return {"app_dir": str(root), "module": self._module, "attr": names[0]}

    def __call__(self, message: Message, context: Context) -> Message:
        """Forwards the message to the node's rank group; returns rank 0's reply."""
        if message.metadata.message_type == CLOSE_MESSAGE_TYPE:
            return self._close(message, context)
        return self._forward(message, context)

    def _request(self) -> dict[str, Any]:
        """The app's settings as requests to the host (the site decides)."""
        return {k: v for k, v in self._settings.items() if v is not None}

    def _forward(self, message: Message, context: Context) -> Message:
        from flwr.supercore.task_identity import TaskIdentity

        ref = self._ref()
        blobs: dict[str, Any] = {}
        # Plain data only (JSON values, the arrays as buffers): the host checks the app
        # against the run's and writes the spec its ranks read (the app is its to name).
        spec = {
            "message": _codec.encode_message(message, blobs),
            "context": _codec.encode_context(context, blobs),
            "task_id": getattr(TaskIdentity, "_task_id", None),
        }
        if self._arrays_to != "all":
            spec["arrays_to"] = self._arrays_to
        _share_and_release(blobs, message, context)
        req = {
            "op": "execute",
            "run_id": context.run_id,
            "app": ref,
            "request": self._request(),
            "spec": spec,
            "blobs": {k: pickle.PickleBuffer(v) for k, v in blobs.items()},
        }
        blobs.clear()  # the request holds them until it is sent, then lets go of them
        try:
            directory = _peer.client_dir(context.node_id)
            out = _start.request(directory, req, context.node_id)
        except ChannelError as e:
            return Message(Error(code=_RAISED, reason=f"rankexec: {e}"), reply_to=message)
        if "error" in out:
            who = "rankexec"
            if out.get("rank") is not None:
                who = f"rank {out['rank']}" + (f" (pid {out['pid']})" if out.get("pid") else "")
            elif out.get("kind") == "SiteError":
                who = "rankexec: refused by the node's site"
            return Message(Error(code=_RAISED, reason=f"{who}: {out['error']}"), reply_to=message)
        if out.get("retries"):
            _warn_retries(context.run_id, out["retries"])
        # Rank 0's arrays stay where they are (its memory file, mapped here): Flower
        # reads them in place when it sends the reply.
        got = dict(out["blobs"])
        back = _codec.unpack(got[_codec.SPEC_BLOB])
        # Flower serializes the state into protobuf bytes: its arrays leave the mapping.
        context.state = _codec.own_arrays(_codec.decode_records(back["state"], got))
        return _codec.decode_message(back["reply"], got)

    def _close(self, message: Message, context: Context) -> Message:
        pids: list[int] = []
        try:
            directory = _peer.client_dir(context.node_id)
            sock = _channel.connect(directory, timeout=5, host_uid=_peer.host_uid())
        except ChannelError:
            closed = False
        else:
            req = {"op": "close", "run_id": context.run_id, "app": self._ref()}
            try:
                with sock:
                    _channel.send(sock, req)
                    out = _channel.recv(sock)
            except (OSError, ChannelError) as e:
                out = {"error": f"the host did not answer: {e}"}
            if "error" in out:
                reason = f"rankexec: closing the group failed: {out['error']}"
                return Message(Error(code=_RAISED, reason=reason), reply_to=message)
            closed, pids = bool(out.get("closed")), list(out.get("pids") or [])
        rec = MetricRecord({"closed": int(closed), "ranks": len(pids)})
        return Message(RecordDict({"rankexec": rec}), reply_to=message)


def _warn_retries(run_id: int, retries: list[Any]) -> None:
    """Flower's log (the SuperNode's): the message was answered after ``retry_task``
    relaunched the group, naming each try a rank's death ended."""
    from logging import WARNING

    from flwr.supercore import log

    for r in retries:
        if isinstance(r, Mapping):
            log(
                WARNING,
                "rankexec: run %s: try %s ended by rank %s (pid %s): %s; ran again (retry_task)",
                run_id,
                r.get("attempt"),
                r.get("rank"),
                r.get("pid"),
                r.get("cause"),
            )


def _share_and_release(blobs: dict[str, Any], message: Message, context: Context) -> None:
    """Copies the message's large arrays into memory files (parts of at least 64 MiB,
    up to four written at once; the channel passes them to the node's host and the host
    to every rank, as they are), letting go of Flower's own copy of each array as soon
    as it is copied (``_staging.stage_in_parts``): the ClientApp never
    holds the model twice, and holds it once, in shared memory, while the ranks run.
    (The reply and the context's state are rebuilt from rank 0's answer.)"""
    held = [context.state] if message.has_error() else [message.content, context.state]
    stage_in_parts(blobs, _channel.SHARE_FROM, _codec.releaser(held))
    for records in held:
        for rec in records.values():
            if isinstance(rec, ArrayRecord):
                rec.clear()
