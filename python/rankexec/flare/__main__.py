"""``python -m rankexec.flare allow-list WORKSPACE``: lets a FLARE site build rankexec's
components in jobs that ship no custom code.

FLARE 2.9 builds only the classes in ``class_allow_list`` of the site's
``local/resources.json`` (FLARE's 88 defaults when the key is absent). This adds
``"rankexec."`` to that list, starting from FLARE's defaults when the file has none,
and keeps everything else in the file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

PREFIX = "rankexec."


def allow(workspace: str) -> str:
    """Adds ``rankexec.`` to ``WORKSPACE/local/resources.json``; returns its path."""
    local = os.path.join(workspace, "local")
    os.makedirs(local, exist_ok=True)
    path = os.path.join(local, "resources.json")
    resources: dict = {}
    if os.path.exists(path):
        with open(path) as f:
            resources = json.load(f)
    allow_list = list(resources.get("class_allow_list", DEFAULT_CLASS_ALLOW_LIST))
    if PREFIX not in allow_list and "*" not in allow_list:
        allow_list.append(PREFIX)
    resources["class_allow_list"] = allow_list
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(resources, f, indent=2)
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rankexec.flare")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("allow-list", help="add rankexec. to a workspace's class_allow_list")
    a.add_argument("workspace")
    args = p.parse_args(argv)
    if args.cmd == "allow-list":
        print(allow(args.workspace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
