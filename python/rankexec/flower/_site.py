"""What the node's site allows: where the group's program, launcher, GPUs and
environment come from.

Why: a Flower run's config and app are chosen by whoever submits the run; what runs on
a node's machine is the operator's call. These settings are read only from the node's
side: the SuperNode's ``--node-config`` (``Context.node_config``) and a site file it
names (``rankexec-site="/etc/rankexec/flower.json"``) or ``$RANKEXEC_FLOWER_SITE`` in
the SuperNode's environment. The app's own settings (``num_of_processes``,
``deadlines``, ``resources``, ``restart``) are requests, bounded by the site.

Node-config keys (all optional): ``rankexec-site``, ``rankexec-launcher`` (a rankexec
launcher name: ``builtin``, ``torchrun``...), ``rankexec-gpus`` (comma-separated
devices), ``rankexec-max-processes``, ``rankexec-lease`` (idle seconds),
``rankexec-superlink`` (an insecure SuperLink's address for the run-status check),
``rankexec-python`` (the ranks' interpreter).

Site file (JSON), all optional: ``launcher`` (any rankexec ``launcher`` value),
``launchers`` (launcher names an app may ask for; default ``["builtin"]``), ``gpu``
(rankexec's ``gpu`` object; its keys win over the app's, and an app may name devices
only where the site names them too), ``env`` (rankexec's ``env`` object; an app cannot
set one), ``python``, ``max_processes`` (default 64), ``lease_s``, ``superlink``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["SiteError", "group_config", "load"]


class SiteError(ValueError):
    """The site's settings are unreadable, or the app asks for what the site does not allow."""


def load(node_config: Mapping[str, Any]) -> dict[str, Any]:
    """The site's settings, from the node config and the site file it (or the
    environment) names."""
    site: dict[str, Any] = {}
    path = node_config.get("rankexec-site") or os.environ.get("RANKEXEC_FLOWER_SITE")
    if path:
        try:
            site = dict(json.loads(Path(str(path)).read_text()))
        except (OSError, ValueError) as e:
            raise SiteError(f"cannot read the rankexec site file {path}: {e}") from e
    if "rankexec-launcher" in node_config:
        site["launcher"] = str(node_config["rankexec-launcher"])
    if "rankexec-gpus" in node_config:
        devices = [d.strip() for d in str(node_config["rankexec-gpus"]).split(",") if d.strip()]
        site["gpu"] = {**dict(site.get("gpu") or {}), "devices": devices}
    for key, name, conv in (
        ("rankexec-max-processes", "max_processes", int),
        ("rankexec-lease", "lease_s", float),
        ("rankexec-superlink", "superlink", str),
        ("rankexec-python", "python", str),
    ):
        if key in node_config:
            site[name] = conv(node_config[key])
    return site


def _launcher_name(launcher: Any) -> str:
    if isinstance(launcher, str):
        return launcher
    if isinstance(launcher, Mapping) and len(launcher) == 1:
        return str(next(iter(launcher)))
    raise SiteError(f"not a rankexec launcher: {launcher!r}")


def group_config(site: Mapping[str, Any], app: Mapping[str, Any], log_dir: str) -> dict[str, Any]:
    """The ``RankGroup`` configuration for the app's settings under the site's rules."""
    n = int(app.get("num_of_processes", 1))
    limit = int(site.get("max_processes", 64))
    if not 1 <= n <= limit:
        raise SiteError(f"num_of_processes={n}: this node allows 1 to {limit}")
    cfg: dict[str, Any] = {
        "executor_id": "flower",
        "num_of_processes": n,
        "components": [{"id": "flower", "path": "rankexec.flower._rank:FlowerRank"}],
        "worker": {
            "program": str(site.get("python") or sys.executable),
            "args": ["-P", "-m", "rankexec.worker"],
        },
        "log_dir": log_dir,
    }
    for key in ("deadlines", "resources", "restart"):
        if app.get(key) is not None:
            cfg[key] = app[key]
    if "launcher" in site:
        cfg["launcher"] = site["launcher"]
    elif app.get("launcher") is not None:
        allowed = list(site.get("launchers") or ["builtin"])
        name = _launcher_name(app["launcher"])
        if name not in allowed:
            raise SiteError(
                f"the app asks for the {name!r} launcher; this node allows {allowed}"
                " (the site file's `launchers`)"
            )
        cfg["launcher"] = app["launcher"]
    app_gpu = dict(app.get("gpu") or {})
    site_gpu = dict(site.get("gpu") or {})
    if app_gpu.get("devices") and "devices" not in site_gpu:
        raise SiteError(
            "the app names GPU devices; on this node they come from the site"
            " (--node-config rankexec-gpus=... or the site file's gpu.devices)"
        )
    gpu = {**app_gpu, **site_gpu}
    if gpu:
        cfg["gpu"] = gpu
    if site.get("env") is not None:
        cfg["env"] = site["env"]
    return cfg
