"""The site's policy: what a FLARE job may make ``rankexec.flare.MultiProcessExecutor``
run on this site.

FLARE enforces its component allow list only for jobs without custom code (BYOC: the
job's app has a ``custom/`` folder, and FLARE records ``"byoc": true`` in the job's
meta). Such a job names classes, never code; but the executor's args reach a rank
group that runs programs, launchers and environments. So for a job without custom
code the site decides, in ``<site workspace>/local/rankexec.json``::

    {"components": ["mysite.ranks.", "Echo"],
     "workers": [{"program": "/opt/rankexec/bin/rankexec-worker", "args": []}],
     "launchers": ["builtin", "torchrun"],
     "env": ["NCCL_DEBUG", "NCCL_SOCKET_*"],
     "scripts": ["/opt/site/flare/train.py",
                 {"script": "/opt/site/flare/tools/", "args": "*"},
                 {"script": "/opt/site/flare/eval.py", "args": ["--split", "test"]}],
     "byoc_jobs": "trusted"}

- ``components``: the rank components a job may name in ``rank_component``. An entry
  ending in ``.`` or ``:`` is a prefix (``"mysite.ranks."``), ``"*"`` allows any, and
  any other entry allows itself and what lies under it (``"mysite.ranks"`` allows
  ``mysite.ranks.train:Trainer``; ``"Echo"`` allows the Rust worker's ``Echo``).
  ``module:Class`` is matched as ``module.Class``. A file (``x.py:Class``) only by an
  entry equal to its absolute path: a relative one is a file the job ships.
- ``workers``: the rank programs a job may pick with ``worker`` (a program path, or
  ``{"program", "args"}``; the job's ``worker`` must equal one). Without ``worker``
  the ranks run this site's Python ``-m rankexec.worker``.
- ``launchers``: the ``launcher`` values a job may pick: ``"builtin"`` (the default,
  always allowed), a kind (``"torchrun"``, ``"mpirun"``, ``"srun"``: that launcher
  with no extra arguments), or a whole launcher object, matched exactly.
- ``env``: the variables a job may set in ``env.set`` (names; ``NAME_*`` matches a
  prefix). ``env.inherit: false`` and ``env.allow`` only narrow what the ranks
  inherit and are always allowed.
- ``scripts``: the Client API scripts a ``rankexec.flare.ScriptExecutor`` job may run,
  with their arguments, matched exactly: a string is that script with no arguments;
  ``{"script", "args"}`` is that script with exactly ``args`` (a list), or with any
  arguments (``"args": "*"``). A ``script`` ending in ``/`` is a folder: any ``.py``
  under it. An absolute entry matches the job's script by its real path (symlinks
  resolved, ``..`` cannot leave the folder); a relative entry matches a relative
  script the job ships under exactly that name (useful with ``byoc_jobs:
  "restricted"``, where the job's ``custom/`` code is its own). ``"*"`` allows any
  script with any arguments. The ``components`` rule does not apply to
  ``ScriptExecutor`` (its ranks run the script, not a component). The real path
  checked (``script_path``, resolved once at START_RUN) is the one the ranks run, on
  every launch and relaunch: a symlink re-pointed after the check changes nothing.
- ``byoc_jobs``: ``"trusted"`` (default): a job with custom code may set everything,
  since its code already runs in this site's client process (FLARE's ``byoc`` right
  decides whether such a job runs at all); ``"restricted"``: the same rules as above.

Without the file: no components, no workers other than the Python default, only the
builtin launcher, no environment, no scripts, and jobs with custom code trusted. A file that does
not parse, or has unknown keys or wrong types, refuses every job (``PolicyError``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = ["FILE_NAME", "PolicyError", "SitePolicy", "load", "script_path", "starter"]

FILE_NAME = "rankexec.json"
_KINDS = ("torchrun", "mpirun", "srun")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_KEYS = {"components", "workers", "launchers", "env", "scripts", "byoc_jobs"}


class PolicyError(Exception):
    """A job asked for what the site's policy does not allow, or the policy file is
    invalid. ``key`` is the executor arg at fault (``None`` for a bad file), ``path``
    the policy file."""

    def __init__(self, message: str, key: str | None, path: str) -> None:
        super().__init__(message)
        self.key = key
        self.path = path


@dataclass(frozen=True)
class SitePolicy:
    """A parsed policy file (``exists`` False: the defaults)."""

    path: str
    exists: bool = False
    components: tuple[str, ...] = ()
    workers: tuple[dict[str, Any], ...] = ()
    launchers: tuple[Any, ...] = ("builtin",)
    env: tuple[str, ...] = ()
    scripts: tuple[Any, ...] = ()
    byoc_jobs: str = "trusted"

    def restricts(self, byoc: bool) -> bool:
        """Whether a job (with custom code or not) is held to this policy."""
        return not byoc or self.byoc_jobs == "restricted"

    def check(
        self,
        *,
        rank_component: str,
        worker: Any = None,
        launcher: Any = "builtin",
        env: Any = None,
        script: str | None = None,
        script_args: list[str] | None = None,
        app_root: str | None = None,
        script_real: str | None = None,
    ) -> None:
        """Raises ``PolicyError`` naming the first arg the policy does not allow.
        ``script``: a ``ScriptExecutor``'s script (with ``script_args``, relative paths
        under ``app_root``), checked against ``scripts`` instead of a component.
        ``script_real``: its real path as the caller resolved it (``script_path``),
        the one its ranks will run; resolved here when not given."""
        if worker is not None and _worker(worker) not in [_worker(w) for w in self.workers]:
            self._refuse("worker", f"the rank program {json.dumps(worker)}", "workers")
        if launcher != "builtin" and _launcher(launcher) not in [
            _launcher(x) for x in self.launchers
        ]:
            self._refuse("launcher", f"the launcher {json.dumps(launcher)}", "launchers")
        if env is not None:
            self._check_env(env)
        if script is not None:
            real = script_real or script_path(script, app_root)
            self._check_script(script, real, list(script_args or []))
            return
        self._check_component(rank_component)

    def _check_script(self, script: str, real: str, args: list[str]) -> None:
        matched = [e for e in self.scripts if _script_matches(script, real, e["script"])]
        if not matched:
            self._refuse("script", f"the script `{script}`", "scripts")
        if not any(e["args"] == "*" or list(e["args"]) == args for e in matched):
            allowed = [e["args"] for e in matched]
            self._refuse(
                "script_args",
                f"the script `{script}` with the arguments {json.dumps(args)} (allowed for it:"
                f" {json.dumps(allowed)})",
                "scripts",
            )

    def _check_env(self, env: Any) -> None:
        if not isinstance(env, Mapping):
            self._refuse("env", f"env {json.dumps(env)} (not an object)", "env")
        for k in env:
            if k not in ("inherit", "allow", "set"):
                self._refuse(f"env.{k}", f"env key `{k}`", "env")
        for name in env.get("set") or {}:
            if not any(_env_matches(name, p) for p in self.env):
                self._refuse(f"env.set.{name}", f"setting the variable `{name}`", "env")

    def _check_component(self, path: str) -> None:
        module, sep, attr = path.rpartition(":")
        if sep and module.endswith(".py"):
            if not os.path.isabs(module):
                self._refuse(
                    "rank_component",
                    f"the rank component `{path}` (a file the job ships; a job without "
                    "custom code may only name components installed on this site)",
                    "components",
                )
            if "*" in self.components or path in self.components:
                return
            self._refuse("rank_component", f"the rank component `{path}`", "components")
        dotted = f"{module}.{attr}" if sep else path
        if not _DOTTED.match(dotted):
            self._refuse(
                "rank_component", f"the rank component `{path}` (not `module:Class`)", "components"
            )
        if not any(_component_matches(dotted, e) for e in self.components):
            self._refuse("rank_component", f"the rank component `{path}`", "components")

    def _refuse(self, key: str, what: str, policy_key: str) -> NoReturn:
        where = self.path if self.exists else f"{self.path} (absent: the defaults apply)"
        raise PolicyError(
            f"job arg `{key}`: {what} is not allowed for this job by the site policy "
            f"{where}; a site allows it under `{policy_key}` there "
            "(`python -m rankexec.flare policy WORKSPACE` writes a starter file)",
            key,
            self.path,
        )


def _worker(w: Any) -> Any:
    if isinstance(w, str):
        return {"program": w, "args": []}
    if isinstance(w, Mapping):
        return {
            "program": w.get("program"),
            "args": list(w.get("args") or []),
            **{k: v for k, v in w.items() if k not in ("program", "args")},
        }
    return w


def _launcher(x: Any) -> Any:
    if isinstance(x, str) and x in _KINDS:
        return {x: {"extra_args": []}}
    if isinstance(x, Mapping) and len(x) == 1:
        ((kind, args),) = x.items()
        if kind in _KINDS and isinstance(args, Mapping):
            return {kind: {"extra_args": [], **args}}
    return x


def _script_entry(e: Any) -> dict[str, Any]:
    if isinstance(e, str):
        return {"script": e, "args": "*" if e == "*" else []}
    return {"script": e["script"], "args": e.get("args", [])}


def script_path(script: str, app_root: str | None) -> str:
    """The real path of a ``ScriptExecutor``'s script (``script`` relative to
    ``app_root``, else to the working directory; every symlink resolved): what the
    policy checks and what the ranks run."""
    return os.path.realpath(os.path.join(app_root or os.getcwd(), script))


def _script_matches(script: str, real: str, entry: str) -> bool:
    """Whether the script (as the job names it, and its real path) matches ``entry``."""
    if entry == "*":
        return True
    folder = entry.endswith("/")
    if os.path.isabs(entry):
        want = os.path.realpath(entry)
        return real.startswith(want + os.sep) if folder else real == want
    if os.path.isabs(script):
        return False
    rel = os.path.normpath(script)
    if rel == ".." or rel.startswith("../"):
        return False
    want = os.path.normpath(entry)
    return rel.startswith(want + os.sep) if folder else rel == want


def _env_matches(name: str, pattern: str) -> bool:
    if pattern.endswith("*"):
        return name.startswith(pattern[:-1])
    return name == pattern


def _component_matches(dotted: str, entry: str) -> bool:
    if entry == "*" or dotted == entry:
        return True
    if entry.endswith((".", ":")):
        return dotted.startswith(entry[:-1] + ".")
    return dotted.startswith(entry + ".")


def _strings(raw: Any, key: str, path: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
        raise PolicyError(f"{path}: `{key}` must be a list of non-empty strings", None, path)
    return tuple(raw)


def load(path: str) -> SitePolicy:
    """The policy in ``path`` (the defaults when there is no such file)."""
    if not os.path.exists(path):
        return SitePolicy(path=path)
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise PolicyError(f"{path}: cannot read the site policy: {e}", None, path) from e
    if not isinstance(raw, dict):
        raise PolicyError(f"{path}: the site policy must be a JSON object", None, path)
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise PolicyError(f"{path}: unknown key(s) {unknown} (known: {sorted(_KEYS)})", None, path)
    workers = raw.get("workers", [])
    if not isinstance(workers, list) or not all(
        isinstance(w, str)
        or (
            isinstance(w, dict)
            and isinstance(w.get("program"), str)
            and isinstance(w.get("args", []), list)
        )
        for w in workers
    ):
        raise PolicyError(
            f'{path}: `workers` must be a list of programs or {{"program", "args"}}',
            None,
            path,
        )
    launchers = raw.get("launchers", ["builtin"])
    if not isinstance(launchers, list) or not all(
        isinstance(x, dict) or x == "builtin" or x in _KINDS for x in launchers
    ):
        raise PolicyError(
            f'{path}: `launchers` must be a list of "builtin", {list(_KINDS)} or launcher objects',
            None,
            path,
        )
    scripts = raw.get("scripts", [])
    if not isinstance(scripts, list) or not all(
        (isinstance(e, str) and e)
        or (
            isinstance(e, dict)
            and set(e) <= {"script", "args"}
            and isinstance(e.get("script"), str)
            and e["script"]
            and (
                e.get("args", []) == "*"
                or (
                    isinstance(e.get("args", []), list)
                    and all(isinstance(a, str) for a in e.get("args", []))
                )
            )
        )
        for e in scripts
    ):
        raise PolicyError(
            f'{path}: `scripts` must be a list of scripts or {{"script", "args"}}'
            ' (args: a list of strings or "*")',
            None,
            path,
        )
    byoc = raw.get("byoc_jobs", "trusted")
    if byoc not in ("trusted", "restricted"):
        raise PolicyError(
            f'{path}: `byoc_jobs` must be "trusted" or "restricted", not {byoc!r}', None, path
        )
    return SitePolicy(
        path=path,
        exists=True,
        components=_strings(raw.get("components", []), "components", path),
        workers=tuple(_worker(w) for w in workers),
        launchers=tuple(launchers),
        env=_strings(raw.get("env", []), "env", path),
        scripts=tuple(_script_entry(e) for e in scripts),
        byoc_jobs=byoc,
    )


def starter(
    components: list[str] | None = None,
    workers: list[str] | None = None,
    launchers: list[str] | None = None,
    env: list[str] | None = None,
    byoc_jobs: str = "trusted",
    scripts: list[Any] | None = None,
) -> dict[str, Any]:
    """A policy file's content: the defaults plus what is given."""
    return {
        "components": list(components or []),
        "workers": list(workers or []),
        "launchers": ["builtin", *[x for x in launchers or [] if x != "builtin"]],
        "env": list(env or []),
        "scripts": list(scripts or []),
        "byoc_jobs": byoc_jobs,
    }
