"""The rank program of ``rankexec.flare.ScriptExecutor``, up to the script's own imports.

``python -m rankexec.flare.run_script`` starts the rank runtime and runs the user's
script at once, before anything of FLARE is imported: importing nvflare takes about
0.3 s of CPU per process (more when every rank of every site starts at once), and the
script imports ``nvflare.client`` itself anyway. The rank's Client API
(``rankexec.flare.client_api.RankClientAPI``) is built and put on FLARE's data bus the
moment the script's own ``import nvflare.client`` completes (a one-shot import hook on
``sys.meta_path``), so the rank never pays for that import twice, and ``flare.init()``,
which the script can only call after that import, always finds it. Every module
``RankClientAPI`` needs has been imported by ``nvflare.client`` by then, so the hook
imports no FLARE module of its own in the middle of the script's import.

Meanwhile ``TaskFeed`` takes the rank's tasks from the runtime on a receiver thread:
rank 0's (every rank's with ``all_ranks_receive``) wait in a queue for the script's
``flare.receive()``; any other rank's part of a task is answered at once (its script
never sees one, as under FLARE), and counted, so that the rank's ``flare.is_running()``
says True once per task and False at the run's end (the loop of FLARE's Lightning
example, whose first ``broadcast`` of it is a no-op, keeps every rank in step). A
script that never imports ``nvflare.client`` leaves rank 0's tasks waiting, as one
that never calls ``flare.receive()`` would.

No silent hang: a script that returns while the run goes on (a rank that left its
loop, while its peers wait for it in a collective) is not served on. The rank waits
``END_GRACE`` seconds for the group's close (at the run's end every rank's script
returns at about the same time), then ends with exit code 1 and an ``error.json`` that
says what it did ("rank 1's script returned while the run goes on (its last task:
`train`)"): the host reports it as the group's failure within seconds and applies its
failure policy.

A rank whose script returned after the group's close (the run's normal end) ends at
once after the script's own ``atexit`` handlers, with every file the script left open
flushed, rather than going through the interpreter's teardown: torch's native threads
(gloo, DDP) hold that teardown for seconds, which every site paid at the end of every
job (measured: 4.4 s from the script's return to the rank's exit, in a 1 GiB FedAvg job;
the Flower ranks do the same, ``rankexec.flower._rank``). Module globals' ``__del__``
methods do not run then, as under ``os._exit``; a script that fails, or exits with a
code other than 0, goes through the normal teardown.

Caveat: the hook wraps the loader of the ``nvflare.client`` package for the duration of
its import only (the module's ``__loader__`` and ``__spec__.loader`` are the original
afterwards).
"""

from __future__ import annotations

import atexit
import gc
import importlib.abc
import io
import json
import os
import queue
import runpy
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from rankexec import _rankexec
from rankexec._torchrun import export

__all__ = ["END_GRACE", "ScriptEnded", "TaskFeed", "TaskLeftUnanswered", "main"]

#: Seconds a rank whose script returned waits for the group's close before it reports
#: that the script left the run (see the module docs).
END_GRACE = 5.0

#: FLARE 2.9's names (``nvflare.client.api_spec.CLIENT_API_TYPE_KEY`` and
#: ``nvflare.client.cell.bootstrap.BOOTSTRAP_FILE_ENV_VAR``), kept here so that the rank
#: starts without importing nvflare; a test checks them against nvflare.
CLIENT_API_TYPE_ENV = "CLIENT_API_TYPE"
BOOTSTRAP_FILE_ENV = "NVFLARE_CLIENT_API_BOOTSTRAP"
#: The module whose import installs the rank's Client API.
CLIENT_PACKAGE = "nvflare.client"


class ScriptEnded(RuntimeError):
    """The script ended while its rank still held a task it had not answered, or while
    the run went on."""


class TaskLeftUnanswered(RuntimeError):
    """Rank 0 asked for the next task without sending a result for the one it held:
    nothing would ever answer it (the round would hang), so it fails, naming it."""


class TaskFeed:
    """The rank's tasks, from the runtime to the script's Client API (see the module docs)."""

    def __init__(self, ack_only: bool) -> None:
        self.ack_only = ack_only
        self.tasks: queue.Queue[Any] = queue.Queue()
        self.task: Any = None  # the unanswered task of this rank
        self.task_name: str | None = None
        self.ctx: Any = None  # the latest context (fires log events)
        self.closed = False
        self.ended = False  # the group closed (or the runtime failed)
        self.lock = threading.Lock()
        # Tasks answered at once (ack_only), counted for is_running(): one True each.
        self._arrived = threading.Condition()
        self._seen = 0
        self._taken = 0
        self._over = threading.Event()  # the runtime delivered its last item
        self.last_task: str | None = None  # the name of the latest task delivered

    def on_event(self, event: str, ctx: Any) -> None:
        """The rank's event handler: keeps a context to fire log events with."""
        del event
        self.ctx = ctx

    def serve(self, rank: _rankexec.Rank) -> None:
        """Starts the receiver thread."""
        threading.Thread(
            target=self._receive_loop, args=(rank,), name="rankexec-client-api", daemon=True
        ).start()

    def _receive_loop(self, rank: _rankexec.Rank) -> None:
        while True:
            try:
                task = rank.receive()
            except BaseException as e:  # noqa: BLE001 - handed to the script's thread
                self.tasks.put(e)
                self._finish()
                return
            if task is None:
                code = rank.exit_code
                if code:
                    # The runtime stopped for another reason than the host's Close (the
                    # host died, the link broke): the script has nobody to work for.
                    _end_now(code, f"the rank runtime stopped (exit code {code})")
                held = self.task
                if held is not None and not self.closed:
                    # The group closes while this rank's script still works on a task:
                    # the group failed or the job ended. Nothing will take the result.
                    _end_now(1, f"the rank group closed during task `{held.name}`")
                self.tasks.put(None)
                self._finish()
                return
            self.ctx = task.ctx
            self.last_task = task.name
            if self.ack_only:
                # Its part needs none of the input: the task's memory files go now, not
                # when the next task arrives (a rank that holds them keeps the whole
                # model in shared memory through the round).
                task.blobs.clear()
                task.reply(meta={"rank_ack": True})
                with self._arrived:
                    self._seen += 1
                    self._arrived.notify_all()
            else:
                self.tasks.put(task)
            del task  # held by the queue or answered: not by this thread while it waits

    def _finish(self) -> None:
        with self._arrived:
            self._over.set()
            self._arrived.notify_all()

    def next_acknowledged(self) -> bool:
        """For a rank whose tasks are answered at once: waits for the next task (True)
        or the run's end (False). Never waits past the end: the receiver thread always
        delivers one (the group's close, or the runtime's failure)."""
        with self._arrived:
            while self._seen <= self._taken and not self._over.is_set():
                self._arrived.wait()
            if self._seen > self._taken:
                self._taken += 1
                return True
            self.closed = self.ended = True
            return False

    def wait_for_close(self, grace: float) -> bool:
        """After the script returned: whether the group closes within `grace` seconds."""
        return self._over.wait(grace)

    def fail_pending(self, error: BaseException) -> bool:
        """Fails the unanswered task with `error`; returns whether there was one."""
        with self.lock:
            task, self.task = self.task, None
        if task is None:
            return False
        try:
            task.fail(error)
        except Exception:  # noqa: BLE001 - the task was answered meanwhile
            return False
        return True

    def after_script(self, group_rank: int, grace: float = END_GRACE) -> None:
        """The script returned. At the run's end that is what every rank does; while the
        run goes on nothing serves this rank's part any more and its peers may wait for
        it in a collective: after `grace` seconds without the group's close, the rank
        ends with an error that says so (see the module docs)."""
        if self.ended or self.wait_for_close(grace):
            return
        last = self.last_task
        what = f"its last task: `{last}`" if last is not None else "before any task"
        error = ScriptEnded(f"rank {group_rank}'s script returned while the run goes on ({what})")
        self.fail_pending(error)
        _error_file(error)
        _end_now(1, str(error))


class _Then(importlib.abc.Loader):
    """A loader that runs `then` after the real loader executed the module."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._then()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then` once, when the module `name` has been imported."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self._name = name
        self._then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)  # one shot: the other finders find the real spec
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Then(spec.loader, self._then)
                return spec
        return None


def after_import(name: str, then: Callable[[], None]) -> None:
    """Runs `then` when the module `name` has been imported (now, if it is)."""
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def _error_file(exc: BaseException) -> None:
    """Writes `exc` where torchrun's `record` would (the host quotes its message)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = f"{type(exc).__name__}: {exc}"
    stack = "".join(traceback.format_exception(exc))
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": stack}}}, f)
    except OSError:
        pass  # the stderr tail still says it


def _end_now(code: int, message: str) -> None:
    """Ends this process at once (no interpreter teardown), saying why on stderr if
    stderr still works (its reader may be the dead parent)."""
    try:
        sys.stderr.write(f"rankexec: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


def _flush_open_files() -> None:
    """Flushes every open file object of the process (what the interpreter's teardown
    would have done for the files the script left open)."""
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):
                pass  # a pipe whose reader is gone, a file closed meanwhile


class _QuickEnd:
    """The ``atexit`` handler that ends the rank at once after a normal end (see the
    module docs); registered before the script runs, so it runs after the script's own
    handlers."""

    def __init__(self) -> None:
        self.code: int | None = None

    def __call__(self) -> None:
        if self.code is None:
            return
        _flush_open_files()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os._exit(self.code)


def _parse(argv: list[str]) -> tuple[str, dict[str, Any], str, list[str]]:
    """``--cwd DIR --config JSON SCRIPT [ARGS...]``."""
    cwd, config = "", {}
    i = 0
    while i < len(argv) and argv[i] in ("--cwd", "--config"):
        if i + 1 >= len(argv):
            raise SystemExit(f"rankexec.flare.run_script: {argv[i]} needs a value")
        if argv[i] == "--cwd":
            cwd = argv[i + 1]
        else:
            config = json.loads(argv[i + 1])
        i += 2
    if i >= len(argv):
        raise SystemExit("usage: python -m rankexec.flare.run_script [--cwd DIR] SCRIPT [ARGS]")
    return cwd, config, argv[i], argv[i + 1 :]


def main(argv: list[str] | None = None) -> int:
    """Serves this process as a rank running a Client API script (see the module docs)."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("--check-components", "--list-components"):
        print(json.dumps({"ok": True, "errors": []}) if args[0] == "--check-components" else "[]")
        return 0
    cwd, config, script, script_args = _parse(args)
    export()  # torchrun's RANK, LOCAL_RANK, ... under mpirun and srun too
    group_rank = int(os.environ.get("RANK", "0"))
    feed = TaskFeed(ack_only=group_rank != 0 and not config.get("all_ranks_receive", False))
    rank = _rankexec.start("script", feed.on_event)
    feed.serve(rank)
    if cwd:
        os.chdir(cwd)
    # FLARE's APIContext: no bootstrap, the in-process type, our API on the data bus
    # (put there once the script has imported nvflare.client).
    os.environ.pop(BOOTSTRAP_FILE_ENV, None)
    os.environ[CLIENT_API_TYPE_ENV] = "IN_PROCESS_API"

    def install() -> None:
        from rankexec.flare.client_api import install as install_api

        install_api(config, feed)

    after_import(CLIENT_PACKAGE, install)
    quick = _QuickEnd()
    atexit.register(quick)
    path = os.path.abspath(script)
    sys.argv = [script, *script_args]
    sys.path[0] = os.path.dirname(path)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0:
            feed.fail_pending(ScriptEnded(f"the script exited with code {e.code}"))
    except BaseException as e:  # noqa: BLE001 - reported to the host, then the rank ends
        if e.__traceback__ is not None:
            e.__traceback__ = e.__traceback__.tb_next  # start at the script's frame
        # Not reported through the task: when one rank's exception makes the others
        # fail in a collective, the first process to end is the root cause.
        _error_file(e)
        traceback.print_exception(e, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # No interpreter teardown (torch's can take seconds): the host learns of the
        # failure when this process is gone, and the rank is over anyway.
        os._exit(1)
    if feed.fail_pending(
        ScriptEnded(f"the script ended without answering task `{feed.task_name}`")
    ):
        code = code or 1
    if code == 0:
        feed.after_script(group_rank)
        if feed.ended or feed.wait_for_close(0):
            quick.code = 0  # the run is over: no interpreter teardown (module docs)
    return code
