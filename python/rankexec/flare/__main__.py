"""A FLARE site's two set-up steps for rankexec.

``python -m rankexec.flare allow-list WORKSPACE [--script PATH]... [--dry-run]``: FLARE
2.9 builds, for jobs that ship no custom code, only the classes in ``class_allow_list``
of the site's resources file (FLARE's 88 defaults when the key is absent). This adds the
three classes this package documents, ``rankexec.flare.MultiProcessExecutor``,
``rankexec.flare.ScriptExecutor`` and ``rankexec.flare.RankErrorLogger`` (not the whole
``rankexec.`` prefix, which an earlier version added and this removes), to the file
FLARE actually reads: it starts
from ``local/resources.json`` if present, else from a provisioned kit's
``local/resources.json.default``, keeps every other key (``resource_manager``,
``process_launcher``, ...), writes ``local/resources.json`` atomically with a backup of
the file it replaces, and prints the change as a diff (``--dry-run``: prints it, writes
nothing). A file that does not parse is refused, untouched (``rankexec.flare.site``).
Each ``--script PATH`` (a Client API script installed on the site; a folder allows any
``.py`` under it) is also added, as its absolute path with no arguments, to the
``scripts`` key of the site policy ``WORKSPACE/local/rankexec.json`` (created with the
defaults when absent, every other key kept), since the class on FLARE's allow-list
allows no script by itself. A script that does not exist, or a policy file that does
not parse, is refused before anything is written.

``python -m rankexec.flare policy WORKSPACE [--component C]... [--worker PROGRAM]...
[--launcher L]... [--env NAME]... [--script PATH]... [--byoc-jobs trusted|restricted]
[--force]``: writes
the site's policy, ``WORKSPACE/local/rankexec.json`` (see ``rankexec.flare.policy``):
what a job without custom code may make the executor run. It refuses to replace an
existing file without ``--force``.

``python -m rankexec.flare gpus WORKSPACE [--inventory 2x16GiB] [--dry-run]``: makes
rankexec the site's one GPU authority: sets ``resource_manager`` and
``resource_consumer`` in the resources file FLARE reads to
``rankexec.flare.resources.GpuResourceManager`` / ``GpuResourceConsumer`` (the same
edit rules as ``allow-list``; see ``rankexec.flare.resources``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

from rankexec.flare import policy, resources, site

CLASSES = (
    "rankexec.flare.MultiProcessExecutor",
    "rankexec.flare.ScriptExecutor",
    "rankexec.flare.RankErrorLogger",
)
OLD_PREFIX = "rankexec."


def _write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _add_classes(doc: dict) -> None:
    allow_list = [
        x for x in doc.get("class_allow_list", DEFAULT_CLASS_ALLOW_LIST) if x != OLD_PREFIX
    ]
    if "*" not in allow_list:
        allow_list.extend(c for c in CLASSES if c not in allow_list)
    doc["class_allow_list"] = allow_list


def allow(workspace: str, dry_run: bool = False) -> site.ResourcesEdit:
    """Adds rankexec's classes to the ``class_allow_list`` of the resources file FLARE
    reads for the site at ``workspace`` (``rankexec.flare.site.edit_resources``: every
    other key kept, an atomic write, a backup)."""
    return site.edit_resources(workspace, _add_classes, dry_run=dry_run)


def _script_entry(path: str) -> str:
    """The policy entry for a script the admin names: its absolute path, a folder with
    a trailing ``/``. Raises ``FileNotFoundError`` when it does not exist."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return full.rstrip(os.sep) + "/"
    if not os.path.isfile(full):
        raise FileNotFoundError(f"--script {path}: no such file or folder on this site")
    return full


def allow_scripts(workspace: str, scripts: list[str], dry_run: bool = False) -> str:
    """Adds ``scripts`` (each allowed with no arguments) to the ``scripts`` key of the
    site policy ``WORKSPACE/local/rankexec.json``, keeping its other keys (the defaults
    when there is no file). Returns what changed, for a person. Raises
    ``FileNotFoundError`` for a missing script and ``policy.PolicyError`` for a policy
    file that does not parse; nothing is written then."""
    path = os.path.join(workspace, "local", policy.FILE_NAME)
    entries = [_script_entry(s) for s in scripts]
    policy.load(path)  # an existing file must parse: refused untouched otherwise
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
    else:
        doc = policy.starter()
    have = doc.setdefault("scripts", [])
    added = [e for e in dict.fromkeys(entries) if e not in have]
    if not added:
        return f"{path}: no change (scripts already allowed: {json.dumps(entries)})\n"
    have.extend(added)
    if dry_run:
        return f"dry run: {path} not written (would allow scripts {json.dumps(added)})\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write_json(path, doc)
    policy.load(path)  # what was written parses
    return f"wrote {path}: scripts {json.dumps(added)} allowed (with no arguments)\n"


def write_policy(workspace: str, force: bool = False, **keys) -> str:
    """Writes ``WORKSPACE/local/rankexec.json``; returns its path."""
    local = os.path.join(workspace, "local")
    os.makedirs(local, exist_ok=True)
    path = os.path.join(local, policy.FILE_NAME)
    if os.path.exists(path) and not force:
        raise FileExistsError(f"{path} exists (--force replaces it)")
    _write_json(path, policy.starter(**keys))
    policy.load(path)  # what was written parses
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rankexec.flare")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("allow-list", help="add rankexec's classes to class_allow_list")
    a.add_argument("workspace", help="the site's workspace (its startup kit, or a folder)")
    a.add_argument("--dry-run", action="store_true", help="print the change, write nothing")
    a.add_argument(
        "--script",
        action="append",
        default=[],
        help="also allow this Client API script (no arguments) in local/rankexec.json",
    )
    w = sub.add_parser("policy", help="write the site policy WORKSPACE/local/rankexec.json")
    w.add_argument("workspace", help="the site's workspace (its startup kit, or a folder)")
    w.add_argument("--component", action="append", default=[], help="allowed rank component")
    w.add_argument("--worker", action="append", default=[], help="allowed rank program")
    w.add_argument(
        "--launcher",
        action="append",
        default=[],
        choices=["builtin", *policy._KINDS],
        help="allowed launcher kind (no extra arguments)",
    )
    w.add_argument("--env", action="append", default=[], help="variable a job may set")
    w.add_argument(
        "--script", action="append", default=[], help="allowed Client API script (no arguments)"
    )
    w.add_argument(
        "--byoc-jobs",
        choices=["trusted", "restricted"],
        default="trusted",
        help="whether jobs with custom code are held to the policy (default trusted)",
    )
    w.add_argument("--force", action="store_true", help="replace an existing file")
    resources.add_cli(sub)
    args = p.parse_args(argv)
    if args.cmd == "gpus":
        return resources.cli(args)
    if args.cmd == "allow-list":
        try:
            if args.script:  # refuse a missing script or a bad policy before any write
                allow_scripts(args.workspace, args.script, dry_run=True)
            edit = allow(args.workspace, dry_run=args.dry_run)
            scripts = (
                allow_scripts(args.workspace, args.script, args.dry_run) if args.script else ""
            )
        except (site.SiteFileError, policy.PolicyError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        sys.stdout.write(edit.describe() + scripts)
        return 0
    try:
        path = write_policy(
            args.workspace,
            force=args.force,
            components=args.component,
            workers=args.worker,
            launchers=args.launcher,
            env=args.env,
            scripts=args.script,
            byoc_jobs=args.byoc_jobs,
        )
    except (FileExistsError, policy.PolicyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
