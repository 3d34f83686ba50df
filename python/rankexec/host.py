"""The host side: a rank group driven from Python.

``RankGroup`` wraps rankexec's ``MultiProcessExecutor``: it launches ``num_of_processes``
rank processes, keeps them alive across tasks, fans each task out to every rank and
returns rank 0's result (or the combined one), relays events both ways, and tears
everything down on ``close()``. It is configured with a dict holding the same keys as
the ``args`` of a ``MultiProcessExecutor`` in a rankexec job (``executor_id``,
``num_of_processes``, ``components``, ``worker``, ``deadlines``, ``result``, ``gpu``,
``resources``, ``launcher``, ...).

Blocking calls release the GIL and wake for Ctrl-C: the first Ctrl-C during
``execute`` aborts the task in every rank and raises ``KeyboardInterrupt`` once the
ranks have stopped; a second raises at once.

Failures are typed: ``RankFailed`` (rank, pid, cause, stderr tail), ``Aborted``,
``TimedOut``, ``StartupFailed``, ``EventFailed``, ``ConfigError``; all derive from
``RankexecError``.

With ``restart: {"retry_task": N}``, a task whose rank died from outside (a signal, the
OOM killer, a lost node; never an exception of the rank's code) runs again on a
relaunched group, up to N times within its deadline: ``TaskResult.retries`` lists the
tries a death ended, and an error after retries has them as its ``retries`` attribute
(``[]`` on errors without retries). Caveat: each retry restarts the ranks, so whatever
they kept in memory from earlier tasks is gone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Self

from rankexec import _rankexec
from rankexec._paths import resolve_worker
from rankexec._shareable import byte_view

__all__ = [
    "Aborted",
    "ConfigError",
    "EventFailed",
    "HostBlob",
    "RankFailed",
    "RankGroup",
    "RankexecError",
    "StartupFailed",
    "TaskResult",
    "TimedOut",
    "ValueBoundsError",
]

HostBlob = _rankexec.HostBlob
# A value that cannot be sent (it contains itself, or nests deeper than 64).
ValueBoundsError = _rankexec.ValueBoundsError


class RankexecError(_rankexec.RankexecError):
    """Base class of the host side's errors (a ``rankexec.RankexecError``); ``str()`` is
    the whole error chain."""

    retries: list[dict[str, Any]]

    def __init__(self, message: str, **attrs: Any) -> None:
        super().__init__(message)
        self.message = message
        # The tries of a task that a rank's death ended (restart.retry_task): dicts
        # with attempt, rank, pid, cause and error_class. Set after construction.
        self.retries = []
        for k, v in attrs.items():
            setattr(self, k, v)


class ConfigError(RankexecError):
    """The configuration is invalid (the message names the field)."""


class RankFailed(RankexecError):
    """A rank failed: it crashed, exited, raised, stopped answering or broke the protocol.

    Attributes: ``rank``, ``pid`` (or None), ``cause`` (one line), ``error_class``
    (``exception``, ``panic``, ``exit_code``, ``signal``, ``out_of_memory``, ``timeout``,
    ``protocol``), ``stderr_tail`` (last lines of the rank's stderr), ``remote_message``
    (what the rank's code reported, if it did), ``others`` (later failures, as reports)
    and ``report`` (a multi-line text for logs).
    """

    rank: int
    pid: int | None
    cause: str
    error_class: str
    stderr_tail: list[str]
    remote_message: str | None
    others: list[str]
    report: str


class StartupFailed(RankexecError):
    """The group could not start. ``rank``, ``pid``, ``cause``, ``remote_message`` are
    set when one rank is to blame; ``error_class`` says how it failed."""

    rank: int | None
    pid: int | None
    cause: str | None
    error_class: str | None
    stderr_tail: list[str]
    remote_message: str | None


class Aborted(RankexecError):
    """The task was aborted (``reason``); ``forced`` when the ranks did not stop within
    the abort grace and the group was killed (the next task relaunches it)."""

    task: str | None
    reason: str
    forced: bool


class TimedOut(RankexecError):
    """A deadline passed (``what``, ``timeout_s``); ``pending`` lists the ranks that had
    not answered. The group was torn down."""

    what: str
    timeout_s: float
    pending: list[int]


class EventFailed(RankexecError):
    """A rank's handler failed on ``event`` (``rank``)."""

    event: str
    rank: int | None


class TaskResult:
    """What ``RankGroup.execute`` returns: ``meta`` (dict), ``blobs`` (name to
    ``HostBlob``, a read-only buffer: ``numpy.frombuffer(blob, dtype)`` reads it in
    place), ``props`` (rank 0's context properties) and ``retries`` (the tries a rank's
    death from outside ended before this result, as dicts with ``attempt``, ``rank``,
    ``pid``, ``cause`` and ``error_class``; empty when the first try succeeded)."""

    __slots__ = ("blobs", "meta", "props", "retries")

    def __init__(
        self,
        meta: dict[str, Any],
        blobs: dict[str, HostBlob],
        props: dict[str, Any],
        retries: list[dict[str, Any]] | None = None,
    ) -> None:
        self.meta = meta
        self.blobs = blobs
        self.props = props
        self.retries = list(retries or [])

    def __repr__(self) -> str:
        return f"TaskResult(meta={self.meta!r}, blobs={self.blobs!r})"


EventCallback = Callable[[str, "int | None", dict[str, Any]], "dict[str, Any] | None"]


def _tensors_as_bytes(blobs: dict[str, Any]) -> None:
    """Replaces each torch tensor in ``blobs`` by its bytes, in place. A function of
    its own: a loop variable left in ``execute``'s frame would hold the last blob (and
    its memory file) until the task returns, past ``consume``."""
    for name in [k for k, v in blobs.items() if type(v).__module__.startswith("torch")]:
        blobs[name] = byte_view(blobs[name], name)


class RankGroup:
    """A group of rank processes that runs every task on all ranks.

    ``on_event(event, rank, props)`` receives each event a rank fires (on a relay thread;
    a dict it returns is merged into the rank's context). ``site``, ``job_id`` and
    ``workspace`` are what the ranks see as their engine's identity, job and workspace;
    rank logs go to ``config["log_dir"]`` or ``workspace/<executor_id>/rank-N/``.

    Use as a context manager, or call ``close()``: it tears the group down and reports
    what it stopped.

    A worker program named ``rankexec-worker`` (the default) or ``rankexec`` without a
    path runs the binary the wheel ships in ``rankexec/_bin/`` when there is one; another
    bare name (``python``) is looked up next to ``sys.executable`` first, so ``python``
    is this environment's interpreter.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        on_event: EventCallback | None = None,
        site: str = "local",
        job_id: str = "",
        workspace: str | None = None,
    ) -> None:
        try:
            text = json.dumps(resolve_worker(config))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"the configuration is not JSON: {e}") from e
        self._native = _rankexec._HostGroup(
            text, on_event=on_event, site=site, job_id=job_id, workspace=workspace
        )
        self._started = False

    def start(self, props: Mapping[str, Any] | None = None) -> None:
        """Launches the ranks and waits until every one is ready (``StartupFailed``).
        After ``close()``, starts a new group."""
        self._native.start(dict(props) if props else None)
        self._started = True

    def execute(
        self,
        task: str,
        meta: Mapping[str, Any] | None = None,
        blobs: Mapping[str, Any] | None = None,
        *,
        props: Mapping[str, Any] | None = None,
        abort_check: Callable[[], bool] | None = None,
        poll_s: float = 0.005,
        abort_reason: str = "aborted by the host",
        consume: bool = False,
    ) -> TaskResult:
        """Runs ``task`` on every rank. ``blobs`` maps names to buffers (bytes, numpy
        arrays, memoryviews; C-contiguous), sent as raw bytes; large ones are copied once
        into one shared memory file that every rank maps. ``abort_check`` is polled
        every ``poll_s`` seconds; when it returns true the task is aborted in every rank
        (``abort_reason`` is what the ranks' abort signal and ``Aborted`` say).
        With ``consume`` (``blobs`` a dict), ``blobs`` is emptied as soon as its buffers
        are in shared memory, before the ranks run: a caller holding no other reference
        to a large input frees its own copy for the whole task.
        A torch tensor, of any dtype, is sent as its bytes (``byte_view``; bfloat16 has
        no buffer of its own). Starts the group if it was never started."""
        if not self._started:
            self.start()
        given = blobs if consume and isinstance(blobs, dict) else dict(blobs or {})
        _tensors_as_bytes(given)
        meta_out, blobs_out, props_out, retries = self._native.execute(
            task,
            dict(meta or {}),
            given,
            dict(props) if props else None,
            abort_check,
            poll_s,
            abort_reason,
            consume,
        )
        return TaskResult(meta_out, blobs_out, props_out, retries)

    def fire_event(self, event: str, props: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Delivers ``event`` to every rank; returns rank 0's context properties."""
        return self._native.fire_event(event, dict(props) if props else None)

    def abort(self, reason: str = "aborted by the host") -> bool:
        """Aborts the task in flight (from another thread); returns whether there was one."""
        return self._native.abort(reason)

    def close(self, grace: float | None = None) -> dict[str, Any]:
        """Tears the group down; returns ``{"elapsed_s", "escalated", "unkillable",
        "pids"}`` (``pids``: the processes that were running). ``grace`` (seconds)
        replaces ``deadlines.shutdown_grace`` for the ranks' own exit after the close
        (then SIGTERM, the term grace, SIGKILL); a teardown under way keeps its own."""
        return self._native.close(grace)

    def pids(self) -> list[int]:
        """The pids of the group's live processes."""
        return self._native.pids()

    def prepare(self, sizes: list[int]) -> None:
        """Prepares shared memory for input blobs of these sizes now (done in the
        background after every task anyway)."""
        self._native.prepare(list(sizes))

    @property
    def phase(self) -> str:
        """``idle``, ``admitting``, ``starting``, ``ready``, ``busy`` or ``stopping``."""
        return self._native.phase

    @property
    def log_dir(self) -> str | None:
        """The directory holding ``rank-N/{stdout,stderr}.log``, once started."""
        d = self._native.log_dir
        return None if d is None else str(d)

    @property
    def staged_bytes(self) -> int:
        """Bytes of shared memory prepared for the next task's input."""
        return self._native.staged_bytes

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
