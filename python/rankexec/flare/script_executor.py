"""``rankexec.flare.ScriptExecutor``: a FLARE Client API script, unchanged, as a rank group.

It replaces FLARE's ``ClientAPIExecutor`` in ``config_fed_client.json``; the script
(``import nvflare.client as flare``) stays as it is. A job exported by FLARE's Job API
(``ScriptRunner(..., launch_external_process=True, command="python3 -m
nvflare.app_opt.pt.torchrun_node --nproc-per-node=2")``) runs after changing only the
executor's ``path`` and ``args``::

    {"tasks": ["*"], "executor": {
        "path": "rankexec.flare.ScriptExecutor",
        "args": {"script": "custom/client.py", "script_args": "--epochs 2",
                 "num_of_processes": 2, "params_exchange_format": "pytorch"}}}

Every rank runs ``python -m rankexec.flare.run_script`` in the app folder (FLARE's
working directory for ``custom/client.py``), which runs the script as ``python SCRIPT
ARGS`` would, with the torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) set by the group. The script is resolved to its real
path once, at START_RUN (``rankexec.flare.policy.script_path``): that path is what the
site policy checks and what every launch and relaunch of the group runs, so a symlink
re-pointed later changes nothing. A script named through a symlink (or ``..``) runs
as its real path, which it sees as ``sys.argv[0]`` and ``__file__``, with that folder
first on ``sys.path`` (where ``python`` puts a symlinked script's folder too); a
script named without one runs under the name the job gave (``custom/client.py``),
which is its real path already. FLARE's own argument names keep
FLARE's meaning and defaults (``train_task_name``, ``evaluate_task_name``,
``submit_model_task_name``, ``train_with_evaluation``, ``params_exchange_format``,
``server_expected_format``, ``params_transfer_type``); rankexec's group arguments
(``launcher``, ``deadlines``, ``gpu``, ``resources``, ``env``, ``restart``) are those of
``rankexec.flare.MultiProcessExecutor``, which this class extends (START_RUN, END_RUN,
aborts and events as there). FLARE's other events are not relayed to the ranks by
default (``relay_events=False``): a Client API script has no way to see them, FLARE's
``ClientAPIExecutor`` forwards none, and each relay is a round trip to every rank,
eight of them per task.

Each task's ``FLModel`` travels to the ranks as blobs (numpy arrays and torch tensors,
see ``rankexec.flare.arrays``) with its ``meta``, ``metrics`` and rounds in the task's
meta; rank 0's ``flare.send()`` comes back the same way and is returned to FLARE as
``FLModelUtils.to_shareable`` builds it. A large model travels in parts, at most 16
memory files (``arrays.parts_of``), so that rank 0, which takes its own copy, lets go of
the input one part at a time, and a tensor its script keeps after ``send()`` keeps only
its part alive; each task's log line says how long staging, the ranks and rank 0's copy
took. ``flare.log`` records (FLARE's tracking
writers) become FLARE analytics events (``analytix_log_stats``), as
``ClientAPIExecutor`` fires them.

Site policy: a job held to the site's policy (``rankexec.flare.policy``: a job without
custom code, or any job where ``byoc_jobs`` is ``"restricted"``) runs only a script the
policy's ``scripts`` names, with arguments it allows; any other is refused at START_RUN
with the rule and the policy file named, before a rank starts. The ranks run the real
path the policy checked (above).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import Any

import nvflare
from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsDataType, LogWriterName
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey, FLMetaKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.apis.utils.analytix_utils import create_analytic_dxo, send_analytic_dxo
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.client.config import ConfigKey, ExchangeFormat, TransferType

from rankexec._staging import stage_in_parts
from rankexec.flare.arrays import pack_flat, plain, unpack_flat
from rankexec.flare.client_api import LOG_EVENT, MODEL_KEY, TESTED_FLARE
from rankexec.flare.executor import ERROR_HEADER, FROM_RANK_PROP, MultiProcessExecutor
from rankexec.flare.policy import script_path

__all__ = ["ScriptExecutor"]


def _argv(value: str | list[str], what: str) -> list[str]:
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list | tuple) and all(isinstance(a, str) for a in value):
        return list(value)
    raise ValueError(f"{what} must be a string or a list of strings, not {value!r}")


def _format(value: Any, what: str) -> str:
    try:
        return ExchangeFormat(getattr(value, "value", value)).value
    except ValueError:
        names = [f.value for f in ExchangeFormat]
        raise ValueError(f"{what} must be one of {names}, not {value!r}") from None


def _arrived(params: Any) -> dict[str, Any]:
    """The sealed memory file slices under the params FLARE downloaded into memory files
    and nothing has written to since (``rankexec.flare._download``), by name."""
    if not isinstance(params, dict) or "torch" not in sys.modules:
        return {}
    try:
        from rankexec.flare._download import sealed_slice
    except ImportError:
        return {}
    out = {}
    for name, value in params.items():
        blob = sealed_slice(value)
        if blob is not None:
            out[name] = blob
    return out


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


class ScriptExecutor(MultiProcessExecutor):
    """Runs a FLARE Client API script on a group of ranks (see the module docs).

    ``all_ranks_receive`` (default False: FLARE's semantics) gives every rank the model
    from shared memory and the same ``is_running()``, so the script needs no broadcast.
    """

    def __init__(
        self,
        script: str,
        script_args: str | list[str] = "",
        num_of_processes: int = 1,
        train_task_name: str = AppConstants.TASK_TRAIN,
        evaluate_task_name: str = AppConstants.TASK_VALIDATION,
        submit_model_task_name: str = AppConstants.TASK_SUBMIT_MODEL,
        train_with_evaluation: bool = False,
        params_exchange_format: str = ExchangeFormat.RAW,
        server_expected_format: str = ExchangeFormat.NUMPY,
        params_transfer_type: str = TransferType.FULL,
        all_ranks_receive: bool = False,
        deadlines: dict | None = None,
        gpu: dict | None = None,
        resources: dict | None = None,
        launcher: Any = "builtin",
        env: dict | None = None,
        restart: dict | None = None,
        relay_events: bool | list[str] = False,
        abort_poll_interval: float = 0.005,
        download_into_memory_files: bool = True,
    ) -> None:
        """A FLARE executor that runs a Client API script on a rank group.

        Args:
            script: required: the script, relative to the app folder
                (`custom/client.py`); ranks run in the app folder, as FLARE's trainer
                does. Resolved to its real path at START_RUN: what the site policy
                checks is what every launch and relaunch runs.
            script_args: its arguments: a string (split like a shell) or a list.
            num_of_processes: ranks in the group.
            train_task_name, evaluate_task_name, submit_model_task_name: FLARE's, for
                `is_train()`, `is_evaluate()`, `is_submit_model()`.
            train_with_evaluation: FLARE's, in `flare.get_config()`.
            params_exchange_format: FLARE's: the script's side (`pytorch` gives torch
                tensors, `numpy` arrays).
            server_expected_format: FLARE's: the server's side.
            params_transfer_type: FLARE's: `DIFF` sends the difference to what was
                received.
            all_ranks_receive: opt-in: every rank receives the model (copy-on-write
                views of the same shared memory) and sees the same `is_running()`, so
                no broadcast is needed; only rank 0's `send()` counts.
            deadlines, gpu, resources, launcher, env, restart: as for
                `rankexec.flare.MultiProcessExecutor`, but `deadlines.shutdown_grace`
                defaults to 30 s here (a script's own end follows the close) and
                `deadlines.abort_grace` to 1 s (a script sees an abort only at its next
                `receive()`/`send()`, so an aborted task's ranks are killed 1 s after
                the abort, as FLARE's own executor terminates its trainer at once; the
                next task relaunches the group).
            relay_events: FLARE's events are not relayed to the ranks by default (a
                Client API script cannot see them, and `ClientAPIExecutor` forwards
                none; each relay is a round trip to every rank); `START_RUN` and
                `END_RUN` always reach them. `True` or a list of names relays them.
            abort_poll_interval: how often FLARE's `abort_signal` is checked during a
                task, in seconds.
            download_into_memory_files: FLARE's download of a task's torch tensors
                writes them straight into the memory files the ranks are sent
                (`rankexec.flare._download`): no decoded copy, no staging copy. False
                keeps FLARE's own download (decoded into this process, then staged).
        """
        version = getattr(nvflare, "__version__", "?")
        if not str(version).startswith("2.9."):
            raise RuntimeError(
                f"rankexec.flare.ScriptExecutor serves FLARE 2.9's Client API (tested with "
                f"{', '.join(TESTED_FLARE)}); this is nvflare {version}"
            )
        if not isinstance(script, str) or not script.endswith(".py"):
            raise ValueError(f"script must name a .py file, not {script!r}")
        self._script = script
        # The script's real path, resolved once at START_RUN: what the policy checks and
        # every launch of the group runs.
        self._script_real: str | None = None
        self._script_args = script_args
        self._script_argv = _argv(script_args, "script_args")
        self._train_task_name = train_task_name
        self._evaluate_task_name = evaluate_task_name
        self._submit_model_task_name = submit_model_task_name
        self._train_with_evaluation = bool(train_with_evaluation)
        self._params_exchange_format = _format(params_exchange_format, "params_exchange_format")
        self._server_expected_format = _format(server_expected_format, "server_expected_format")
        transfer = getattr(params_transfer_type, "value", params_transfer_type)
        if transfer not in (TransferType.FULL.value, TransferType.DIFF.value):
            raise ValueError(f"params_transfer_type must be FULL or DIFF, not {transfer!r}")
        self._params_transfer_type = transfer
        self._all_ranks_receive = bool(all_ranks_receive)
        self._download_into_files = bool(download_into_memory_files)
        self._download_installed = False
        self._site = ""
        self._job = ""
        expected = self._server_expected_format
        super().__init__(
            num_of_processes=num_of_processes,
            rank_component="client_api_script",
            # A script's own end (saving, destroy_process_group) follows the close. An
            # aborted task is another matter: a Client API script sees the abort only
            # at its next receive()/send() (FLARE's own executor terminates it at
            # once), so its ranks get 1 s to answer before the group is killed.
            deadlines={"shutdown_grace": "30s", "abort_grace": "1s", **(deadlines or {})},
            gpu=gpu,
            resources=resources,
            launcher=launcher,
            env=env,
            restart=restart,
            relay_events=relay_events,
            abort_poll_interval=abort_poll_interval,
            # As under FLARE, only rank 0's script receives tasks (unless every rank
            # receives); the other ranks are sent each task too (its memory files are
            # passed, not copied), and answer it at once on their receiver thread, so
            # that their ``flare.is_running()`` is True once per task and False at the
            # end: a loop on every rank (FLARE's Lightning example) stays in step.
            result="rank0",
            # "pytorch": tensors on the wire, which this process decodes only with
            # FLARE's TensorDecomposer, which the parent registers for it.
            server_expected_format="pytorch"
            if expected == ExchangeFormat.PYTORCH.value
            else "numpy",
        )
        # The parent stores its own reading under the same name: keep the script's.
        self._server_expected_format = expected
        self._launcher = launcher
        self._deadlines = deadlines
        self._gpu = gpu
        self._resources = resources
        self._restart = restart
        self._relay_events = relay_events
        self._abort_poll_interval = abort_poll_interval
        self._num_of_processes = num_of_processes

    # ---- configuration -------------------------------------------------------------

    def rank_config(self) -> dict[str, Any]:
        """What every rank's Client API is told (``--config`` of ``run_script``)."""
        return {
            "site_name": self._site,
            "job_id": self._job,
            "all_ranks_receive": self._all_ranks_receive,
            "task_exchange": {
                ConfigKey.TRAIN_WITH_EVAL: self._train_with_evaluation,
                ConfigKey.EXCHANGE_FORMAT: self._params_exchange_format,
                ConfigKey.SERVER_EXPECTED_FORMAT: self._server_expected_format,
                ConfigKey.TRANSFER_TYPE: self._params_transfer_type,
                ConfigKey.TRAIN_TASK_NAME: self._train_task_name,
                ConfigKey.EVAL_TASK_NAME: self._evaluate_task_name,
                ConfigKey.SUBMIT_MODEL_TASK_NAME: self._submit_model_task_name,
            },
        }

    def _real_script(self, app_root: str | None) -> str:
        """The script's real path: the one resolved at START_RUN (and checked by the
        site's policy there), else resolved now."""
        return self._script_real or script_path(self._script, app_root)

    def _launched_script(self, app_root: str | None) -> str:
        """What every launch of the group runs: the script as the job named it when
        that is its real path already (no symlink, no ``..`` on the way: nothing to
        re-point), else its real path, so that each launch runs what was checked."""
        real = self._real_script(app_root)
        named = os.path.abspath(os.path.join(app_root or os.getcwd(), self._script))
        if named == real and ".." not in self._script.split(os.sep):
            return self._script
        return real

    def group_config(self, run_dir: str, app_root: str | None) -> dict[str, Any]:
        cfg = super().group_config(run_dir, app_root)
        cwd = app_root or os.getcwd()
        cfg["worker"] = {
            "program": sys.executable,
            "args": [
                "-m",
                "rankexec.flare.run_script",
                "--cwd",
                cwd,
                "--config",
                json.dumps(self.rank_config()),
                # Kept for every relaunch: never a path through a symlink.
                self._launched_script(app_root),
                *self._script_argv,
            ],
        }
        return cfg

    def _policy_subject(self, fl_ctx: FLContext) -> dict[str, Any]:
        """The site's policy checks the script and its arguments (``scripts``)."""
        app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT)
        return {
            "script": self._script,
            "script_args": self._script_argv,
            "app_root": app_root,
            "script_real": self._real_script(app_root),
        }

    # ---- events --------------------------------------------------------------------

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            self._site = fl_ctx.get_identity_name() or ""
            self._job = str(fl_ctx.get_job_id() or "")
            app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT)
            script = os.path.join(app_root or os.getcwd(), self._script)
            real = script_path(self._script, app_root)
            self._script_real = None
            if not os.path.isfile(real):
                self.log_error(fl_ctx, f"cannot start the rank group: no script {script}")
                self.system_panic(f"rankexec: no script {script}", fl_ctx)
                return
            # Pinned: the policy checks this path and every launch of the group runs it.
            self._script_real = real
            self._install_download(fl_ctx)
        super().handle_event(event_type, fl_ctx)
        if event_type == EventType.END_RUN and self._download_installed:
            from rankexec.flare import _download

            _download.uninstall()
            self._download_installed = False

    def _install_download(self, fl_ctx: FLContext) -> None:
        """FLARE's download of task tensors into memory files (see the module docs),
        where torch is there to decode them."""
        if not self._download_into_files or self._download_installed:
            return
        try:
            from rankexec.flare import _download
        except ImportError as e:  # no torch or safetensors: FLARE's own download
            self.log_info(fl_ctx, f"task tensors are downloaded by FLARE's own consumer ({e})")
            return
        self._download_installed = _download.install()
        if not self._download_installed:
            self.log_warning(
                fl_ctx,
                "FLARE's tensor decomposer is not its own TensorDecomposer here: task "
                "tensors are downloaded by it and staged",
            )

    def _on_rank_event(self, event: str, rank: int | None, props: dict) -> None:
        if event != LOG_EVENT:
            super()._on_rank_event(event, rank, props)
            return
        engine = self._engine
        if engine is None:
            return
        record = json.loads(props.get("__rankexec_flare_log__") or "{}")
        kwargs = dict(record.get("kwargs") or {})
        writer = kwargs.pop("writer", LogWriterName.TORCH_TB.value)
        dxo = create_analytic_dxo(
            tag=record.get("key", ""),
            value=record.get("value"),
            data_type=AnalyticsDataType(record.get("data_type")),
            writer=LogWriterName(writer),
            **kwargs,
        )
        with engine.new_context() as ctx:
            # Marked as a rank's, so that it is not relayed back down to the ranks.
            ctx.set_prop(FROM_RANK_PROP, rank, private=True, sticky=False)
            send_analytic_dxo(self, dxo=dxo, fl_ctx=ctx, event_type=ANALYTIC_EVENT_TYPE)

    # ---- tasks ---------------------------------------------------------------------

    def execute(
        self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal
    ) -> Shareable:
        group = self._group
        if group is None:
            self.log_error(fl_ctx, "the rank group is not running (START_RUN failed)")
            return self._failed("the rank group is not running")
        shareable.set_header(FLMetaKey.JOB_ID, fl_ctx.get_job_id())
        shareable.set_header(FLMetaKey.SITE_NAME, fl_ctx.get_identity_name())
        t0 = time.perf_counter()
        try:
            model = FLModelUtils.from_shareable(shareable)
            # Tensors FLARE downloaded into memory files, unchanged since: the ranks
            # are sent those files as they are (no staging copy).
            arrived = _arrived(model.params)
            blobs, specs, values = pack_flat(model.params, "the task's params")
            blobs.update(arrived)
            fl = {
                "params_type": plain(model.params_type, "params_type"),
                "param_specs": specs,
                "param_values": values,
                "metrics": plain(model.metrics, "the task's metrics"),
                "meta": plain(model.meta or {}, "the task's meta"),
                "current_round": plain(model.current_round, "current_round"),
                "total_rounds": plain(model.total_rounds, "total_rounds"),
                "start_round": plain(model.start_round, "start_round"),
            }
        except (TypeError, ValueError, KeyError) as e:
            self.log_error(fl_ctx, f"task {task_name}: its data cannot reach the ranks: {e}")
            return self._failed(f"the task's data cannot reach the ranks: {e}")
        # One copy of the model on this site: FLARE's decoded params are released as soon
        # as they are in the memory file the ranks map (``consume`` empties ``blobs``
        # then). The task's DXO data is the same dict as ``model.params``: emptied
        # here, so that FLARE's task object stops holding the arrays too.
        if isinstance(model.params, dict) and blobs:
            model.params.clear()
        del model
        # Each tensor goes into a memory file and is let go at once, one at a time: the
        # site never holds FLARE's decoded model and the memory files in full at once.
        in_files = sum(len(b) for b in arrived.values())
        del arrived
        try:
            stage_in_parts(blobs)
        except OSError as e:  # refused by the host's memory, naming both sizes
            self.log_error(fl_ctx, f"task {task_name}: its data cannot reach the ranks: {e}")
            return self._failed(f"the task's data cannot reach the ranks: {e}")
        t1 = time.perf_counter()
        result = self._run(
            group, task_name, {MODEL_KEY: fl}, blobs, fl_ctx, abort_signal, consume=True
        )
        t2 = time.perf_counter()
        if isinstance(result, Shareable):
            return result
        out = result.meta.get(MODEL_KEY)
        if not isinstance(out, dict):
            error = f"rank 0 answered task {task_name} without a model (did it call flare.send?)"
            self.log_error(fl_ctx, error)
            return self._failed(error)
        try:
            reply = FLModelUtils.to_shareable(self._model_of(out, result.blobs))
        except (TypeError, ValueError) as e:
            self.log_error(fl_ctx, f"task {task_name}: rank 0's result is not a model: {e}")
            return self._failed(f"rank 0's result is not a model: {e}")
        current_round = shareable.get_header(AppConstants.CURRENT_ROUND)
        if current_round is not None:
            reply.set_header(AppConstants.CURRENT_ROUND, current_round)
        # Where the task's time went (the per-step figures of BENCHMARKS.md's large models).
        self.log_info(
            fl_ctx,
            f"task {task_name}: {_mib(in_files)} MiB arrived in memory files, staged in "
            f"{(t1 - t0) * 1e3:.0f} ms, the ranks' task "
            f"{(t2 - t1) * 1e3:.0f} ms (rank 0 took its input in "
            f"{float(out.get('rank0_take_s') or 0) * 1e3:.0f} ms), the reply built in "
            f"{(time.perf_counter() - t2) * 1e3:.0f} ms",
        )
        return self._retried(reply, result.retries)

    @staticmethod
    def _model_of(out: dict, blobs: dict) -> FLModel:
        params = None
        if out.get("has_params"):
            params = unpack_flat(
                blobs, out.get("param_specs"), out.get("param_values"), writable=False
            )
            if "rankexec.flare._download" in sys.modules:
                # FLARE's upload then serves these tensors from rank 0's memory files.
                sys.modules["rankexec.flare._download"].remember_result(params, blobs)
        params_type = out.get("params_type")
        return FLModel(
            params_type=ParamsType(params_type) if params_type else None,
            params=params,
            metrics=out.get("metrics"),
            start_round=out.get("start_round"),
            current_round=out.get("current_round"),
            total_rounds=out.get("total_rounds"),
            meta=dict(out.get("meta") or {}),
        )


# The failure header, re-exported for tests and server components.
__all__ += ["ERROR_HEADER"]
