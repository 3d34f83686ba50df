"""A FLARE site admin allows a Client API script installed on the site, with one
command: ``python -m rankexec.flare allow-list WORKSPACE --script PATH`` puts
``rankexec.flare.ScriptExecutor`` on FLARE's ``class_allow_list`` (checked with FLARE's
own ``ComponentPathAuthorizer``, the widget that refuses a class of a job without custom
code) and the script in the site policy's ``scripts`` key (checked with the policy
``ScriptExecutor`` enforces at START_RUN). Cheap: the command and the files it wrote,
no simulator run (``test_flare_policy.py`` runs a refused script job end to end).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nvflare.apis.fl_exception import UnsafeComponentError
from nvflare.apis.workspace import Workspace
from nvflare.app_common.widgets.component_path_authorizer import ComponentPathAuthorizer

from rankexec.flare import policy


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rankexec.flare", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def authorize(workspace: Path, path: str) -> None:
    """FLARE's check of a component class for a job without custom code, reading the
    site's resources file as a FLARE client does (FLARE's defaults without one)."""
    ComponentPathAuthorizer().authorize_component_config(
        {"path": path, "args": {}}, workspace=Workspace(str(workspace), "site-1")
    )


def test_allow_list_script_allows_a_site_script_and_nothing_else(tmp_path: Path) -> None:
    ws = tmp_path / "site-1"
    (ws / "local").mkdir(parents=True)
    (ws / "startup").mkdir()  # what FLARE's Workspace requires
    train = tmp_path / "opt" / "train.py"
    train.parent.mkdir()
    train.write_text("import nvflare.client as flare\n")
    with pytest.raises(UnsafeComponentError):  # FLARE's defaults: not allowed before
        authorize(ws, "rankexec.flare.ScriptExecutor")

    dry = cli("allow-list", str(ws), "--script", str(train), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would allow scripts" in dry.stdout and str(train) in dry.stdout
    assert sorted(os.listdir(ws / "local")) == []  # a dry run writes nothing

    r = cli("allow-list", str(ws), "--script", str(train))
    assert r.returncode == 0, r.stderr
    assert f"wrote {ws / 'local' / 'rankexec.json'}" in r.stdout
    authorize(ws, "rankexec.flare.ScriptExecutor")
    authorize(ws, "rankexec.flare.MultiProcessExecutor")
    with pytest.raises(UnsafeComponentError):
        authorize(ws, "rankexec.flare.script_executor.ScriptExecutor")
    doc = json.loads((ws / "local" / "rankexec.json").read_text())
    assert doc["scripts"] == [str(train)]
    site = policy.load(str(ws / "local" / "rankexec.json"))
    site.check(rank_component="client_api_script", script=str(train), script_args=[])
    with pytest.raises(policy.PolicyError) as e:  # no arguments were allowed
        site.check(rank_component="client_api_script", script=str(train), script_args=["-x"])
    assert e.value.key == "script_args"
    with pytest.raises(policy.PolicyError) as e:
        site.check(rank_component="c", script=str(tmp_path / "other.py"), script_args=[])
    assert e.value.key == "script"

    # A second script joins the first, every other key of the file is kept, and a
    # repeated one changes nothing.
    doc["launchers"] = ["builtin", "torchrun"]
    (ws / "local" / "rankexec.json").write_text(json.dumps(doc))
    tools = tmp_path / "opt" / "tools"
    tools.mkdir()
    r = cli("allow-list", str(ws), "--script", str(tools), "--script", str(train))
    assert r.returncode == 0, r.stderr
    doc = json.loads((ws / "local" / "rankexec.json").read_text())
    assert doc["scripts"] == [str(train), f"{tools}/"]
    assert doc["launchers"] == ["builtin", "torchrun"]
    again = cli("allow-list", str(ws), "--script", str(train))
    assert again.returncode == 0 and "no change" in again.stdout


def test_allow_list_script_refuses_a_missing_script_or_a_bad_policy(tmp_path: Path) -> None:
    ws = tmp_path / "site-1"
    (ws / "local").mkdir(parents=True)
    r = cli("allow-list", str(ws), "--script", str(tmp_path / "absent.py"))
    assert r.returncode == 1
    assert "absent.py: no such file or folder on this site" in r.stderr
    assert os.listdir(ws / "local") == []  # nothing written, resources included
    bad = ws / "local" / "rankexec.json"
    bad.write_text('{"scripts": "not a list"}')
    train = tmp_path / "train.py"
    train.write_text("")
    r = cli("allow-list", str(ws), "--script", str(train))
    assert r.returncode == 1 and "`scripts` must be a list" in r.stderr
    assert bad.read_text() == '{"scripts": "not a list"}'
    assert sorted(os.listdir(ws / "local")) == ["rankexec.json"]
