"""``rankexec.flare.MultiProcessExecutor``: a rankexec rank group as a FLARE executor.

Configure it in ``config_fed_client.json`` in place of FLARE's MultiProcessExecutor::

    {"tasks": ["train"], "executor": {
        "path": "rankexec.flare.MultiProcessExecutor",
        "args": {"num_of_processes": 2, "rank_component": "custom/np_delta.py:AddDelta",
                 "rank_args": {"delta": 1.0}}}}

The args are FLARE-style keyword arguments, not rankexec's ``components`` list: FLARE
2.9 builds (and authorizes) every dict in a component's args that has ``id`` and
``path`` keys, so rank components are named by ``rank_component`` (a Python rank
``"module:Class"`` or ``"file.py:Class"``, a relative file resolved against the app's
folder; or a component of a Rust ``worker``) and ``rank_args``. Keep ``id``/``path``
pairs out of ``rank_args`` for the same reason.

Lifecycle: START_RUN launches the group (site name, job id and the job's run directory
from the FLContext; rank logs in ``RUN_DIR/rankexec/rank-N/``) and relays START_RUN to
the ranks; END_RUN reaches the ranks, then the group is torn down (nothing is left
running; when the job was aborted, FLARE's ``ABORT_TASK`` with ``RUN_ABORT_REQUESTED``,
the ranks get ``aborted_close_grace``, 1 s, to exit after the close instead of
``deadlines.shutdown_grace``, then SIGTERM and SIGKILL); ``_abort_task`` and FLARE's ``abort_signal`` (polled every
``abort_poll_interval`` seconds, since it has no wake-up) abort the task in every rank.
Other events are relayed to the ranks (``relay_events``), and events fired in ranks
reach FLARE's engine with ``FROM_RANK_PROP`` set to the rank.

Site policy: a job without custom code (FLARE's BYOC flag in the job's meta) is held
to ``<site workspace>/local/rankexec.json`` (``rankexec.flare.policy``) at START_RUN,
before anything is launched: its ``worker``, ``launcher``, ``env`` and
``rank_component`` must be allowed there; a refusal names the arg and the file and
ends the run. The default rank program is this Python with ``-P -m rankexec.worker``
(the current directory is not on the ranks' module path).

Tasks: every numpy array and torch tensor of the DXO travels as a blob (dtype and shape
in the meta), its other values as meta, a collection's members recursively (see
``rankexec.flare.arrays``); the result comes back as a DXO of the same kind with
``NUM_STEPS_CURRENT_ROUND`` from the ranks' meta, tensors as tensors, members as DXOs,
and the ranks' other meta in the ``rankexec_meta`` header. A value that cannot travel
either way returns ``EXECUTION_EXCEPTION`` naming its key. ``server_expected_format:
"pytorch"`` registers FLARE's tensor decomposer (needed to receive tensors, as with
FLARE's own executors). A rank failure returns ``EXECUTION_EXCEPTION`` with the typed
error logged (and in the reply's ``rankexec_error`` header); an aborted task returns
``TASK_ABORTED``. With ``restart: {"retry_task": N}``, a task whose rank died from
outside (signal, OOM kill, lost node) runs again on a relaunched group before the
reply; the reply (OK or not) then has the ``rankexec_retries`` header: one dict per
try a death ended (``attempt``, ``rank``, ``pid``, ``cause``, ``error_class``), also
logged as a warning.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

from nvflare.apis.app_validation import AppValidationKey
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from rankexec.flare import policy as site_policy
from rankexec.flare.arrays import (
    ARRAYS_KEY,
    KIND_KEY,
    MEMBERS_KEY,
    META_KEY,
    VALUES_KEY,
    Unsendable,
    pack_data,
    plain,
    unpack_data,
)
from rankexec.host import Aborted, RankexecError, RankFailed, RankGroup, TaskResult

#: Reply header holding the typed error of a failed rank group.
ERROR_HEADER = "rankexec_error"
#: Reply header listing the tries a rank's death ended before the reply (retry_task).
RETRIES_HEADER = "rankexec_retries"
#: FLContext property set on events that came from a rank (its rank number).
FROM_RANK_PROP = "__rankexec_from_rank__"
#: FLContext property holding the context properties a rank fired its event with.
EVENT_PROPS_PROP = "__rankexec_event_props__"
#: Reply header holding the ranks' result meta that is not part of the DXO.
RESULT_META_HEADER = "rankexec_meta"
# Result meta keys that become the reply's DXO (the rest goes to RESULT_META_HEADER).
_DXO_KEYS = frozenset(
    {ARRAYS_KEY, VALUES_KEY, MEMBERS_KEY, KIND_KEY, META_KEY, MetaKey.NUM_STEPS_CURRENT_ROUND}
)

# Events not relayed to the ranks: handled here, or too frequent to be of use there.
_NOT_RELAYED = frozenset(
    {
        EventType.START_RUN,
        EventType.END_RUN,
        EventType.ABORT_TASK,
        EventType.CHECK_END_RUN_READINESS,
        EventType.BEFORE_PULL_TASK,
        EventType.AFTER_PULL_TASK,
        EventType.CRITICAL_LOG_AVAILABLE,
        EventType.ERROR_LOG_AVAILABLE,
        EventType.EXCEPTION_LOG_AVAILABLE,
        EventType.WARNING_LOG_AVAILABLE,
        EventType.INFO_LOG_AVAILABLE,
        EventType.DEBUG_LOG_AVAILABLE,
    }
)


def _member(kind: str, data: dict, meta: dict) -> DXO:
    return DXO(data_kind=kind or DataKind.WEIGHTS, data=data, meta=meta)


def _job_has_custom_code(fl_ctx: FLContext, workspace: Any, job_id: str) -> bool:
    """FLARE's own BYOC signal: ``"byoc": true`` in the job's meta, which FLARE derives
    from the submitted apps (an app with a ``custom/`` folder), never from the user's
    meta. Read from the FLContext, else from the deployed job's meta file; when neither
    can be read the job counts as one without custom code (the safe side)."""
    meta = fl_ctx.get_prop(FLContextKey.JOB_META)
    if not isinstance(meta, dict) and workspace is not None and job_id:
        try:
            with open(workspace.get_job_meta_path(job_id)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = None
    return isinstance(meta, dict) and bool(meta.get(AppValidationKey.BYOC))


def keep_rankexec_out_of_custom(job: Any) -> None:
    """Marks ``rankexec`` as an installed package of a FLARE Job API ``FedJob``, so
    ``export_job`` names its classes without copying their source into ``custom/``."""
    config = getattr(job, "job", None)
    packages = list(getattr(config, "app_packages", None) or [])
    if "rankexec" not in packages:
        job.set_app_packages([*packages, "rankexec"])


class MultiProcessExecutor(Executor):
    """Runs every task on a group of rank processes (see the module docs)."""

    # The documented path (what sites allow, what FLARE's Job API exports).
    __module__ = "rankexec.flare"

    def __init__(
        self,
        num_of_processes: int = 1,
        rank_component: str = "",
        rank_args: dict | None = None,
        worker: dict | None = None,
        result: Any = "rank0",
        deadlines: dict | None = None,
        gpu: dict | None = None,
        resources: dict | None = None,
        launcher: Any = "builtin",
        env: dict | None = None,
        restart: dict | None = None,
        relay_events: bool | list[str] = True,
        abort_poll_interval: float = 0.005,
        copy_results: bool = False,
        server_expected_format: str = "numpy",
        aborted_close_grace: float = 1.0,
    ) -> None:
        """A FLARE executor whose tasks run on a rank group.

        Args:
            num_of_processes: ranks in the group (1 to 1024).
            rank_component: required: the rank code, a Python rank class
                `"module:Class"` or `"file.py:Class"` (a relative file is looked up in the
                app's folder first), or a component of a Rust `worker`. Classes only:
                `os:system` or any other function is refused
                (`rankexec._loader.NotAClass`). Subject to the site policy for a job
                without custom code.
            rank_args: keyword arguments of the rank class. Keep `id`/`path` pairs out
                of it: FLARE would build them as components.
            worker: the rank program, `{"program", "args"}` (default: this Python,
                `-P -m rankexec.worker`), e.g. a Rust `rankexec-worker`. Subject to the
                site policy.
            result, deadlines, gpu, resources, restart: as in rankexec's executor
                arguments.
            launcher, env: as in rankexec's executor arguments; subject to the site
                policy.
            relay_events: relay FLARE's events to the ranks (all but log, pull and
                end-run-readiness events), or a list of event names to relay.
            abort_poll_interval: how often FLARE's `abort_signal` (a flag with no
                wake-up) is checked during a task, in seconds.
            copy_results: return writable copies of the result arrays (default:
                read-only views of the ranks' shared memory).
            server_expected_format: `"pytorch"` when the server sends torch tensors
                (FLARE's PyTorch recipes, `PTFileModelPersistor` with
                `allow_numpy_conversion: false`): registers FLARE's tensor decomposer,
                without which the client cannot receive them.
            aborted_close_grace: seconds an aborted job's ranks get to exit after the
                close, in place of `deadlines.shutdown_grace`, before SIGTERM and SIGKILL
                (the job was aborted when FLARE fires `_abort_task` with
                `RUN_ABORT_REQUESTED`: an admin abort or a server-side failure; END_RUN
                still reaches the ranks first).
        """
        super().__init__()
        if server_expected_format not in ("numpy", "pytorch"):
            raise ValueError(
                f"server_expected_format must be 'numpy' or 'pytorch', not {server_expected_format!r}"
            )
        if server_expected_format == "pytorch":
            # Tensors on the wire: FLARE decodes them only with this decomposer
            # registered (its own Client API executors do the same).
            from nvflare.app_opt.pt.decomposers import TensorDecomposer
            from nvflare.fuel.utils import fobs

            fobs.register(TensorDecomposer)
        if not isinstance(rank_component, str) or not rank_component:
            raise ValueError("rank_component must name the rank code (`module:Class`)")
        if not isinstance(num_of_processes, int) or num_of_processes < 1:
            raise ValueError(f"num_of_processes must be a positive int, not {num_of_processes!r}")
        self._n = num_of_processes
        self._rank_component = rank_component
        self._rank_args = dict(rank_args or {})
        self._worker = worker
        self._options: dict[str, Any] = {"result": result, "launcher": launcher}
        for key, value in (
            ("deadlines", deadlines),
            ("gpu", gpu),
            ("resources", resources),
            ("restart", restart),
        ):
            if value is not None:
                self._options[key] = value
        self._env = env
        self._relay = relay_events
        self._poll = float(abort_poll_interval)
        self._copy = bool(copy_results)
        self._aborted_close_grace = float(aborted_close_grace)
        if not self._aborted_close_grace >= 0:
            raise ValueError(f"aborted_close_grace must be >= 0 s, not {aborted_close_grace!r}")
        self._run_aborted = False
        self._group: RankGroup | None = None
        self._engine: Any = None
        # FLARE's Job API exports a component's args from its attributes named like its
        # parameters (`name` or `_name`): every argument is kept as given, so a job
        # exported with `job.export_job` carries all of them.
        job_args: tuple[tuple[str, Any], ...] = (
            ("num_of_processes", num_of_processes),
            ("result", result),
            ("deadlines", deadlines),
            ("gpu", gpu),
            ("resources", resources),
            ("launcher", launcher),
            ("restart", restart),
            ("relay_events", relay_events),
            ("abort_poll_interval", abort_poll_interval),
            ("copy_results", copy_results),
            ("aborted_close_grace", aborted_close_grace),
            ("server_expected_format", server_expected_format),
        )
        for arg, given in job_args:
            setattr(self, "_" + arg, given)

    def add_to_fed_job(self, job: Any, ctx: Any, **kwargs: Any) -> Any:
        """FLARE's Job API hook (``job.to(executor, site, tasks=[...])``): adds this
        executor, and keeps this package's code out of the job's ``custom/`` folder
        (the Job API copies the source of every component class it does not know into
        ``custom/``; a site runs the rankexec it installed, and a copy would make the
        job BYOC and could shadow the installed package)."""
        job.check_kwargs(args_to_check=kwargs, args_expected={"tasks": False})
        keep_rankexec_out_of_custom(job)
        return job.add_executor(obj=self, tasks=kwargs.get("tasks", ["*"]), ctx=ctx)

    # ---- configuration -------------------------------------------------------------

    def _rank_path(self, app_root: str | None) -> str:
        path = self._rank_component
        file, sep, cls = path.partition(":")
        if sep and file.endswith(".py") and not os.path.isabs(file) and app_root:
            candidate = os.path.join(app_root, file)
            if os.path.exists(candidate):
                return f"{candidate}:{cls}"
        return path

    def group_config(self, run_dir: str, app_root: str | None) -> dict[str, Any]:
        """The rankexec executor configuration this adapter runs."""
        # -P: the ranks' module search path does not start with the current directory.
        worker = self._worker or {
            "program": sys.executable,
            "args": ["-P", "-m", "rankexec.worker"],
        }
        env = dict(self._env or {})
        custom = os.path.join(app_root, "custom") if app_root else None
        if custom and os.path.isdir(custom):
            env_set = dict(env.get("set") or {})
            parts = [custom, env_set.get("PYTHONPATH") or os.environ.get("PYTHONPATH", "")]
            env_set["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
            env["set"] = env_set
        cfg: dict[str, Any] = {
            "executor_id": "rank",
            "num_of_processes": self._n,
            "components": [
                {"id": "rank", "path": self._rank_path(app_root), "args": self._rank_args}
            ],
            "worker": worker,
            "log_dir": os.path.join(run_dir, "rankexec"),
            **self._options,
        }
        if env:
            cfg["env"] = env
        return cfg

    # ---- events --------------------------------------------------------------------

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if fl_ctx.get_prop(FROM_RANK_PROP) is not None:
            return  # fired by one of our ranks: do not send it back down
        if event_type == EventType.START_RUN:
            self._start(fl_ctx)
        elif event_type == EventType.END_RUN:
            self._stop(fl_ctx)
        elif event_type == EventType.ABORT_TASK:
            if fl_ctx.get_prop(FLContextKey.RUN_ABORT_REQUESTED):
                # The job itself is aborted (admin abort, a server-side failure), not
                # one task: END_RUN will close the group with the short grace.
                self._run_aborted = True
            if self._group is not None and self._group.abort("FLARE fired _abort_task"):
                self.log_info(fl_ctx, "task aborted in every rank (_abort_task)")
        elif self._relays(event_type):
            self._relay_event(event_type, fl_ctx)

    def _relays(self, event_type: str) -> bool:
        if self._group is None or event_type in _NOT_RELAYED:
            return False
        if isinstance(self._relay, list):
            return event_type in self._relay
        return bool(self._relay)

    def _relay_event(self, event_type: str, fl_ctx: FLContext) -> None:
        group = self._group
        if group is None:
            return
        try:
            group.fire_event(event_type)
        except RankexecError as e:
            self.log_error(fl_ctx, f"event {event_type} failed in the rank group: {e}")

    def _start(self, fl_ctx: FLContext) -> None:
        self._run_aborted = False
        site = fl_ctx.get_identity_name() or "site"
        job_id = str(fl_ctx.get_job_id() or "")
        self._engine = fl_ctx.get_engine()
        workspace = fl_ctx.get_prop(FLContextKey.WORKSPACE_OBJECT)
        if workspace is None and self._engine is not None:
            workspace = self._engine.get_workspace()
        if workspace is not None and job_id:
            run_dir = workspace.get_run_dir(job_id)
        else:
            run_dir = tempfile.mkdtemp(prefix=f"rankexec-{site}-")
        app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT)
        try:
            self._check_policy(fl_ctx, workspace, job_id)
        except site_policy.PolicyError as e:
            self.log_error(fl_ctx, f"rank group refused: {e}")
            self.system_panic(f"rankexec: rank group refused: {e}", fl_ctx)
            return
        t0 = time.perf_counter()
        try:
            group = RankGroup(
                self.group_config(run_dir, app_root),
                on_event=self._on_rank_event,
                site=site,
                job_id=job_id,
                workspace=run_dir,
            )
            group.start({"run_dir": run_dir, "site_name": site, "job_id": job_id})
        except RankexecError as e:
            self.log_error(fl_ctx, f"cannot start the rank group: {e}")
            self.system_panic(f"rankexec: cannot start the rank group: {e}", fl_ctx)
            return
        self._group = group
        self.log_info(
            fl_ctx,
            f"rank group of {self._n} ready in {(time.perf_counter() - t0) * 1e3:.1f} ms "
            f"(pids {group.pids()}; logs in {group.log_dir})",
        )
        self._relay_event(EventType.START_RUN, fl_ctx)

    def _check_policy(self, fl_ctx: FLContext, workspace: Any, job_id: str) -> None:
        """Holds a job to the site's policy (``<site workspace>/local/rankexec.json``)."""
        if workspace is not None:
            path = os.path.join(workspace.get_site_config_dir(), site_policy.FILE_NAME)
        else:
            path = f"<no site workspace>/local/{site_policy.FILE_NAME}"
        policy = site_policy.load(path)
        byoc = _job_has_custom_code(fl_ctx, workspace, job_id)
        if not policy.restricts(byoc):
            self.log_info(fl_ctx, f"job with custom code: not restricted by {path}")
            return
        policy.check(
            rank_component=self._rank_component,
            worker=self._worker,
            launcher=self._options["launcher"],
            env=self._env,
            **self._policy_subject(fl_ctx),
        )

    def _policy_subject(self, fl_ctx: FLContext) -> dict[str, Any]:
        """What else of the job the site's policy checks (``ScriptExecutor``: its script
        and arguments); nothing for a component."""
        del fl_ctx
        return {}

    def _stop(self, fl_ctx: FLContext) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        try:
            group.fire_event(EventType.END_RUN)
        except RankexecError as e:
            self.log_warning(fl_ctx, f"END_RUN did not reach every rank: {e}")
        if self._run_aborted:
            # An aborted job's ranks had END_RUN; their own exit is not waited for.
            report = group.close(grace=self._aborted_close_grace)
        else:
            report = group.close()
        how = f"after {report['escalated']}" if report["escalated"] else "cooperatively"
        self.log_info(
            fl_ctx,
            f"rank group stopped {how} in {report['elapsed_s'] * 1e3:.1f} ms "
            f"(pids {report['pids']})",
        )
        if report["unkillable"]:
            self.log_error(fl_ctx, f"processes survived SIGKILL: {report['unkillable']}")

    def _on_rank_event(self, event: str, rank: int | None, props: dict) -> None:
        engine = self._engine
        if engine is None:
            return
        ctx = engine.new_context()
        ctx.set_prop(FROM_RANK_PROP, rank, private=True, sticky=False)
        plain = {k: v for k, v in props.items() if not k.startswith("__")}
        ctx.set_prop(EVENT_PROPS_PROP, plain, private=True, sticky=False)
        self.fire_event(event, ctx)
        return

    # ---- tasks ---------------------------------------------------------------------

    def execute(
        self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal
    ) -> Shareable:
        group = self._group
        if group is None:
            self.log_error(fl_ctx, "the rank group is not running (START_RUN failed)")
            return self._failed("the rank group is not running")
        try:
            meta, blobs, dxo = self._task_input(shareable)
        except Unsendable as e:
            self.log_error(fl_ctx, f"task {task_name}: cannot send to the ranks: {e}")
            return self._failed(f"task input {e}")
        result = self._run(group, task_name, meta, blobs, fl_ctx, abort_signal)
        if isinstance(result, Shareable):
            return result
        try:
            return self._retried(
                self._reply(result.meta, result.blobs, meta.get(ARRAYS_KEY), dxo), result.retries
            )
        except (Unsendable, ValueError) as e:
            self.log_error(fl_ctx, f"task {task_name}: cannot return the ranks' result: {e}")
            return self._failed(f"task result {e}")

    def _run(
        self,
        group: RankGroup,
        task_name: str,
        meta: dict[str, Any],
        blobs: dict[str, Any],
        fl_ctx: FLContext,
        abort_signal: Signal,
        consume: bool = False,
    ) -> TaskResult | Shareable:
        """Runs the task on every rank with FLARE's abort signal: the ranks' result, or
        the reply for FLARE when it was aborted or failed (logged). With ``consume``,
        ``blobs`` is emptied once it is in shared memory (``RankGroup.execute``)."""
        try:
            result = group.execute(
                task_name,
                meta,
                blobs,
                abort_check=lambda: abort_signal.triggered,
                poll_s=self._poll,
                abort_reason="FLARE's abort_signal fired",
                consume=consume,
            )
        except Aborted as e:
            self.log_info(fl_ctx, f"task {task_name} aborted in every rank: {e}")
            return self._retried(make_reply(ReturnCode.TASK_ABORTED), e.retries)
        except RankFailed as e:
            self.log_error(fl_ctx, f"task {task_name}: {e}\n{e.report}")
            return self._retried(self._failed(str(e)), e.retries)
        except RankexecError as e:
            self.log_error(fl_ctx, f"task {task_name} failed: {e}")
            return self._retried(self._failed(str(e)), e.retries)
        if result.retries:
            causes = "; ".join(_describe_retry(r) for r in result.retries)
            self.log_warning(
                fl_ctx,
                f"task {task_name} succeeded after {len(result.retries)} "
                f"retr{'y' if len(result.retries) == 1 else 'ies'} ({causes})",
            )
        if abort_signal.triggered:
            return self._retried(make_reply(ReturnCode.TASK_ABORTED), result.retries)
        return result

    @staticmethod
    def _retried(reply: Shareable, retries: list[dict[str, Any]]) -> Shareable:
        """``reply`` with the ``rankexec_retries`` header when the task was retried."""
        if retries:
            reply.set_header(RETRIES_HEADER, [dict(r) for r in retries])
        return reply

    @staticmethod
    def _task_input(shareable: Shareable) -> tuple[dict[str, Any], dict[str, Any], DXO | None]:
        """(meta, blobs, the DXO or None): every array, tensor, value and member of the
        task's data, or ``Unsendable`` naming the key that cannot travel."""
        meta: dict[str, Any] = {
            "current_round": plain(
                shareable.get_header(AppConstants.CURRENT_ROUND), "header current_round"
            ),
            "num_rounds": plain(shareable.get_header(AppConstants.NUM_ROUNDS), "header num_rounds"),
        }
        try:
            dxo = from_shareable(shareable)
        except (ValueError, TypeError, KeyError):
            dxo = None
        if dxo is None:
            # Not a DXO: its own items travel (usually none; the headers are above).
            items = {k: v for k, v in shareable.items() if k != ReservedHeaderKey.HEADERS}
            packed, blobs = pack_data(items, where="shareable")
            meta.update(packed)
            return meta, blobs, None
        if not isinstance(dxo.data, dict):
            raise Unsendable(
                "data", f"the {dxo.data_kind} DXO's data is a {type(dxo.data).__name__}, not a dict"
            )
        packed, blobs = pack_data(dxo.data, kind=dxo.data_kind, meta=dxo.meta or {})
        meta.update(packed)
        return meta, blobs, dxo

    def _reply(
        self,
        out_meta: dict[str, Any],
        out_blobs: dict[str, Any],
        in_specs: dict[str, Any] | None,
        dxo: DXO | None,
    ) -> Shareable:
        """The ranks' result as FLARE's reply: a DXO of every array, tensor, value and
        member they returned; their other meta in the ``rankexec_meta`` header."""
        data = unpack_data(out_meta, out_blobs, in_specs, member=_member, copy=self._copy)
        extra = {k: v for k, v in out_meta.items() if k not in _DXO_KEYS}
        if dxo is None and not data:
            reply = make_reply(ReturnCode.OK)
            reply.set_header(RESULT_META_HEADER, extra)
            return reply
        kind = out_meta.get(KIND_KEY) or (dxo.data_kind if dxo is not None else DataKind.WEIGHTS)
        dxo_meta = dict(out_meta.get(META_KEY) or {})
        steps = out_meta.get(MetaKey.NUM_STEPS_CURRENT_ROUND)
        if steps is not None:
            dxo_meta[MetaKey.NUM_STEPS_CURRENT_ROUND] = steps
        reply = DXO(data_kind=kind, data=data, meta=dxo_meta).to_shareable()
        if extra:
            reply.set_header(RESULT_META_HEADER, extra)
        return reply

    @staticmethod
    def _failed(error: str) -> Shareable:
        reply = make_reply(ReturnCode.EXECUTION_EXCEPTION)
        reply.set_header(ERROR_HEADER, error)
        return reply


def _describe_retry(r: dict[str, Any]) -> str:
    """One try a rank's death ended, as the executor's errors write it."""
    when = f"try {r['attempt']}" if r["attempt"] else "before the task"
    return f"{when}: rank {r['rank']}: {r['cause']}"
