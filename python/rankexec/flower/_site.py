"""What the node's site allows, read and enforced by the node's host.

Why: a Flower run's config and app are chosen by whoever submits the run; what runs on
a node's machine is the operator's call. So the rules are read only by the node's host
(``rankexec.flower.host``), never in the app's ``flwr-clientapp`` process: from the
SuperNode's ``--node-config`` (the host reads the SuperNode's command line) and a site
file it names (``rankexec-site="/etc/rankexec/flower.json"``), or
``$RANKEXEC_FLOWER_SITE`` in the SuperNode's environment (the host's own where there
is no SuperNode: the Simulation Engine, an explicit host; an explicit host may also be
given ``--site FILE``). The app's process sends *requests* (``REQUEST_KEYS``); the host
builds the group's configuration from the site's rules and matches each request
exactly, as FLARE's site policy does; anything else is refused with a ``SiteError``
naming the rule.

Node-config keys (all optional): ``rankexec-site``, ``rankexec-launcher`` (a rankexec
launcher value the ranks always use), ``rankexec-gpus`` (comma-separated devices),
``rankexec-max-processes``, ``rankexec-max-runs``, ``rankexec-lease`` (idle seconds),
``rankexec-superlink`` (the SuperLink's address for the run-status check; default: the
SuperNode's ``--superlink``),
``rankexec-python`` (the ranks' interpreter).

Site file (JSON object; unknown keys refuse every request), all optional:

- ``launcher``: the launcher the ranks always use (any rankexec ``launcher`` value);
  an app's own launcher request is then ignored;
- ``launchers``: the launchers an app may ask for, matched exactly: ``"builtin"``, a
  kind (``"torchrun"``, ``"mpirun"``, ``"srun"``: that launcher with no extra
  arguments) or a whole launcher object (``{"mpirun": {"extra_args": ["-x", "A"]}}``
  allows exactly those arguments); default ``["builtin"]``;
- ``gpu``: rankexec's ``gpu`` object; its keys win over the app's; an app may name
  devices only among the site's ``gpu.devices``;
- ``env``: rankexec's ``env`` object for the ranks; an app cannot set one;
- ``python``: the ranks' interpreter (default: the host's); an app cannot name one;
- ``max_processes`` (default 64): ranks per group;
- ``max_runs`` (default 4): runs with a live group on the node at once; a further
  run's message is refused naming the runs that hold the node;
- ``lease_s`` (default 300), ``superlink``: the host's idle lease and run-status check;
- ``log_dir``: a folder the operator keeps for the ranks' logs (``run-<id>`` under it,
  kept); without it the logs live in a private folder on disk
  (``$XDG_STATE_HOME/rankexec-flower/node-<id>``) and go with their run.
- ``max_rank_log``: the most bytes of each rank's stdout, and of its stderr, kept on
  disk while a group lives (rankexec's ``max_rank_log``: a size such as ``"4MiB"`` or
  bytes, at least 64 KiB; default 64 MiB); an app cannot set one.

Caveats: the request keys ``deadlines``, ``resources`` and ``restart`` are the app's
own bounds and pass as they are (rankexec's configuration parser refuses unknown
fields); everything that chooses a program, an argument, a variable or a device is the
site's.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "REQUEST_KEYS",
    "SiteError",
    "group_config",
    "load",
    "parse_node_config",
    "proc_argv",
    "proc_environ",
    "site_file_from_env",
    "supernode_settings",
]

REQUEST_KEYS = ("num_of_processes", "launcher", "gpu", "resources", "deadlines", "restart")
_SITE_KEYS = {
    "launcher",
    "launchers",
    "gpu",
    "env",
    "python",
    "max_processes",
    "max_runs",
    "lease_s",
    "superlink",
    "log_dir",
    "max_rank_log",
}
_KINDS = ("torchrun", "mpirun", "srun")
_GPU_KEYS = ("mode", "devices", "require_gpu")
# Request keys that name what only the site chooses, and the rule that says so.
_SITE_ONLY = {
    "python": ("the ranks' interpreter is the site's", "python"),
    "worker": ("the ranks' program is the site's Python `-m rankexec.worker`", "python"),
    "env": ("the ranks' environment is the site's", "env"),
    "log_dir": ("the ranks' logs go where the site says", "log_dir"),
    "max_rank_log": ("the ranks' logs are bounded by the site", "max_rank_log"),
    "components": ("the ranks run rankexec.flower's own component", "python"),
}


class SiteError(ValueError):
    """The site's settings are unreadable, or a request asks for what the site does not
    allow (the message names the site's rule)."""


def parse_node_config(text: str) -> dict[str, Any]:
    """A SuperNode's ``--node-config`` string, parsed as Flower parses it."""
    from flwr.common.config import parse_config_args

    try:
        return dict(parse_config_args([text]))
    except Exception as e:
        raise SiteError(f"cannot parse the SuperNode's --node-config {text!r}: {e}") from e


def load(node_config: Mapping[str, Any], site_file: str | None = None) -> dict[str, Any]:
    """The site's settings: the site file that the node config (else ``site_file``, the
    SuperNode's ``$RANKEXEC_FLOWER_SITE`` or the host's ``--site``) names, then the node
    config's keys over it."""
    site: dict[str, Any] = {}
    path = node_config.get("rankexec-site") or site_file
    if path:
        try:
            raw = json.loads(Path(str(path)).read_text())
        except (OSError, ValueError) as e:
            raise SiteError(f"cannot read the rankexec site file {path}: {e}") from e
        if not isinstance(raw, dict):
            raise SiteError(f"the rankexec site file {path} must hold a JSON object")
        unknown = sorted(set(raw) - _SITE_KEYS)
        if unknown:
            raise SiteError(
                f"the rankexec site file {path} has unknown key(s) {unknown}"
                f" (known: {sorted(_SITE_KEYS)})"
            )
        site = dict(raw)
        site["_file"] = str(path)
    if "rankexec-launcher" in node_config:
        site["launcher"] = str(node_config["rankexec-launcher"])
    if "rankexec-gpus" in node_config:
        devices = [d.strip() for d in str(node_config["rankexec-gpus"]).split(",") if d.strip()]
        site["gpu"] = {**dict(site.get("gpu") or {}), "devices": devices}
    for key, name, conv in (
        ("rankexec-max-processes", "max_processes", int),
        ("rankexec-max-runs", "max_runs", int),
        ("rankexec-lease", "lease_s", float),
        ("rankexec-superlink", "superlink", str),
        ("rankexec-python", "python", str),
    ):
        if key in node_config:
            try:
                site[name] = conv(node_config[key])
            except (TypeError, ValueError) as e:
                raise SiteError(f"node config {key}={node_config[key]!r}: {e}") from e
    return site


def _where(site: Mapping[str, Any], key: str) -> str:
    file = site.get("_file")
    return f"`{key}` in the site file {file}" if file else f"`{key}` of the site (no site file)"


def _launcher(x: Any) -> Any:
    """A launcher value in one form, so that equal launchers compare equal."""
    if isinstance(x, str) and x in _KINDS:
        return {x: {"extra_args": []}}
    if isinstance(x, Mapping) and len(x) == 1:
        ((kind, args),) = x.items()
        if kind in _KINDS and isinstance(args, Mapping):
            return {kind: {"extra_args": [], **args}}
        if kind == "builtin":
            return "builtin"
    return x


def _check_launcher(site: Mapping[str, Any], launcher: Any) -> Any:
    if "launcher" in site:
        return site["launcher"]
    if launcher is None:
        return None
    allowed = list(site.get("launchers") or ["builtin"])
    if _launcher(launcher) in [_launcher(x) for x in allowed]:
        return launcher
    raise SiteError(
        f"the app asks for the launcher {json.dumps(launcher)}; this node allows exactly"
        f" {json.dumps(allowed)} ({_where(site, 'launchers')})"
    )


def _check_gpu(site: Mapping[str, Any], gpu: Any) -> dict[str, Any]:
    if gpu is not None and not isinstance(gpu, Mapping):
        raise SiteError(f"the request's gpu {json.dumps(gpu)} is not an object")
    app_gpu = dict(gpu or {})
    unknown = sorted(set(app_gpu) - set(_GPU_KEYS))
    if unknown:
        raise SiteError(f"the request's gpu has unknown key(s) {unknown} (known: {_GPU_KEYS})")
    site_gpu = dict(site.get("gpu") or {})
    asked = app_gpu.get("devices")
    if asked:
        if "devices" not in site_gpu:
            raise SiteError(
                "the app names GPU devices; on this node they come from the site"
                f" (--node-config rankexec-gpus=... or {_where(site, 'gpu.devices')})"
            )
        extra = [str(d) for d in asked if str(d) not in [str(s) for s in site_gpu["devices"]]]
        if extra:
            raise SiteError(
                f"the app asks for GPU devices {extra}; this node allows"
                f" {site_gpu['devices']} (rankexec-gpus or {_where(site, 'gpu.devices')})"
            )
        site_gpu["devices"] = list(asked)
    return {**app_gpu, **site_gpu}


def group_config(
    site: Mapping[str, Any], request: Mapping[str, Any], log_dir: str
) -> dict[str, Any]:
    """The ``RankGroup`` configuration for an app's request under the site's rules;
    ``SiteError`` names the rule a request breaks."""
    if not isinstance(request, Mapping):
        raise SiteError("the request is not an object")
    for key in request:
        if key in _SITE_ONLY:
            what, rule = _SITE_ONLY[key]
            raise SiteError(f"the request sets `{key}`: on this node {what} ({_where(site, rule)})")
        if key not in REQUEST_KEYS:
            raise SiteError(
                f"the request sets `{key}`: a request may set only {list(REQUEST_KEYS)}"
                f" (the site's rules: {site.get('_file') or 'no site file'})"
            )
    n = request.get("num_of_processes", 1)
    limit = int(site.get("max_processes", 64))
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= limit:
        raise SiteError(
            f"num_of_processes={n!r}: this node allows 1 to {limit}"
            f" (rankexec-max-processes or {_where(site, 'max_processes')})"
        )
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
        value = request.get(key)
        if value is not None:
            if not isinstance(value, Mapping):
                raise SiteError(f"the request's {key} {json.dumps(value)} is not an object")
            cfg[key] = dict(value)
    launcher = _check_launcher(site, request.get("launcher"))
    if launcher is not None:
        cfg["launcher"] = launcher
    gpu = _check_gpu(site, request.get("gpu"))
    if gpu:
        cfg["gpu"] = gpu
    if site.get("env") is not None:
        cfg["env"] = site["env"]
    cap = site.get("max_rank_log")
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, (int, str)):
            where = _where(site, "max_rank_log")
            raise SiteError(
                f'max_rank_log {json.dumps(cap)} is not a size (bytes, or a string such as "4MiB")'
                f" ({where})"
            )
        cfg["max_rank_log"] = cap
    return cfg


def site_file_from_env(environ: Mapping[str, str]) -> str | None:
    """``$RANKEXEC_FLOWER_SITE`` in an environment (the SuperNode's or the host's)."""
    return environ.get("RANKEXEC_FLOWER_SITE") or None


def proc_environ(pid: int) -> dict[str, str]:
    """A process's environment as the kernel holds it (``/proc/PID/environ``)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def proc_argv(pid: int) -> list[str]:
    """A process's command line (``/proc/PID/cmdline``)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def supernode_settings(pid: int) -> tuple[dict[str, Any], str | None, str | None] | None:
    """What a SuperNode's own command line and environment say: its node config, its
    ``$RANKEXEC_FLOWER_SITE`` and its insecure SuperLink; None when ``pid`` is not a
    ``flower-supernode``."""
    argv = proc_argv(pid)
    if not any(os.path.basename(a) == "flower-supernode" for a in argv[:2]):
        return None
    node_config: dict[str, Any] = {}
    link = None
    for i, a in enumerate(argv):
        value = None
        if a in ("--node-config", "--superlink") and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(("--node-config=", "--superlink=")):
            value = a.split("=", 1)[1]
        if value is None:
            continue
        if a.startswith("--node-config"):
            node_config = parse_node_config(value)
        elif "--insecure" in argv:
            link = value
    return node_config, site_file_from_env(proc_environ(pid)), link
