"""rankexec in Flower: a ClientApp whose handlers run on a rank group that lives
across rounds.

Switch an app with one import and one argument::

    from rankexec.flower import ClientApp        # was: from flwr.clientapp import ClientApp
    app = ClientApp(num_of_processes=2)          # plus rankexec's deadlines, resources, ...

    @app.train()
    def train(msg: Message, context: Context) -> Message: ...   # runs on every rank

Every rank of the node's group runs the handler with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), so
``torch.distributed.init_process_group()`` works (guard it with ``is_initialized()``:
the ranks, and the app module's globals, live from one message to the next). Every rank
receives the message; rank 0's returned ``Message`` is the reply and its
``context.state`` is kept. ``ArrayRecord`` payloads arrive as read-only views of one
copy in shared memory (``ndarrays(record)`` reads them without a copy).

How: Flower runs each message in a new ``flwr-clientapp`` process. This class's
``__call__`` forwards the message to the node's rankexec host
(``rankexec.flower.host``, started by the first message, kept alive across messages),
which keeps the run's group; see that module for when the group ends. At the end of
the ServerApp's ``main``, call ``close_groups(grid)`` so every node closes its group.

Failures: a rank that raises or dies answers the message with Flower's ``Error``
(``ErrorCode.CLIENT_APP_RAISED_EXCEPTION``) naming the rank and the cause; the next
message starts a new group.

What the node runs (the ranks' interpreter, launcher, GPUs, environment) is the
site's decision, from ``--node-config`` and a site file (``rankexec.flower._site``).

Caveats: tested with flwr 1.42 (``TESTED_FLOWER``) under the Deployment Engine; Linux
only. Custom ``mods`` run on the ranks, around the handler.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp as FlowerClientApp

from rankexec.flower import _channel, _codec, _site, _state
from rankexec.flower._channel import ChannelError
from rankexec.flower._site import SiteError

__all__ = [
    "CLOSE_MESSAGE_TYPE",
    "TESTED_FLOWER",
    "ChannelError",
    "ClientApp",
    "SiteError",
    "abort_requested",
    "close_groups",
    "host_status",
    "ndarrays",
]

TESTED_FLOWER = "1.42.0"
CLOSE_MESSAGE_TYPE = "query.rankexec_close"
# Flower's ErrorCode.CLIENT_APP_RAISED_EXCEPTION (flwr.common.constant).
_RAISED = 2
_HOST_START_S = 60.0


def abort_requested() -> bool:
    """On a rank, inside a handler: whether rankexec aborted the message (``flwr stop``,
    the SuperNode's end). Check it between steps of a long handler to stop at once;
    a rank that never checks is killed after ``deadlines.abort_grace``."""
    abort = _state.current_abort
    return bool(abort) if abort is not None else False


def ndarrays(record: ArrayRecord) -> list[np.ndarray]:
    """The record's arrays as read-only NumPy views of their bytes (shared memory on a
    rank), without the copy ``to_numpy_ndarrays()`` makes."""
    out = []
    for arr in record.values():
        view = memoryview(arr.data).cast("B")
        if arr.stype != "numpy.ndarray" or bytes(view[:6]) != b"\x93NUMPY":
            out.append(arr.numpy())
            continue
        major = view[6]
        if major == 1:
            hlen, start = int.from_bytes(view[8:10], "little"), 10
        else:
            hlen, start = int.from_bytes(view[8:12], "little"), 12
        header = ast.literal_eval(bytes(view[start : start + hlen]).decode("latin1"))
        dtype = np.dtype(header["descr"])
        shape = tuple(header["shape"])
        count = int(np.prod(shape)) if shape else 1
        a = np.frombuffer(view, dtype=dtype, count=count, offset=start + hlen)
        a = a.reshape(shape, order="F" if header["fortran_order"] else "C")
        a.flags.writeable = False
        out.append(a)
    return out


def _ancestors() -> Iterable[tuple[int, list[str]]]:
    pid = os.getppid()
    for _ in range(16):
        if pid <= 1:
            return
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        yield pid, [a.decode(errors="replace") for a in argv if a]
        ppid = [ln for ln in status.splitlines() if ln.startswith("PPid:")]
        pid = int(ppid[0].split()[1]) if ppid else 0


def _supernode() -> tuple[int | None, str | None]:
    """The SuperNode this ClientApp process runs under, and its insecure SuperLink."""
    for pid, argv in _ancestors():
        if any(os.path.basename(a) == "flower-supernode" for a in argv[:2]):
            link = None
            if "--insecure" in argv:
                for i, a in enumerate(argv):
                    if a == "--superlink" and i + 1 < len(argv):
                        link = argv[i + 1]
                    elif a.startswith("--superlink="):
                        link = a.split("=", 1)[1]
            return pid, link
    return None, None


def _connect_or_start(directory: Path, node_id: int, site: Mapping[str, Any]) -> Any:
    with contextlib.suppress(ChannelError):
        return _channel.connect(directory)
    with open(directory / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(ChannelError):
            return _channel.connect(directory)
        supernode, link = _supernode()
        if supernode is None and "ray" in sys.modules:
            # The Simulation Engine: this Ray actor serves messages for the whole run;
            # the host leaves with it.
            supernode = os.getpid()
        link = site.get("superlink") or link
        argv = [
            sys.executable,
            "-m",
            "rankexec.flower.host",
            "--dir",
            str(directory),
            "--node-id",
            str(node_id),
            "--lease",
            str(float(site.get("lease_s", 300.0))),
        ]
        if supernode is not None:
            argv += ["--supernode-pid", str(supernode)]
        if link:
            argv += ["--superlink", str(link)]
        with contextlib.suppress(FileNotFoundError):
            (directory / "host.sock").unlink()
        with open(directory / "host.log", "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        deadline = time.monotonic() + _HOST_START_S
        while True:
            if (directory / "host.sock").exists():
                with contextlib.suppress(ChannelError):
                    return _channel.connect(directory)
            code = proc.poll()
            if code is not None:
                raise ChannelError(
                    f"the rankexec host exited with code {code} (see {directory / 'host.log'})"
                )
            if time.monotonic() > deadline:
                proc.kill()
                raise ChannelError(f"the rankexec host did not listen within {_HOST_START_S}s")
            time.sleep(0.05)


def _request(directory: Path, req: dict[str, Any], node_id: int, site: Any) -> Any:
    sock = _connect_or_start(directory, node_id, site)
    with sock:
        _channel.send(sock, req)
        return _channel.recv(sock)


def host_status(node_id: int) -> dict[str, Any] | None:
    """The node's host: ``{"pid", "run_id", "pids", "busy", "supernode_pid"}``, or None
    when none runs."""
    try:
        sock = _channel.connect(_channel.node_dir(node_id), timeout=5)
    except ChannelError:
        return None
    with sock:
        _channel.send(sock, {"op": "status"})
        out: dict[str, Any] = _channel.recv(sock)
        return out


class ClientApp(FlowerClientApp):
    """Flower's ``ClientApp`` whose handlers run on the node's rank group (see the
    module docs). ``num_of_processes`` ranks; ``launcher``, ``gpu``, ``resources``,
    ``deadlines`` and ``restart`` are rankexec's ``MultiProcessExecutor`` settings (the
    site bounds the launcher and GPUs)."""

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
    ) -> None:
        super().__init__(client_fn=client_fn, mods=mods)
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
        t_call = time.time()
        reply = self._forward(message, context)
        timings = os.environ.get("RANKEXEC_FLOWER_TIMINGS")
        if timings:  # an opt-in diagnostic (benchmarks/flower/bench.py reads it)
            with open(timings, "a") as f:
                rec = {
                    "run_id": context.run_id,
                    "node_id": context.node_id,
                    "message_type": message.metadata.message_type,
                    "created_at": message.metadata.created_at,
                    "call": t_call,
                    "reply": time.time(),
                }
                f.write(json.dumps(rec) + "\n")
        return reply

    def _forward(self, message: Message, context: Context) -> Message:
        from flwr.supercore.task_identity import TaskIdentity

        try:
            site = _site.load(context.node_config)
            directory = _channel.node_dir(context.node_id)
            cfg = _site.group_config(site, self._settings, str(directory / f"run-{context.run_id}"))
        except (SiteError, ChannelError) as e:
            return Message(Error(code=_RAISED, reason=f"rankexec: {e}"), reply_to=message)
        ref = self._ref()
        blobs: dict[str, Any] = {}
        spec = {
            "app": ref,
            "message": _codec.encode_message(message, blobs),
            "context": _codec.encode_context(context, blobs),
            "task_id": getattr(TaskIdentity, "_task_id", None),
        }
        blobs[_codec.SPEC_BLOB] = _codec.pack(spec)
        req = {
            "op": "execute",
            "run_id": context.run_id,
            "config": cfg,
            "config_key": json.dumps([cfg, ref], sort_keys=True),
            "blobs": {k: pickle.PickleBuffer(v) for k, v in blobs.items()},
        }
        out = _request(directory, req, context.node_id, site)
        if "error" in out:
            who = "rankexec"
            if out.get("rank") is not None:
                who = f"rank {out['rank']}" + (f" (pid {out['pid']})" if out.get("pid") else "")
            return Message(Error(code=_RAISED, reason=f"{who}: {out['error']}"), reply_to=message)
        got = {k: bytes(v) for k, v in out["blobs"].items()}
        back = _codec.unpack(got[_codec.SPEC_BLOB])
        context.state = _codec.decode_records(back["state"], got)
        return _codec.decode_message(back["reply"], got)

    def _close(self, message: Message, context: Context) -> Message:
        directory = _channel.node_dir(context.node_id)
        pids: list[int] = []
        try:
            sock = _channel.connect(directory, timeout=5)
        except ChannelError:
            closed = False
        else:
            with sock:
                _channel.send(sock, {"op": "close", "run_id": context.run_id})
                out = _channel.recv(sock)
            if "error" in out:
                reason = f"rankexec: closing the group failed: {out['error']}"
                return Message(Error(code=_RAISED, reason=reason), reply_to=message)
            closed, pids = bool(out.get("closed")), list(out.get("pids") or [])
        rec = MetricRecord({"closed": int(closed), "ranks": len(pids)})
        return Message(RecordDict({"rankexec": rec}), reply_to=message)


def close_groups(grid: Any, timeout: float = 120.0) -> dict[int, bool]:
    """From the ServerApp, at the end of ``main``: every node closes this run's rank
    group. Returns node id to whether it answered without an error."""
    nodes = list(grid.get_node_ids())
    messages = [
        Message(RecordDict(), dst_node_id=n, message_type=CLOSE_MESSAGE_TYPE) for n in nodes
    ]
    replies = grid.send_and_receive(messages, timeout=timeout)
    return {r.metadata.src_node_id: not r.has_error() for r in replies}
