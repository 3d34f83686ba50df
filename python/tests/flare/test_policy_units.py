"""The site policy file, the set-up commands and the class-only loader, without the
simulator: parsing, every refusal, and a real rank group that is asked to call
`os:system`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rankexec import _loader
from rankexec.flare import policy
from rankexec.flare.__main__ import CLASSES
from rankexec.host import RankGroup, StartupFailed


def _write(tmp_path, doc) -> str:
    p = tmp_path / "rankexec.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def test_without_a_file_the_defaults_refuse_everything_a_job_could_run(tmp_path):
    p = policy.load(str(tmp_path / "absent.json"))
    assert not p.exists and p.restricts(byoc=False) and not p.restricts(byoc=True)
    for kwargs, key in (
        ({"worker": {"program": "/bin/sh"}}, "worker"),
        ({"launcher": {"torchrun": {}}}, "launcher"),
        ({"env": {"set": {"LD_PRELOAD": "/tmp/x.so"}}}, "env.set.LD_PRELOAD"),
        ({"env": {"set": {"PYTHONPATH": "/tmp"}}}, "env.set.PYTHONPATH"),
        ({}, "rank_component"),
    ):
        with pytest.raises(policy.PolicyError) as e:
            p.check(rank_component="mysite.ranks:Trainer", **kwargs)
        assert e.value.key == key and e.value.path == p.path
        assert f"job arg `{key}`" in str(e.value) and "absent: the defaults apply" in str(e.value)


def test_what_a_policy_allows(tmp_path):
    p = policy.load(
        _write(
            tmp_path,
            {
                "components": ["mysite.ranks.", "Echo", "/opt/site/r.py:R"],
                "workers": ["/opt/w", {"program": "/opt/py", "args": ["-m", "w"]}],
                "launchers": ["builtin", "torchrun", {"mpirun": {"extra_args": ["-x", "A"]}}],
                "env": ["NCCL_DEBUG", "NCCL_SOCKET_*"],
            },
        )
    )
    ok = {"rank_component": "mysite.ranks.train:Trainer"}
    p.check(**ok, worker="/opt/w")
    p.check(**ok, worker={"program": "/opt/w"})
    p.check(**ok, worker={"program": "/opt/py", "args": ["-m", "w"]})
    p.check(**ok, launcher="torchrun")
    p.check(**ok, launcher={"torchrun": {}})
    p.check(**ok, launcher={"mpirun": {"extra_args": ["-x", "A"]}})
    p.check(**ok, env={"inherit": False, "allow": ["HOME"], "set": {"NCCL_SOCKET_IFNAME": "lo"}})
    p.check(rank_component="Echo")
    p.check(rank_component="/opt/site/r.py:R")
    refused = [
        ({"worker": {"program": "/opt/py", "args": ["-c", "import os"]}}, "worker"),
        ({"launcher": {"torchrun": {"extra_args": ["--no-python"]}}}, "launcher"),
        ({"launcher": {"command": {"argv": ["/bin/sh"]}}}, "launcher"),
        ({"env": {"set": {"NCCL_DEBUGX": "1"}}}, "env.set.NCCL_DEBUGX"),
        ({"env": {"prepend": {}}}, "env.prepend"),
        ({"rank_component": "mysite.ranksx:T"}, "rank_component"),
        ({"rank_component": "os:system"}, "rank_component"),
        ({"rank_component": "ranks/r.py:R"}, "rank_component"),  # a file the job ships
        ({"rank_component": "/opt/site/other.py:R"}, "rank_component"),
        ({"rank_component": "mysite.ranks.x:T; rm"}, "rank_component"),
    ]
    for kwargs, key in refused:
        args = {**ok, **kwargs}
        with pytest.raises(policy.PolicyError) as e:
            p.check(**args)
        assert e.value.key == key, (kwargs, e.value)
        assert p.path in str(e.value)


def test_client_api_scripts_and_their_arguments_are_under_the_policy(tmp_path):
    """A ScriptExecutor's script is checked against `scripts` (exactly, arguments
    included); allowing its component is not enough."""
    site = tmp_path / "site"
    (site / "tools").mkdir(parents=True)
    for name in ("train.py", "eval.py", "tools/a.py", "other.py"):
        (site / name).write_text("")
    (site / "tools" / "link.py").symlink_to(site / "other.py")
    p = policy.load(
        _write(
            tmp_path,
            {
                "components": ["*"],
                "scripts": [
                    str(site / "train.py"),
                    {"script": str(site / "eval.py"), "args": ["--split", "test"]},
                    {"script": f"{site}/tools/", "args": "*"},
                    {"script": "custom/client.py", "args": ["--epochs", "2"]},
                ],
            },
        )
    )
    run = {"rank_component": "client_api_script", "app_root": str(tmp_path / "app")}
    p.check(**run, script=str(site / "train.py"))
    p.check(**run, script=str(site / "eval.py"), script_args=["--split", "test"])
    p.check(**run, script=f"{site}/tools/a.py", script_args=["--anything"])
    p.check(**run, script="custom/client.py", script_args=["--epochs", "2"])
    refused = [
        ({"script": str(site / "other.py")}, "script"),
        ({"script": str(site / "train.py"), "script_args": ["--x"]}, "script_args"),
        ({"script": str(site / "eval.py"), "script_args": ["--split", "train"]}, "script_args"),
        ({"script": f"{site}/tools/../other.py"}, "script"),
        ({"script": f"{site}/tools/link.py"}, "script"),  # a link out of the folder
        ({"script": "custom/client.py"}, "script_args"),
        ({"script": "custom/../custom/other.py"}, "script"),
        ({"script": "../client.py"}, "script"),
        ({"script": "train.py"}, "script"),
    ]
    for kwargs, key in refused:
        with pytest.raises(policy.PolicyError) as e:
            p.check(**run, **kwargs)
        assert e.value.key == key, (kwargs, e.value)
        assert p.path in str(e.value) and "under `scripts` there" in str(e.value)
    print(f"\n[policy] {e.value}")
    # Without `scripts`, no script runs, whatever the components allow.
    bare = policy.load(_write(tmp_path, {"components": ["*", "client_api_script"]}))
    with pytest.raises(policy.PolicyError, match="job arg `script`"):
        bare.check(**run, script=str(site / "train.py"))


def test_byoc_jobs_are_trusted_unless_the_site_restricts_them(tmp_path):
    assert not policy.load(_write(tmp_path, {})).restricts(byoc=True)
    assert policy.load(_write(tmp_path, {"byoc_jobs": "restricted"})).restricts(byoc=True)


@pytest.mark.parametrize(
    "doc, what",
    [
        ("{not json", "cannot read the site policy"),
        ("[]", "must be a JSON object"),
        ({"component": ["x"]}, "unknown key(s) ['component']"),
        ({"components": "mysite."}, "`components` must be a list"),
        ({"workers": [{"args": []}]}, "`workers` must be a list"),
        ({"launchers": ["command"]}, "`launchers` must be a list"),
        ({"byoc_jobs": "yes"}, "`byoc_jobs` must be"),
        ({"scripts": [{"script": "/x.py", "args": "--a"}]}, "`scripts` must be a list"),
        ({"scripts": [{"path": "/x.py"}]}, "`scripts` must be a list"),
    ],
)
def test_a_broken_policy_file_is_an_error_naming_it(tmp_path, doc, what):
    path = _write(tmp_path, doc)
    with pytest.raises(policy.PolicyError) as e:
        policy.load(path)
    assert what in str(e.value) and path in str(e.value) and e.value.key is None


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rankexec.flare", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_policy_command_writes_a_starter_file_and_keeps_an_existing_one(tmp_path):
    r = _cli("policy", str(tmp_path), "--worker", "/opt/w", "--component", "mysite.ranks.")
    assert r.returncode == 0, r.stderr
    path = tmp_path / "local" / "rankexec.json"
    assert r.stdout.strip() == str(path)
    p = policy.load(str(path))
    assert p.components == ("mysite.ranks.",) and p.launchers == ("builtin",)
    p.check(rank_component="mysite.ranks.a:B", worker="/opt/w")
    r = _cli("policy", str(tmp_path))
    assert r.returncode == 1 and "exists (--force replaces it)" in r.stderr
    assert policy.load(str(path)).components == ("mysite.ranks.",)


def test_the_allow_list_command_adds_the_two_classes_not_the_prefix(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    (local / "resources.json").write_text(
        json.dumps({"class_allow_list": ["nvflare.", "rankexec."], "other": 1})
    )
    r = _cli("allow-list", str(tmp_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads((local / "resources.json").read_text())
    assert doc == {"class_allow_list": ["nvflare.", *CLASSES], "other": 1}
    r = _cli("allow-list", str(tmp_path / "fresh"))
    allow = json.loads((tmp_path / "fresh" / "local" / "resources.json").read_text())
    assert "rankexec." not in allow["class_allow_list"]
    assert set(CLASSES) <= set(allow["class_allow_list"]) and len(allow["class_allow_list"]) > 2


@pytest.mark.parametrize("path", ["os:system", "subprocess:call", "builtins:exec", "os:path.join"])
def test_the_loader_refuses_anything_but_a_class(path):
    with pytest.raises(_loader.NotAClass) as e:
        _loader.resolve(path)
    assert isinstance(e.value, TypeError) and e.value.path == path
    assert "not a class" in str(e.value)
    with pytest.raises(_loader.NotAClass):
        _loader.check("c", path, "{}")
    with pytest.raises(_loader.NotAClass):
        _loader.build("c", path, json.dumps({"command": "true"}))


def test_a_rank_group_never_calls_os_system(tmp_path):
    """A real group of Python ranks told to build `os:system` with a command: the
    start fails with the loader's error, and the command never ran."""
    marker = tmp_path / "os-system-ran"
    cfg = {
        "executor_id": "c",
        "num_of_processes": 1,
        "components": [{"id": "c", "path": "os:system", "args": {"command": f"touch {marker}"}}],
        "worker": {"program": sys.executable, "args": ["-m", "rankexec.worker"]},
        "deadlines": {"startup": "60s"},
    }
    with RankGroup(cfg, workspace=str(tmp_path)) as g, pytest.raises(StartupFailed) as e:
        g.start()
    print(f"StartupFailed: {e.value}")
    assert "not a class" in str(e.value)
    assert not marker.exists()


def test_a_job_counts_as_byoc_only_when_flare_says_so(tmp_path):
    """FLARE's flag in the FLContext's job meta; else the deployed meta file; else the
    job is held to the policy (the safe side)."""
    from nvflare.apis.fl_constant import FLContextKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.workspace import Workspace

    from rankexec.flare.executor import _job_has_custom_code

    (tmp_path / "startup").mkdir()
    (tmp_path / "local").mkdir()
    ws = Workspace(str(tmp_path), site_name="site-1")
    ctx = FLContext()
    assert not _job_has_custom_code(ctx, ws, "job1")  # no meta anywhere
    (tmp_path / "job1").mkdir()
    (tmp_path / "job1" / "meta.json").write_text(json.dumps({"byoc": True}))
    assert _job_has_custom_code(ctx, ws, "job1")  # the deployed meta file
    (tmp_path / "job1" / "meta.json").write_text("{broken")
    assert not _job_has_custom_code(ctx, ws, "job1")
    ctx.set_prop(FLContextKey.JOB_META, {"name": "x"}, private=True, sticky=False)
    assert not _job_has_custom_code(ctx, ws, "job1")
    ctx.set_prop(FLContextKey.JOB_META, {"byoc": True}, private=True, sticky=False)
    assert _job_has_custom_code(ctx, None, "")
