"""FLARE's Client API (``import nvflare.client as flare``) served by the rank runtime.

Each rank of a ``rankexec.flare.ScriptExecutor`` runs ``python -m
rankexec.flare.run_script``, which starts the rank runtime and runs the user's script as
``python SCRIPT ARGS`` would (``__main__``, ``sys.argv``, the script's directory first
on ``sys.path``, the app folder as working directory; see
``rankexec.flare._script_rank``). When the script's ``import nvflare.client`` completes,
``install`` puts a ``RankClientAPI`` on FLARE's process-wide data bus under
``CLIENT_API``, and the script's unchanged ``flare.init()`` finds it there: with no bootstrap file and ``CLIENT_API_TYPE`` set to
``IN_PROCESS_API``, FLARE 2.9's ``APIContext`` takes the ``InProcessClientAPI`` stored
on the data bus (``nvflare/client/api_context.py``), the hook FLARE's own in-process
executor uses. ``RankClientAPI`` subclasses ``InProcessClientAPI`` for that check and
overrides every call; tested with nvflare 2.9.0 (``TESTED_FLARE``).

Rank semantics are FLARE's (``nvflare/client/cell/api.py``): rank 0 (the rank given
to ``flare.init``, else ``RANK``) receives tasks; on other ranks ``receive()`` returns
None, ``send()`` does nothing and ``get_task_name``, ``is_train``, ``is_evaluate``,
``is_submit_model`` and ``log`` raise. Their part of each rankexec task is answered at
once by a receiver thread. Their ``is_running()`` follows the run, not FLARE's
constant: True once for each task the group is sent, False at the run's end, so a loop
``while flare.is_running()`` on every rank (FLARE's Lightning example, whose first
``strategy.broadcast`` is a no-op before Lightning sets up the process group) runs one
iteration per task on every rank and ends on every rank. With ``all_ranks_receive``
every rank receives the model (copy-on-write views of the same shared memory, which
alone keep it mapped) and may ask the task's name and kind; a
rank's task is answered by its ``send()`` (only rank 0's result counts) or when it asks
for the next one (``receive()``/``is_running()``), whether or not it still holds the
model (Lightning's callback clears it).

Rank 0 asking for the next task while it holds one it never sent a result for (a
``clear()`` and no ``send()``, a task kind the script's loop does not answer) would
wait forever while the host waits for that result: the held task fails instead with
``TaskLeftUnanswered``, naming it, and the script gets the next task.

Failures and ends:

- an exception escaping the script is written to the rank's ``error.json`` (torchrun's
  format) and stderr, and ends the rank at once (exit code 1, no interpreter teardown):
  the host names the rank and the exception (the first rank to end is the root cause,
  as under torchrun: a peer failing in a collective afterwards is not);
- an aborted task is answered as aborted at the script's next ``receive()``,
  ``is_running()`` or ``send()`` (its result is not sent, and a warning says so); the
  script then gets the next task, so the group lives on;
- END_RUN and the group's close end ``is_running()``/``receive()`` (False/None) on
  every rank; the script returns normally, no signal needed.
"""

from __future__ import annotations

import copy
import json
import mmap
import os
import queue
import sys
import time
from typing import Any

import numpy as np
from nvflare.apis.analytix import AnalyticsDataType
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.client.api_spec import CLIENT_API_KEY, APISpec
from nvflare.client.config import ClientConfig, ConfigKey, ExchangeFormat, TransferType
from nvflare.client.converter_utils import convert_params
from nvflare.client.in_process.api import InProcessClientAPI
from nvflare.fuel.data_event.data_bus import DataBus

from rankexec import TaskAborted
from rankexec._rankexec import SharedBuffer
from rankexec._staging import page_offsets
from rankexec.flare._script_rank import ScriptEnded, TaskFeed, TaskLeftUnanswered
from rankexec.flare.arrays import Unsendable, pack_flat, parts_of, plain, unpack_flat

__all__ = [
    "LOG_EVENT",
    "TESTED_FLARE",
    "RankClientAPI",
    "ScriptEnded",
    "TaskLeftUnanswered",
    "install",
]

#: The nvflare versions this hook is tested with.
TESTED_FLARE = ("2.9.0",)
#: The rank event that carries a ``flare.log`` record to the host.
LOG_EVENT = "rankexec.flare.client_api.log"
#: Task meta key holding the FLModel fields (host to rank and back).
MODEL_KEY = "flare_model"
_PAGE = mmap.PAGESIZE
#: Rank 0's received params go to a memory file of their own from this size on.
_OWN_FILE_FROM = 1 << 20


def install(config: dict[str, Any], feed: TaskFeed) -> RankClientAPI:
    """Builds the rank's Client API over `feed` and puts it where FLARE's
    ``flare.init()`` looks for an in-process API (the data bus)."""
    api = RankClientAPI(config, feed)
    DataBus().put_data(CLIENT_API_KEY, api)
    return api


class RankClientAPI(InProcessClientAPI):
    """The Client API of one rank (see the module docs).

    Subclasses ``InProcessClientAPI`` only so that FLARE's ``APIContext`` accepts it;
    none of its data-bus machinery is used.
    """

    def __init__(self, config: dict[str, Any], feed: TaskFeed) -> None:
        APISpec.__init__(self)  # not InProcessClientAPI's: no data-bus subscriptions
        self._config = config
        self._feed = feed
        self._all_ranks = bool(config.get("all_ranks_receive", False))
        self._exchange: dict[str, Any] = dict(config.get("task_exchange") or {})
        self.client_config = ClientConfig(
            {
                ConfigKey.TASK_EXCHANGE: self._exchange,
                FLMetaKey.SITE_NAME: config.get("site_name", ""),
                FLMetaKey.JOB_ID: config.get("job_id", ""),
            }
        )
        self.meta: dict[str, Any] = {}
        self.rank: str | None = os.environ.get("RANK", "0")
        self.fl_model: FLModel | None = None
        self.receive_called = False
        self._params_conversion_state: dict[str, Any] = {}
        self._fresh = False  # a model fetched by is_running(), not yet taken by receive()
        # Rank 0's received params in memory files of its own, one per part of the
        # model: (buffer, address, size) each.
        self._arenas: list[tuple[Any, int, int]] = []
        self._take_s = 0.0  # the latest input's copy into them, in seconds

    # The state shared with the feed's receiver thread.
    @property
    def _task(self) -> Any:
        return self._feed.task

    @_task.setter
    def _task(self, task: Any) -> None:
        self._feed.task = task

    @property
    def _task_name(self) -> str | None:
        return self._feed.task_name

    @property
    def _closed(self) -> bool:
        return self._feed.closed

    @_closed.setter
    def _closed(self, closed: bool) -> None:
        self._feed.closed = closed

    def fail_pending(self, error: BaseException) -> bool:
        """Fails the unanswered task with `error`; returns whether there was one."""
        return self._feed.fail_pending(error)

    # ---- FLARE's Client API --------------------------------------------------------

    def init(self, rank: str | None = None, config: dict | None = None) -> None:
        del config
        self.rank = str(rank) if rank is not None else os.environ.get("RANK", "0")

    def _is_control(self) -> bool:
        return str(self.rank) == "0"

    def _receives(self) -> bool:
        return self._is_control() or self._all_ranks

    def _settle_aborted(self) -> None:
        task = self._task
        if task is not None and task.abort.triggered:
            reason = task.abort.reason or "aborted"
            self.fail_pending(TaskAborted(f"task `{self._task_name}` aborted: {reason}"))
            self.fl_model = None
            self.receive_called = False

    def _answer_unsent(self) -> None:
        """A rank whose result does not count: its part of the task is an ack."""
        with self._feed.lock:
            task, self._task = self._task, None
        if task is not None:
            task.reply(meta={"rank_ack": True})
        self.fl_model = None
        self._fresh = False

    def receive(self, timeout: float | None = None) -> FLModel | None:
        if not self._receives() or self._closed:
            return None
        self._settle_aborted()
        if self.fl_model is not None:
            if self._is_control() or self._fresh:
                self._fresh = False
                self.receive_called = True
                return self.fl_model
            self._answer_unsent()  # a rank other than 0 moves on to the next task
        model = self._next(timeout)
        if model is not None:
            self.receive_called = True
        return model

    def _leave_task(self) -> None:
        """Before waiting for the next task: the one this rank still holds is over."""
        if self._task is None:
            return
        if not self._is_control():
            self._answer_unsent()  # its part is done: only rank 0's result counts
            return
        name = self._task_name
        error = TaskLeftUnanswered(
            f"rank 0 asked for the next task without sending a result for task `{name}`"
            " (flare.send() was not called for it)"
        )
        if self.fail_pending(error):
            print(f"rankexec: {error}; the task fails", file=sys.stderr)
        self.fl_model = None
        self.receive_called = False
        self._fresh = False

    def _next(self, timeout: float | None) -> FLModel | None:
        self._leave_task()
        while True:
            try:
                item = self._feed.tasks.get(timeout=timeout)
            except queue.Empty:
                return None
            if item is None:
                self._feed.closed = self._feed.ended = True
                return None
            if isinstance(item, BaseException):
                self._feed.closed = self._feed.ended = True
                raise item
            self._task = item
            self._feed.task_name = item.name
            self._feed.ctx = item.ctx
            if item.abort.triggered:  # aborted before the script saw it
                self._settle_aborted()
                continue
            self.fl_model = self._model_of(item)
            self.meta = {ConfigKey.TASK_NAME: item.name}
            return self.fl_model

    def _model_of(self, task: Any) -> FLModel:
        fl = dict(task.meta.get(MODEL_KEY) or {})
        params = None
        if fl.get("param_specs") or fl.get("param_values"):
            # Rank 0 alone receives (FLARE's semantics): its params are its own copy and
            # the input's memory file is let go at once, so a script that updates the
            # weights in place and sends them back holds the model once, plus its
            # result. With ``all_ranks_receive`` every rank maps the same pages
            # copy-on-write instead: N ranks hold the received model once between them.
            if self._all_ranks:
                params = unpack_flat(
                    task.blobs, fl.get("param_specs"), fl.get("param_values"), writable=True
                )
                # The views keep the memory file mapped while the script holds them; the
                # task no longer does, so a script that takes its part (an FSDP shard)
                # and drops the rest lets the file go before the task ends.
                task.blobs.clear()
            else:
                t0 = time.perf_counter()
                params = self._own_params(task, fl.get("param_specs"), fl.get("param_values"))
                self._take_s = time.perf_counter() - t0
            params = convert_params(
                params,
                self._exchange.get(ConfigKey.SERVER_EXPECTED_FORMAT, ExchangeFormat.NUMPY),
                self._exchange.get(ConfigKey.EXCHANGE_FORMAT, ExchangeFormat.RAW),
                self._params_conversion_state,
            )
        params_type = fl.get("params_type")
        return FLModel(
            params_type=ParamsType(params_type) if params_type else None,
            params=params,
            metrics=fl.get("metrics"),
            start_round=fl.get("start_round"),
            current_round=fl.get("current_round"),
            total_rounds=fl.get("total_rounds"),
            meta=dict(fl.get("meta") or {}),
        )

    def _own_params(self, task: Any, specs: Any, values: Any) -> dict[str, Any]:
        """Rank 0's params as its own copy, in memory files of its own (``_arenas``: one
        per part of the model, ``arrays.parts_of``), each part of the input let go as
        soon as it is copied. A script that updates these tensors in place and sends
        them back sends those files as they are: ``_reply`` seals them (the script's
        views stay valid; later writes stay private) instead of copying the model
        again. In parts, so that the site never holds the input and rank 0's copy in
        full at once (the host staged the input in parts too), and a tensor the script
        keeps after ``send()`` (a loop variable) keeps its part's file alive, not the
        whole model's."""
        self._arenas = []
        blobs = task.blobs
        arrays = dict(specs or {})
        missing = [n for n in arrays if n not in blobs]
        if missing:
            raise Unsendable(missing[0], "it has a spec but no blob")
        sizes = {name: len(blobs[name]) for name in arrays}
        if sum(sizes.values()) < _OWN_FILE_FROM:
            small = unpack_flat(blobs, specs, values, writable=True, copy=True)
            blobs.clear()
            return small
        out: dict[str, Any] = {}
        for group in parts_of(sizes):
            offsets, total = page_offsets({name: sizes[name] for name in group})
            buf = SharedBuffer(total)
            whole = np.frombuffer(memoryview(buf), dtype=np.uint8)
            # pwrite where the extension has it (no page fault per 4 KiB page of the
            # new file), else a copy through the mapping.
            write_at = getattr(buf, "write_at", None)
            for name in group:
                at, size = offsets[name], sizes[name]
                region = whole[at : at + size]
                if write_at is not None:
                    write_at(at, blobs[name])
                else:
                    region[:] = np.frombuffer(blobs[name], dtype=np.uint8)
                out[name] = unpack_flat(
                    {name: region}, {name: arrays[name]}, writable=True, own=True
                )[name]
                # This part of the input goes now (its file, once no rank maps it).
                del blobs[name]
            self._arenas.append((buf, buf.address, total))
        out.update(values or {})
        blobs.clear()  # the rest of the input (the runtime holds large ones no more)
        return out

    def _sent_from_arena(self, blobs: dict[str, Any]) -> None:
        """Replaces each blob that is a page-aligned region of one of rank 0's own
        params files by a slice of that file, sealed: sent without a copy."""
        arenas, self._arenas = self._arenas, []
        sealed: dict[int, Any] = {}
        for name, raw in blobs.items():
            if not isinstance(raw, np.ndarray) or raw.nbytes < _OWN_FILE_FROM // 16:
                continue
            for i, (buf, base, length) in enumerate(arenas):
                at = raw.ctypes.data - base
                if at < 0 or at + raw.nbytes > length or at % _PAGE:
                    continue
                if i not in sealed:
                    sealed[i] = buf.seal()
                blobs[name] = sealed[i].slice(at, raw.nbytes)
                break

    def is_running(self) -> bool:
        if self._closed:
            return False
        if not self._receives():
            # A rank whose part is answered at once: True once per task, False at the end.
            return self._feed.ack_only and self._feed.next_acknowledged()
        if not self._is_control():
            if self.fl_model is not None and not self._fresh:
                self._answer_unsent()
            running = self.receive() is not None
            self._fresh = running
            return running
        return self.receive() is not None

    def send(self, model: FLModel, clear_cache: bool = True) -> None:
        if not self._receives() or self._closed:
            return
        if not self.receive_called:
            raise RuntimeError('"receive" needs to be called before sending model!')
        task = self._task
        if task is not None and task.abort.triggered:
            print(
                f"rankexec: task `{self._task_name}` was aborted "
                f"({task.abort.reason}); its result is not sent",
                file=sys.stderr,
            )
            self._settle_aborted()
            return
        if task is None:
            raise RuntimeError("send() called with no current task (already sent?)")
        if not self._is_control():
            self._answer_unsent()  # only rank 0's result counts, as in FLARE
        else:
            diff = self._exchange.get(ConfigKey.TRANSFER_TYPE) == TransferType.DIFF
            if (
                clear_cache
                and not diff
                and self.fl_model is not None
                and self.fl_model is not model
            ):
                # The received params go before the result is copied into shared
                # memory (the script's own references keep what it still uses); a DIFF
                # is taken against them, so they stay for it.
                self.fl_model.params = None
            self._reply(task, model)
        if clear_cache:
            model.params = None
            model.optimizer_params = None
            if self.fl_model is not None:
                self.fl_model.params = None
            self.fl_model = None
            self.receive_called = False
        self._maybe_cleanup_memory()

    def _reply(self, task: Any, model: FLModel) -> None:
        if self._exchange.get(ConfigKey.TRANSFER_TYPE) == TransferType.DIFF:
            model = self._prepare_param_diff(model)  # FLARE's own DIFF
        if model.params is None and model.metrics is None:
            raise RuntimeError("the model to send does not have either params or metrics")
        wire = copy.copy(model)
        wire.params = convert_params(
            model.params,
            self._exchange.get(ConfigKey.EXCHANGE_FORMAT) or ExchangeFormat.RAW,
            self._exchange.get(ConfigKey.SERVER_EXPECTED_FORMAT, ExchangeFormat.NUMPY),
            self._params_conversion_state,
        )
        blobs, specs, values = pack_flat(wire.params, "FLModel.params")
        self._sent_from_arena(blobs)
        params_type = wire.params_type
        fl = {
            "has_params": wire.params is not None,
            "params_type": plain(params_type, "params_type") if params_type else None,
            "param_specs": specs,
            "param_values": values,
            "metrics": plain(wire.metrics, "FLModel.metrics"),
            "meta": plain(wire.meta or {}, "FLModel.meta"),
            "current_round": plain(wire.current_round, "FLModel.current_round"),
            "total_rounds": plain(wire.total_rounds, "FLModel.total_rounds"),
            "start_round": plain(wire.start_round, "FLModel.start_round"),
            # How long rank 0 took to copy its input into its own files (the host logs it).
            "rank0_take_s": round(self._take_s, 4),
        }
        with self._feed.lock:
            self._task = None
        task.reply(meta={MODEL_KEY: fl}, blobs=blobs)

    def system_info(self) -> dict:
        return {
            FLMetaKey.SITE_NAME: self._config.get("site_name", ""),
            FLMetaKey.JOB_ID: self._config.get("job_id", ""),
        }

    def get_config(self) -> dict:
        return {
            ConfigKey.TASK_EXCHANGE: dict(self._exchange),
            FLMetaKey.JOB_ID: self._config.get("job_id", ""),
            FLMetaKey.SITE_NAME: self._config.get("site_name", ""),
        }

    def get_job_id(self) -> str:
        return str(self._config.get("job_id", ""))

    def get_site_name(self) -> str:
        return str(self._config.get("site_name", ""))

    def _require_control(self, what: str) -> None:
        # FLARE's rule; with all_ranks_receive every rank holds the task and may ask.
        if not self._is_control() and not (self._all_ranks and what != "log"):
            raise RuntimeError(f"only rank 0 can call {what}!")

    def get_task_name(self) -> str:
        self._require_control("get_task_name")
        if self._task_name is None:
            raise RuntimeError("no current task")
        return self._task_name

    def is_train(self) -> bool:
        self._require_control("is_train")
        return self._task_name == self._exchange.get(ConfigKey.TRAIN_TASK_NAME)

    def is_evaluate(self) -> bool:
        self._require_control("is_evaluate")
        return self._task_name == self._exchange.get(ConfigKey.EVAL_TASK_NAME)

    def is_submit_model(self) -> bool:
        self._require_control("is_submit_model")
        return self._task_name == self._exchange.get(ConfigKey.SUBMIT_MODEL_TASK_NAME)

    def log(self, key: str, value: Any, data_type: AnalyticsDataType, **kwargs: Any) -> None:
        self._require_control("log")
        ctx = self._feed.ctx
        if ctx is None:
            raise RuntimeError("flare.log before the rank group delivered any event or task")
        record = {
            "key": key,
            "value": plain(value, f"the value logged as `{key}`"),
            "data_type": plain(data_type, "data_type"),
            "kwargs": plain(kwargs, f"the arguments logged with `{key}`"),
        }
        ctx.fire_event(LOG_EVENT, {"__rankexec_flare_log__": json.dumps(record)})

    def clear(self) -> None:
        self.fl_model = None
        self.receive_called = False

    def shutdown(self) -> None:
        self._closed = True

    def close(self) -> None:
        self._closed = True
