"""The Recipe API side: ``use_rank_groups(recipe, num_of_processes=2)``.

FLARE 2.9's recipes (``FedAvgRecipe``, ``FedOptRecipe``, ``ScaffoldRecipe``,
``CyclicRecipe``, ``FedEvalRecipe``, ...) put a client's Client API script into the job
with FLARE's ``ScriptRunner``, which adds a ``ClientAPIExecutor``. One call makes the
recipe run those scripts as rank groups::

    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
    from nvflare.recipe import SimEnv, add_cross_site_evaluation, add_experiment_tracking
    from rankexec.flare.recipe import use_rank_groups

    recipe = FedAvgRecipe(name="digits", model=Net(), min_clients=2, num_rounds=3,
                          train_script="client.py", train_args="--epochs 2")
    add_cross_site_evaluation(recipe)
    add_experiment_tracking(recipe, "tensorboard")
    use_rank_groups(recipe, num_of_processes=2)
    recipe.execute(SimEnv(num_clients=2))   # or PocEnv(...), ProdEnv(...), --export

When the recipe is exported or run (``export``, ``run``, ``execute``: FLARE calls the
recipe's ``finalize()`` first, after it has built its client apps, per-site ones
included), every ``ClientAPIExecutor`` in the job is replaced by a
``rankexec.flare.ScriptExecutor`` with what FLARE's executor was given: the script
(``custom/<script>``, as FLARE's ``ScriptRunner`` ships it) and its arguments, the task
names, ``train_with_evaluation`` and the exchange formats, plus ``num_of_processes`` and
the group arguments given here (``launcher``, ``deadlines``, ``gpu``, ``resources``,
``env``, ``restart``, ``all_ranks_receive``, ...). So the order of calls does not
matter: ``set_per_site_config``, ``add_cross_site_evaluation`` (whose validate and
submit_model tasks go to the same executor, as with FLARE's), ``add_experiment_tracking``
and the rest may come before or after. The job marks ``rankexec`` as an installed
package: sites need ``rankexec`` installed (its core is compiled), and the job never
ships a copy of it in ``custom/``.

``sites`` gives sites their own group arguments (``{"site-1": {"num_of_processes": 4}}``);
it needs per-site client apps (``set_per_site_config``), as FLARE's per-site settings do.

Caveats: the launch command of an ``external_process`` executor (``python3 -u``,
``python3 -m nvflare.app_opt.pt.torchrun_node --nproc-per-node=N``) is dropped: the group
starts the ranks, with torchrun's variables set, and ``num_of_processes`` says how many.
FLARE's process options (``launch_once``, ``launch_timeout``, ``shutdown_timeout``,
heartbeats) have no counterpart and are dropped; ``memory_gc_rounds`` and
``cuda_empty_cache`` are too, with a warning when set. An ``attach`` executor (a trainer
started outside FLARE) has no script to run and is refused, as is a recipe whose job
holds no Client API executor at all. The replacement reads the values FLARE's own export
reads (``_<arg>`` attributes of ``ClientAPIExecutor``); tested with nvflare 2.9.0.
"""

from __future__ import annotations

import os
import shlex
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from nvflare.apis.job_def import ALL_SITES
from nvflare.app_common.executors.client_api_executor import ClientAPIExecutor
from nvflare.recipe.spec import Recipe

from rankexec.flare.executor import keep_rankexec_out_of_custom
from rankexec.flare.script_executor import ScriptExecutor

__all__ = ["RankGroups", "use_rank_groups"]

# What the replacement takes over from FLARE's executor, unchanged.
_FROM_FLARE = (
    "train_task_name",
    "evaluate_task_name",
    "submit_model_task_name",
    "train_with_evaluation",
    "params_exchange_format",
    "server_expected_format",
    "params_transfer_type",
)
_FROM_RECIPE = frozenset({"script", "script_args", *_FROM_FLARE})
# FLARE options with no counterpart in a rank group that a user may have set on purpose.
_DROPPED_WITH_WARNING = {"memory_gc_rounds": 0, "cuda_empty_cache": False}
_ATTR = "_rankexec_rank_groups"

RecipeT = TypeVar("RecipeT", bound=Recipe)


class RankGroups:
    """What ``use_rank_groups`` put on a recipe: the group arguments, per site."""

    def __init__(
        self,
        num_of_processes: int,
        group_args: Mapping[str, Any],
        sites: Mapping[str, Mapping[str, Any]] | None,
    ) -> None:
        self.group_args: dict[str, Any] = {"num_of_processes": num_of_processes, **group_args}
        self.sites: dict[str, dict[str, Any]] = {}
        _check_group_args(self.group_args, "use_rank_groups")
        if sites is not None:
            if not isinstance(sites, Mapping):
                raise TypeError(f"sites must map site names to dicts, not {type(sites).__name__}")
            for site, args in sites.items():
                if not isinstance(site, str) or not isinstance(args, Mapping):
                    raise TypeError(f"sites must map site names to dicts: {site!r}: {args!r}")
                merged = {**self.group_args, **args}
                _check_group_args(merged, f"sites[{site!r}]")
                self.sites[site] = merged

    def apply(self, job: Any) -> int:
        """Replaces every ``ClientAPIExecutor`` of ``job`` (a FLARE ``FedJob``); returns
        how many executors of the job are now ``ScriptExecutor``s. Idempotent."""
        deploy_map: dict[str, Any] = getattr(job, "_deploy_map", {})
        if self.sites:
            if ALL_SITES in deploy_map:
                raise ValueError(
                    "use_rank_groups(sites=...) needs per-site client apps, but this recipe's "
                    "client app serves all sites: call set_per_site_config(recipe, ...) "
                    "right after constructing the recipe"
                )
            unknown = sorted(set(self.sites) - set(deploy_map))
            if unknown:
                raise ValueError(
                    f"use_rank_groups(sites=...) names sites without a client app: {unknown} "
                    f"(the job's sites: {sorted(t for t in deploy_map if t != 'server')})"
                )
        groups = 0
        for target, app in deploy_map.items():
            for item in getattr(app.app_config, "executors", None) or []:
                if isinstance(item.executor, ClientAPIExecutor):
                    args = self.sites.get(target, self.group_args)
                    item.executor = _script_executor(item.executor, target, args)
                if isinstance(item.executor, ScriptExecutor):
                    groups += 1
        if groups:
            keep_rankexec_out_of_custom(job)
        return groups


def use_rank_groups(
    recipe: RecipeT,
    num_of_processes: int = 1,
    *,
    sites: Mapping[str, Mapping[str, Any]] | None = None,
    **group_args: Any,
) -> RecipeT:
    """Makes ``recipe`` (a FLARE 2.9 ``Recipe``) run its Client API scripts as rank
    groups of ``num_of_processes`` ranks; ``group_args`` are ``ScriptExecutor``'s
    (``launcher``, ``deadlines``, ``gpu``, ``resources``, ``env``, ``restart``,
    ``all_ranks_receive``, ``relay_events``, ``abort_poll_interval``), ``sites`` per-site
    overrides of them. Returns the recipe. See the module docs.

    Args:
        recipe: a FLARE 2.9 ``Recipe`` whose clients run a Client API script
            (``ClientAPIExecutor``); its script, arguments and exchange formats are
            kept.
        num_of_processes: ranks in each site's group.
        sites: per-site overrides, ``{"site-1": {"num_of_processes": 4, "gpu": ...}}``:
            for that site, these keys replace the ones given here.
        group_args: ``ScriptExecutor``'s other arguments for every site (``launcher``,
            ``deadlines``, ``gpu``, ``resources``, ``env``, ``restart``,
            ``all_ranks_receive``, ``relay_events``, ``abort_poll_interval``); the
            script's own come from the recipe and are refused here.
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"use_rank_groups takes a FLARE Recipe, not {type(recipe).__name__}")
    if getattr(recipe, _ATTR, None) is not None:
        raise RuntimeError("use_rank_groups was already called on this recipe")
    groups = RankGroups(num_of_processes, group_args, sites)
    finalize: Callable[..., Any] = recipe.finalize

    def finalize_with_rank_groups(*args: Any, **kwargs: Any) -> Any:
        result = finalize(*args, **kwargs)
        if not groups.apply(recipe._job):
            raise ValueError(
                f"use_rank_groups: {type(recipe).__name__} {getattr(recipe, 'name', '')!r} "
                "has no Client API script executor (ClientAPIExecutor) to run as rank groups"
            )
        return result

    # FLARE's export() and run() call finalize() once the client apps exist.
    setattr(recipe, "finalize", finalize_with_rank_groups)  # noqa: B010
    setattr(recipe, _ATTR, groups)
    return recipe


def _check_group_args(args: Mapping[str, Any], where: str) -> None:
    taken = sorted(set(args) & _FROM_RECIPE)
    if taken:
        raise ValueError(f"{where}: {taken} come from the recipe's script runner, not from here")
    try:
        # The executor checks its arguments when it is built: build one now, so that a
        # mistake shows at this call, not at export.
        ScriptExecutor(script="check.py", **args)
    except TypeError as e:
        raise TypeError(f"{where}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _script_executor(
    flare: ClientAPIExecutor, target: str, args: Mapping[str, Any]
) -> ScriptExecutor:
    mode = flare.execution_mode
    if mode == "in_process":
        script = str(getattr(flare, "_task_script_path", "") or "")
        script_args = str(getattr(flare, "_task_script_args", "") or "")
        # FLARE's ScriptRunner ships a relative script under custom/ and runs an
        # absolute one where it is (it must exist on the site).
        if script and not os.path.isabs(script):
            script = os.path.normpath(os.path.join("custom", script))
    elif mode == "external_process":
        command = getattr(flare, "_command", None) or []
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        at = next((i for i, a in enumerate(argv) if a.endswith(".py")), None)
        if at is None:
            raise ValueError(
                f"use_rank_groups: {target}'s ClientAPIExecutor runs {argv!r}, which names "
                "no .py script for the ranks to run"
            )
        script, script_args = argv[at], shlex.join(argv[at + 1 :])
    else:
        raise ValueError(
            f"use_rank_groups: {target}'s ClientAPIExecutor is in {mode!r} mode (a trainer "
            "started outside FLARE): there is no script for a rank group to run"
        )
    if not script.endswith(".py"):
        raise ValueError(f"use_rank_groups: {target}'s script {script!r} is not a .py file")
    for name, default in _DROPPED_WITH_WARNING.items():
        value = getattr(flare, f"_{name}", default)
        if value != default:
            warnings.warn(
                f"use_rank_groups: {target}: {name}={value!r} is an option of FLARE's "
                "ClientAPIExecutor that a rank group does not apply",
                UserWarning,
                stacklevel=2,
            )
    taken = {name: getattr(flare, f"_{name}") for name in _FROM_FLARE}
    return ScriptExecutor(script=script, script_args=script_args, **taken, **args)
