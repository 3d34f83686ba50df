"""The rank side of ``rankexec.flower``: a component that runs the Flower handlers.

Why: every rank of the group runs ``python -m rankexec.worker`` with this component;
it imports the app the host recorded for the run (the host, not the peer, writes the
spec the ranks read: plain JSON) once, at the run's first message, from the installed
FAB's folder like ``flwr-clientapp`` does, and refuses a spec that names another; sets
Flower's task identity, rebuilds the ``Message`` and ``Context`` (arrays as read-only
views of the shared memory the host filled) and calls the app's handler through
Flower's own routing (``flwr.clientapp.ClientApp.__call__``: message type, action,
mods, lifespan). Rank 0's reply and its ``context.state`` go back; the other ranks'
replies are dropped.

Caveats: module-level state of the app (a model, a loaded dataset, a process group)
survives from message to message, which is the point; a handler that calls
``torch.distributed.init_process_group()`` must guard it with ``is_initialized()``.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
from typing import Any

import rankexec
from rankexec._rankexec import trim_heap
from rankexec._staging import stage_in_parts
from rankexec.flower import _arrays, _channel, _codec, _state

__all__ = ["FlowerRank"]

_closing = False


def _exit_after_close() -> None:
    # torch's DDP keeps native threads that hang the interpreter's teardown (measured:
    # 5 s until the host's SIGTERM, even after destroy_process_group()). After a normal
    # close the rank has nothing left to do: end the process here, after atexit's
    # earlier handlers, before module teardown.
    if _closing:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class FlowerRank:
    """A rankexec component that serves Flower messages (see the module docs)."""

    def __init__(self) -> None:
        self._ref: tuple[str, str, str] | None = None
        self._app_obj: Any = None
        atexit.register(_exit_after_close)

    def _app(self, ref: Any) -> Any:
        """The app the host named for this rank's run: imported at the first message, the
        same for the rank's life; a spec that names another is refused (nothing of it is
        imported)."""
        if not isinstance(ref, dict) or set(ref) != {"app_dir", "module", "attr"}:
            raise RuntimeError("the message's spec names no app (app_dir, module, attr)")
        key = (ref["app_dir"], ref["module"], ref["attr"])
        if not all(isinstance(x, str) for x in key):
            raise RuntimeError("the message's spec names a malformed app")
        if self._ref is not None:
            if key != self._ref:
                raise RuntimeError(
                    "the app this message names does not match the app this rank serves"
                    " (one app per run); refused, nothing imported"
                )
            return self._app_obj
        if ref["app_dir"] and ref["app_dir"] not in sys.path:
            sys.path.insert(0, ref["app_dir"])
        module = importlib.import_module(ref["module"])
        self._app_obj = getattr(module, ref["attr"])
        self._ref = key
        return self._app_obj

    def handle_event(self, event: str, ctx: Any) -> None:
        """``_end_run`` (the host closes the group): leave torch's process group, if the
        app made one, so that the rank exits at once."""
        global _closing
        del ctx
        if event != "_end_run":
            return
        _closing = True
        if "torch.distributed" in sys.modules:
            dist = sys.modules["torch.distributed"]
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()

    def execute(self, task: str, input: Any, ctx: Any, abort: Any) -> rankexec.Shareable:
        del task
        from flwr.clientapp import ClientApp as FlowerClientApp
        from flwr.supercore.task_identity import TaskIdentity

        spec = _codec.unpack(input.blobs[_codec.SPEC_BLOB])
        app = self._app(spec["app"])
        try:
            if spec.get("arrays_to", "all") == "rank0":
                _take_arrays(spec, input.blobs, ctx.rank)
            message = _codec.decode_message(spec["message"], input.blobs)
            context = _codec.decode_context(spec["context"], input.blobs)
        except BaseException:
            _arrays.release_owned()  # rank 0's copies, if it made them, go with the input
            raise
        TaskIdentity.run_id = message.metadata.run_id
        TaskIdentity.node_id = context.node_id
        TaskIdentity.task_id = spec.get("task_id") or 0
        _state.current_abort = abort
        try:
            reply = FlowerClientApp.__call__(app, message, context)
        except Exception as e:
            if abort.triggered:
                # Stopped because the group was aborted (a peer failed, the run was
                # stopped): not a cause of its own, so the first failure stays the one
                # the reply names.
                raise rankexec.TaskAborted(abort.reason or "aborted") from e
            raise
        finally:
            _state.current_abort = None
            _arrays.release_owned()
            # What the handler freed (Flower's parsed copies, a model it let go of) leaves
            # the process now: tensors of 1-32 MiB sit in glibc's heap, resident, until
            # it is trimmed, and nothing else in this process would trim it.
            trim_heap()
        if ctx.rank != 0:
            return rankexec.Shareable(meta={"rank": ctx.rank})
        blobs: dict[str, Any] = {}
        out = {
            "reply": _codec.encode_message(reply, blobs, "r"),
            "state": _codec.encode_records(context.state, "q", blobs),
        }
        blobs[_codec.SPEC_BLOB] = _codec.pack(out)
        # The reply's arrays go into memory files (in parts, up to four at once), each
        # let go of once copied (the handler's reply holds the only other reference):
        # rank 0 never holds Flower's serialized reply and the files in full at once.
        # The input's memory files are not needed any more (the handler has returned):
        # let go of here, before the reply's files are filled (a large mapping is
        # unmapped on the extension's `unmap` thread, moments later).
        del message, context
        input.blobs.clear()
        if not reply.has_error():
            stage_in_parts(blobs, _channel.SHARE_FROM, _codec.releaser([reply.content]))
        return rankexec.Shareable(meta={"rank": 0}, blobs=blobs)


def _take_arrays(spec: dict[str, Any], blobs: dict[str, Any], rank: int) -> None:
    """``ClientApp(arrays_to="rank0")``: rank 0 takes the message's arrays as its own
    writable copy (``_arrays.take_owned``), one copy for each array (arrays of equal
    content travel as one blob; written in place they must not change together, nor
    change an array of the context's state); every other rank lets go of them at once
    and sees the message's ``ArrayRecord``s empty. The context's state, which every
    rank reads, stays as it is."""
    kept = set(_codec.array_blobs({"content": spec["context"]["state"]}))
    if rank == 0:
        _arrays.take_owned(blobs, _codec.split_shared(spec["message"], blobs, kept))
        return
    names = _codec.array_blobs(spec["message"])
    spec["message"] = _codec.without_arrays(spec["message"])
    for name in names:
        if name not in kept:
            blobs.pop(name, None)
