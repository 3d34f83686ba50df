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
never sees one, as under FLARE). A script that never imports ``nvflare.client`` leaves
rank 0's tasks waiting, as one that never calls ``flare.receive()`` would.

Caveat: the hook wraps the loader of the ``nvflare.client`` package for the duration of
its import only (the module's ``__loader__`` and ``__spec__.loader`` are the original
afterwards).
"""

from __future__ import annotations

import importlib.abc
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

__all__ = ["ScriptEnded", "TaskFeed", "main"]

#: FLARE 2.9's names (``nvflare.client.api_spec.CLIENT_API_TYPE_KEY`` and
#: ``nvflare.client.cell.bootstrap.BOOTSTRAP_FILE_ENV_VAR``), kept here so that the rank
#: starts without importing nvflare; a test checks them against nvflare.
CLIENT_API_TYPE_ENV = "CLIENT_API_TYPE"
BOOTSTRAP_FILE_ENV = "NVFLARE_CLIENT_API_BOOTSTRAP"
#: The module whose import installs the rank's Client API.
CLIENT_PACKAGE = "nvflare.client"


class ScriptEnded(RuntimeError):
    """The script ended while its rank still held a task it had not answered."""


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
                return
            self.ctx = task.ctx
            if self.ack_only:
                task.reply(meta={"rank_ack": True})
            else:
                self.tasks.put(task)

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

    def serve_after_script(self, code: int) -> None:
        """The script returned while the group lives on (a rank other than 0 that left
        its loop, as under torchrun): the rank stays until the group closes, answering
        tasks (rank 0's and every ``all_ranks_receive`` rank's fail: nobody serves them)."""
        if self.ended:
            return
        self.closed = True
        while (item := self.tasks.get()) is not None:
            if isinstance(item, BaseException):
                return
            item.fail(ScriptEnded(f"the script on this rank ended (exit code {code})"))


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
        feed.serve_after_script(code)
    return code
