"""A ``ScriptExecutor`` job's ranks run the script the site's policy checked: its real
path, resolved once at START_RUN, on the first launch and on every relaunch, however
the path the job named (a symlink) is re-pointed after the check.

The job names a symlink to the site's script, which the policy allows by its real path;
a symlink re-pointed to a script the policy does not allow, right after the check or
later, before a relaunch, must change nothing. Each script records which one ran (a
marker file) with its ``sys.argv[0]``, ``__file__`` and ``sys.path[0]``; the checked one
fails its first task once, so that the group is relaunched for the next.

Drives the real executor (``handle_event(START_RUN)``: the policy check, the group's
start) and real Python ranks, without the simulator.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey, ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.signal import Signal
from nvflare.apis.workspace import Workspace
from nvflare.app_common.app_constant import AppConstants

from rankexec.flare import ScriptExecutor, policy

# Each script marks its run (in the order of runs), then serves tasks; the checked one
# fails its first task once (`fail_once` names the flag file).
SCRIPT = """
    import json, os, sys

    marks = sys.argv[sys.argv.index("--marks") + 1]
    NAME = {name!r}
    run = len([f for f in os.listdir(marks) if not f.endswith(".tmp")])
    seen = {{"name": NAME, "argv0": sys.argv[0], "file": __file__, "path0": sys.path[0]}}
    try:
        import beside_the_script  # in the script's own folder
        seen["beside"] = beside_the_script.WHERE
    except ImportError:
        seen["beside"] = None
    tmp = os.path.join(marks, f"{{run:02d}}-{{NAME}}.tmp")
    with open(tmp, "w") as f:
        json.dump(seen, f)
    os.rename(tmp, tmp[: -len(".tmp")])

    import nvflare.client as flare

    flare.init()
    while flare.is_running():
        m = flare.receive()
        if m is None:
            continue
        if {fail_once!r}:
            try:
                os.close(os.open({fail_once!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                raise RuntimeError("the checked script fails its first task, once")
            except FileExistsError:
                pass
        flare.send(flare.FLModel(params=m.params, metrics={{"ran": NAME}}))
"""


def _write_script(folder: Path, name: str, fail_once: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "beside_the_script.py").write_text(f"WHERE = {str(folder)!r}\n")
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(SCRIPT.format(name=name, fail_once=fail_once)))
    return path


def _runs(marks: Path) -> list[dict]:
    return [
        json.loads((marks / f).read_text())
        for f in sorted(os.listdir(marks))
        if not f.endswith(".tmp")
    ]


def _task(executor: ScriptExecutor, ctx: FLContext):
    shareable = DXO(DataKind.WEIGHTS, data={"w": [1.0]}).to_shareable()
    shareable.set_header(AppConstants.CURRENT_ROUND, 0)
    shareable.set_header(AppConstants.NUM_ROUNDS, 1)
    return executor.execute("train", shareable, ctx, Signal())


@pytest.mark.parametrize("repoint", ["right after the check", "before the relaunch"])
def test_the_ranks_run_the_checked_script_on_every_launch_whatever_the_symlink_says(
    tmp_path, monkeypatch, repoint
):
    site = tmp_path / "site-scripts"
    checked = _write_script(site / "flare", "checked", fail_once=str(tmp_path / "failed-once"))
    other = _write_script(tmp_path / "elsewhere", "other")
    link = tmp_path / "job-files" / "train.py"  # what the job names
    link.parent.mkdir()
    link.symlink_to(checked)
    ws = tmp_path / "workspace"
    for d in ("startup", "local"):
        (ws / d).mkdir(parents=True)
    (ws / "local" / policy.FILE_NAME).write_text(
        json.dumps({"scripts": [{"script": str(checked), "args": "*"}]})
    )
    pol = policy.load(str(ws / "local" / policy.FILE_NAME))
    with pytest.raises(policy.PolicyError, match="job arg `script`"):
        pol.check(rank_component="client_api_script", script=str(other))
    marks = tmp_path / "marks"
    marks.mkdir()
    app = tmp_path / "app"
    app.mkdir()

    def repoint_link() -> None:
        tmp = link.with_suffix(".new")
        tmp.symlink_to(other)
        os.replace(tmp, link)

    if repoint == "right after the check":
        check = policy.SitePolicy.check

        def check_then_repoint(self, **kwargs):
            check(self, **kwargs)
            repoint_link()  # the job's symlink changes once the executor checked it

        monkeypatch.setattr(policy.SitePolicy, "check", check_then_repoint)

    executor = ScriptExecutor(
        script=str(link),
        script_args=["--marks", str(marks)],
        num_of_processes=1,
        deadlines={"startup": "120s", "task": "120s"},
        restart={"max_restarts": 2, "backoff": "10ms"},
    )
    ctx = FLContext()
    ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1", private=False, sticky=False)
    ctx.set_prop(ReservedKey.RUN_NUM, "job-1", private=False, sticky=False)
    ctx.set_prop(FLContextKey.APP_ROOT, str(app), private=True, sticky=False)
    ctx.set_prop(
        FLContextKey.WORKSPACE_OBJECT,
        Workspace(str(ws), site_name="site-1"),
        private=True,
        sticky=False,
    )
    executor.handle_event(EventType.START_RUN, ctx)
    try:
        assert executor._group is not None, "the policy refused the job or the group failed"
        first = _task(executor, ctx)  # the checked script's first task fails: a relaunch
        runs = _runs(marks)
        print("first launch ran:", runs)
        assert [r["name"] for r in runs] == ["checked"], (
            f"the first launch ran {runs[-1]['name']}.py, not the checked script"
        )
        assert first.get_return_code() != ReturnCode.OK
        if repoint == "before the relaunch":
            repoint_link()  # hours later, say
        second = _task(executor, ctx)
        runs = _runs(marks)
        print("relaunch ran:", runs[1:], "answered:", second.get_return_code())
        assert [r["name"] for r in runs] == ["checked", "checked"], (
            f"the relaunch ran {runs[-1]['name']}.py, not the checked script"
        )
        assert second.get_return_code() == ReturnCode.OK
        assert os.readlink(link) == str(other)  # the job's symlink did change
        real = str(checked.resolve())
        for r in runs:
            # The script sees its real path, and its own folder first on sys.path.
            assert r["argv0"] == real and r["file"] == real, r
            assert r["path0"] == str(checked.resolve().parent), r
            assert r["beside"] == str(checked.parent), r
    finally:
        executor.handle_event(EventType.END_RUN, ctx)


def test_the_policy_checks_the_real_path_it_is_given_and_resolves_one_otherwise(tmp_path):
    """``script_real`` (what the executor resolved at START_RUN, and its ranks run) is
    what an absolute entry is matched against; without it the policy resolves the
    script itself (``script_path``)."""
    checked = _write_script(tmp_path / "site", "checked")
    other = _write_script(tmp_path / "elsewhere", "other")
    link = tmp_path / "link.py"
    link.symlink_to(checked)
    path = tmp_path / policy.FILE_NAME
    path.write_text(json.dumps({"scripts": [str(checked)]}))
    p = policy.load(str(path))
    run = {"rank_component": "client_api_script", "app_root": str(tmp_path)}
    assert policy.script_path("link.py", str(tmp_path)) == str(checked.resolve())
    p.check(**run, script="link.py")
    p.check(**run, script=str(link), script_real=str(checked.resolve()))
    with pytest.raises(policy.PolicyError, match="job arg `script`"):
        p.check(**run, script=str(link), script_real=str(other.resolve()))


def test_a_script_named_without_a_symlink_runs_under_its_name_one_through_a_symlink_does_not(
    tmp_path,
):
    """The group's worker args: `custom/client.py` as named when it is a plain file in
    a plain folder (as `python custom/client.py`: its `sys.argv[0]`), the real path when
    the name goes through a symlink or `..` (nothing left to re-point)."""
    app = tmp_path / "app"
    real = _write_script(app / "custom", "client")
    (app / "custom" / "link.py").symlink_to(real)
    (app / "linked").symlink_to(app / "custom")

    def runs(script: str) -> str:
        ex = ScriptExecutor(script=script, script_args=["--x"])
        args = ex.group_config(str(tmp_path / "run"), str(app))["worker"]["args"]
        assert args[-1] == "--x"
        return args[-2]

    assert runs("custom/client.py") == "custom/client.py"
    assert runs(str(real)) == str(real)
    for through in ("custom/link.py", "linked/client.py", "linked/../custom/client.py"):
        assert runs(through) == str(real.resolve()), through
