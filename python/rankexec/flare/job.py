"""The Job API side: ``job.to(ScriptRunner(...), site)`` exports a ``ScriptExecutor``.

``rankexec.flare.job.ScriptRunner`` takes the arguments of FLARE's
``nvflare.job_config.script_runner.ScriptRunner`` that still mean something here
(``script``, ``script_args``, ``framework``, ``server_expected_format``,
``params_transfer_type``) plus ``num_of_processes``, ``all_ranks_receive`` and
rankexec's group arguments, and adds to the job what FLARE's runner adds: the
executor (for ``tasks``, default every task) and the script as a custom resource
(``custom/<script file>``)::

    from nvflare.app_opt.pt.job_config.fed_avg import FedAvgJob
    from rankexec.flare.job import ScriptRunner

    job = FedAvgJob(name="digits", n_clients=2, num_rounds=3, initial_model=Net())
    for site in ("site-1", "site-2"):
        job.to(ScriptRunner("client.py", script_args="--epochs 2", num_of_processes=2), site)
    job.export_job("jobs")
"""

from __future__ import annotations

import os
from typing import Any

from nvflare.client.config import ExchangeFormat, TransferType
from nvflare.fuel.utils.constants import FrameworkType

from rankexec.flare.script_executor import ScriptExecutor

__all__ = ["ScriptRunner"]

_FORMAT_OF = {
    FrameworkType.PYTORCH: ExchangeFormat.PYTORCH,
    FrameworkType.TENSORFLOW: ExchangeFormat.KERAS_LAYER_WEIGHTS,
    FrameworkType.NUMPY: ExchangeFormat.NUMPY,
    FrameworkType.RAW: ExchangeFormat.RAW,
}


class ScriptRunner:
    """Adds a Client API script, run by a rankexec rank group, to a FedJob."""

    def __init__(
        self,
        script: str,
        script_args: str | list[str] = "",
        num_of_processes: int = 1,
        framework: FrameworkType = FrameworkType.PYTORCH,
        server_expected_format: ExchangeFormat = ExchangeFormat.NUMPY,
        params_transfer_type: TransferType = TransferType.FULL,
        all_ranks_receive: bool = False,
        **group_args: Any,
    ) -> None:
        """
        Args:
            script: the Client API script on this machine; it is shipped in the job's
                ``custom/`` folder and run there as ``custom/<its name>``.
            script_args: its arguments: a string (split like a shell) or a list.
            num_of_processes: ranks in each site's group.
            framework: FLARE's ``FrameworkType`` of the script (``PYTORCH``: torch
                tensors, ``NUMPY``: arrays, ``RAW``); it sets ``ScriptExecutor``'s
                ``params_exchange_format``.
            server_expected_format: FLARE's ``ExchangeFormat`` of the server's side.
            params_transfer_type: FLARE's ``TransferType`` (``DIFF`` sends the
                difference to what was received).
            all_ranks_receive: as ``ScriptExecutor``'s: every rank receives the model.
            group_args: any other ``ScriptExecutor`` argument (``launcher``,
                ``deadlines``, ``gpu``, ``resources``, ``env``, ``restart``,
                ``relay_events``, ``abort_poll_interval``, the task names).
        """
        fmt = _FORMAT_OF.get(FrameworkType(framework))
        if fmt is None:
            raise ValueError(f"framework {framework} is not supported")
        self._script = script
        self._executor_args = {
            "script": f"custom/{os.path.basename(script)}",
            "script_args": script_args,
            "num_of_processes": num_of_processes,
            "params_exchange_format": fmt.value,
            "server_expected_format": ExchangeFormat(server_expected_format).value,
            "params_transfer_type": TransferType(params_transfer_type).value,
            "all_ranks_receive": all_ranks_receive,
            **group_args,
        }

    def executor(self) -> ScriptExecutor:
        """The executor this runner adds."""
        return ScriptExecutor(**self._executor_args)

    def add_to_fed_job(self, job: Any, ctx: Any, **kwargs: Any) -> dict:
        """FLARE's Job API hook (``job.to(runner, site, tasks=[...])``)."""
        job.check_kwargs(args_to_check=kwargs, args_expected={"tasks": False})
        tasks = kwargs.get("tasks", ["*"])
        # rankexec is installed on the sites (its core is compiled): never copied into
        # the job's custom code, which would shadow it.
        packages = list(getattr(getattr(job, "job", None), "app_packages", None) or [])
        if "rankexec" not in packages:
            job.set_app_packages([*packages, "rankexec"])
        job.add_executor(self.executor(), tasks=tasks, ctx=ctx)
        job.add_resources(resources=[self._script], ctx=ctx)
        return {}
