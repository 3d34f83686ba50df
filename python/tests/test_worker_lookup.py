"""Which program a rank group started from Python runs (rankexec._paths).

The executor looks a bare program name up next to the running executable, then on
PATH. For a Python host that executable is the interpreter's real file: for a venv's
`bin/python` it is the base interpreter's, whose `python` lacks the venv's packages.
`RankGroup` looks bare names up next to `sys.executable` first (and in the wheel's
`rankexec/_bin/` for `rankexec-worker` and `rankexec`: tests/test_wheel.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import COMPONENTS, pid_alive

import rankexec
from rankexec import _paths

HOST = """
import json, os, sys
from rankexec.host import RankGroup

config = json.loads(sys.argv[1])
with RankGroup(config, workspace=sys.argv[2]) as group:
    group.start()
    pids = group.pids()
    programs = sorted({os.readlink(f"/proc/{p}/exe") for p in pids})
    meta = group.execute("t", {"x": 1}).meta
print(json.dumps({"pids": pids, "programs": programs, "meta": meta}))
"""


def test_python_names_the_hosts_venv_interpreter(tmp_path):
    # A venv as `python -m venv` makes it: bin/python is a link to the base interpreter,
    # whose own folder has a `python` without this package. The package is on the venv's
    # path through a .pth file (as `maturin develop` installs it).
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", "--symlinks", str(venv)], check=True)
    (site,) = venv.glob("lib/python3*/site-packages")
    (site / "rankexec.pth").write_text(str(Path(rankexec.__file__).resolve().parents[1]) + "\n")
    config = {
        "executor_id": "e",
        "num_of_processes": 2,
        "components": [{"id": "e", "path": f"{COMPONENTS / 'echo.py'}:Echo"}],
        "worker": {"program": "python", "args": ["-m", "rankexec.worker"]},
        "gpu": {"mode": "none"},
    }
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", HOST, json.dumps(config), str(tmp_path / "ws")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"host {venv / 'bin' / 'python'}: ranks run {out['programs']}; rank 0: {out['meta']}")
    assert out["meta"]["world_size"] == 2 and out["meta"]["x"] == 1
    assert not any(pid_alive(p) for p in out["pids"])


def test_resolve_worker_rewrites_bare_names_only():
    beside = str(Path(sys.executable).parent / "python")
    cfg = {"worker": {"program": "python", "args": ["-m", "rankexec.worker"]}, "x": 1}
    out = _paths.resolve_worker(cfg)
    assert out["worker"] == {"program": beside, "args": ["-m", "rankexec.worker"]}
    assert out["x"] == 1 and cfg["worker"]["program"] == "python"  # not modified
    for unchanged in (
        {"worker": {"program": "/bin/true"}},
        {"worker": {"program": "no-such-program-anywhere"}},
        {"worker": "not a mapping"},
    ):
        assert _paths.resolve_worker(unchanged) is unchanged
    # A checkout's package has no _bin/: the default worker is left to the executor.
    assert _paths.binary("rankexec-worker") is None
    assert _paths.resolve_worker({}) == {}


def _console_script() -> Path:
    script = Path(sys.executable).parent / "rankexec"
    assert script.is_file(), f"{script} is missing: install the package (maturin develop)"
    return script


def test_the_console_command_of_a_checkout_install_runs_the_checkouts_build():
    # `maturin develop` installs the `rankexec` console script but no _bin/: it runs
    # target/release/rankexec (scripts/test.sh builds it), here without PATH's help.
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    out = subprocess.run(
        [str(_console_script()), "--version"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"rankexec {rankexec.__version__}"


def test_the_console_command_without_any_binary_says_what_to_do(tmp_path):
    env = {
        **os.environ,
        "PATH": str(Path(sys.executable).parent),
        "CARGO_TARGET_DIR": str(tmp_path),  # an empty target folder: no release build
    }
    out = subprocess.run(
        [str(_console_script()), "--version"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    print(out.returncode, out.stderr)
    assert out.returncode == 127
    assert "carries no `rankexec` binary" in out.stderr
