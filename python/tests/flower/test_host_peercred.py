"""The Flower node host as its own service user (issue 39): peer credentials
(``SO_PEERCRED``) checked before any byte of a connection is read, the node folder
shared with the host's group only, the ClientApp told where the site's host serves
(``RANKEXEC_FLOWER_NODE_DIR``) and which uid it must run as
(``RANKEXEC_FLOWER_HOST_UID``), and the shipped systemd unit.

Real processes throughout: a real host, ClientApp calls from a child that runs as
``nobody`` (uid and gid 65534, dropped by ``setpriv`` in the forked child before it
runs Python), real ranks. Runs only as root (CI does):
another uid cannot be taken otherwise.

Caveats: the ``nobody`` child needs this venv's interpreter and the repository to be
readable by it (the test skips, naming the reason, where they are not); the unit is
checked with ``systemd-analyze verify`` (no systemd runs here) and its ``ExecStart`` is
run under ``setpriv`` as ``nobody`` (standing in for its ``User=rankexec``), with this
venv's interpreter for ``/opt/rankexec/venv/bin/python`` and the test's folders for
its ``Environment=`` values.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from rankexec.flower import _channel

from .helpers import pid_alive, wait_until

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root: the test runs its peers as another uid (nobody, 65534)",
)

REPO = Path(__file__).resolve().parents[3]
UNIT = REPO / "examples" / "flower" / "systemd" / "rankexec-flower-host.service"
NOBODY = 65534

APP = """
import os

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from rankexec.flower import ClientApp, ndarrays

app = ClientApp(num_of_processes=2, deadlines={"startup": "120s", "task": "120s"})


@app.train()
def train(msg, context):
    (w,) = ndarrays(msg.content["arrays"])
    metrics = MetricRecord(
        {"pid": os.getpid(), "uid": os.getuid(), "world": int(os.environ["WORLD_SIZE"])}
    )
    return Message(RecordDict({"arrays": ArrayRecord([w * 2]), "metrics": metrics}), reply_to=msg)
"""

# One ClientApp call, as flwr-clientapp makes it; prints what came back as JSON.
CALL = """
import json, os, sys
import numpy as np
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

sys.path.insert(0, sys.argv[1])
from peerapp.client_app import app

run, node = 61, int(sys.argv[2])
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, 1
msg = Message(RecordDict({"arrays": ArrayRecord([np.arange(4, dtype=np.float32)])}),
              dst_node_id=node, message_type="train")
reply = app(msg, Context(run, node, {}, RecordDict(), {}))
out = {"caller": [os.getpid(), os.getuid(), os.getgid()]}
if reply.has_error():
    out["error"] = reply.error.reason
else:
    out["metrics"] = dict(reply.content["metrics"])
    out["w"] = reply.content["arrays"].to_numpy_ndarrays()[0].tolist()
print(json.dumps(out))
"""


# What a process of the SuperNode's user (nobody, in the host's group) tries against a
# host of another uid; prints each attempt's outcome as JSON.
TRIES = """
import json, os, signal, sys
host, node_dir, site = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def attempt(f):
    try:
        f()
        return "done"
    except OSError as e:
        return type(e).__name__
def write(path):
    with open(path, "a") as f:
        f.write("x")
out = {
    "signal the host": attempt(lambda: os.kill(host, signal.SIGTERM)),
    "read the host's environment": attempt(lambda: open(f"/proc/{host}/environ").read()),
    "write the site file": attempt(lambda: write(site)),
    "write in the node folder": attempt(lambda: write(os.path.join(node_dir, "x"))),
    "replace the socket": attempt(
        lambda: os.rename(os.path.join(node_dir, "secret"), os.path.join(node_dir, "host.sock"))
    ),
    "read the secret": attempt(lambda: open(os.path.join(node_dir, "secret"), "rb").read()),
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def nobody_runs_python() -> None:
    """Skips where this venv's Python cannot run as nobody (checked once)."""
    probe = subprocess.run(
        [*_nobody([]), sys.executable, "-c", "import rankexec.flower, flwr, numpy"],
        check=False,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        pytest.skip(f"this venv cannot run as uid {NOBODY}: {probe.stderr.strip()[-300:]}")


@pytest.fixture
def shared(nobody_runs_python: None) -> Iterator[Path]:
    """A folder every user can read (the app, the site file), outside pytest's private
    tmp folders, which another uid cannot enter."""
    root = Path(tempfile.mkdtemp(prefix="rankexec-peercred-", dir="/tmp"))
    root.chmod(0o755)
    pkg = root / "app" / "peerapp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "client_app.py").write_text(textwrap.dedent(APP))
    for d in (root / "app", pkg):
        d.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _nobody(groups: list[int]) -> list[str]:
    """The command prefix that runs a program as nobody (uid and gid 65534), with
    ``groups`` as its supplementary groups (``setpriv``: ``subprocess``'s own ``user=``
    cannot exec this venv's interpreter in some sandboxes)."""
    argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}"]
    return argv + ([f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"])


def _ranks_python(cwd: Path) -> dict:
    """The site's ``python`` (and ``env``) for ranks that run as nobody: this venv's
    interpreter where nobody can reach it, else the system's interpreter of the same
    version with this venv's packages on ``PYTHONPATH`` (this venv's interpreter may
    live under root's private home); skips where neither runs for nobody."""
    import sysconfig

    code = "import os, sys, rankexec.flower, flwr, numpy; assert os.access(sys.executable, os.X_OK)"
    paths = os.pathsep.join([sysconfig.get_paths()["purelib"], str(REPO / "python")])
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    why = []
    for python, env in ((sys.executable, {}), (system, {"PYTHONPATH": paths})):
        p = subprocess.run(
            [*_nobody([]), "env", *[f"{k}={v}" for k, v in env.items()], python, "-c", code],
            check=False,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if p.returncode == 0:
            return {"python": python, **({"env": {"set": env}} if env else {})}
        why.append(f"{python}: {p.stderr.strip()[-200:]}")
    pytest.skip(f"no interpreter that uid {NOBODY} can run ranks with: {why}")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKEXEC_FLOWER_")}
    env.update(RANKEXEC_LOG="warn", HOME="/nonexistent", **extra)
    return env


def _as_nobody(shared: Path, node: int, groups: list[int], **env: str) -> dict:
    """One ClientApp call from a child running as nobody (uid and gid 65534, with
    ``groups`` as its supplementary groups)."""
    p = subprocess.run(
        [*_nobody(groups), sys.executable, "-c", CALL, str(shared / "app"), str(node)],
        check=False,
        cwd=shared,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _host(argv: list[str], log: Path, **popen) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, **popen
        )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def _serving(node_dir: Path, proc: subprocess.Popen, log: Path) -> bool:
    assert proc.poll() is None, f"the host exited {proc.returncode}: {log.read_text()}"
    return "serving node" in log.read_text() and (node_dir / "host.sock").exists()


def test_a_peer_of_another_uid_is_refused_unless_allowed(shared: Path) -> None:
    """A root host allowing only uid 12345: nobody, a member of the host's group (so the
    folder lets it reach the socket), is refused by its credentials before a byte is
    read, and the host's log names its pid, uid and gid; nobody outside the group
    cannot reach the socket at all. The same host allowing nobody serves its full
    request through real ranks."""
    node = 7101
    site = shared / "site.json"
    site.write_text(json.dumps({"lease_s": 60}))
    site.chmod(0o644)
    node_dir = shared / "run" / "node"
    node_dir.parent.mkdir(mode=0o755)
    base = [sys.executable, "-m", "rankexec.flower.host", "--dir", str(node_dir)]
    base += ["--node-id", str(node), "--site", str(site), "--lease", "60"]
    env = {"RANKEXEC_FLOWER_NODE_DIR": str(node_dir), "RANKEXEC_FLOWER_HOST_UID": "0"}
    log = shared / "host-refusing.log"
    host = _host([*base, "--allow-uid", "12345"], log, env=_env())
    try:
        wait_until(lambda: _serving(node_dir, host, log), 60, "the host listening")
        modes = {n: stat.S_IMODE((node_dir / n).stat().st_mode) for n in ("secret", "host.sock")}
        st = node_dir.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o750, os.getegid())
        assert modes == {"secret": 0o640, "host.sock": 0o660}

        out = _as_nobody(shared, node, [os.getegid()], **env)
        pid, uid, gid = out["caller"]
        print(f"\n[peercred] refused peer sees: {out.get('error')}")
        assert "the host closed the channel before its handshake" in out["error"]
        assert f"uid {NOBODY}, gid {NOBODY}" in out["error"]
        line = f"refused a connection from pid {pid}, uid {uid}, gid {gid}"
        wait_until(lambda: line in log.read_text(), 30, "the host's log naming the peer")
        print(f"[peercred] host.log: {[x for x in log.read_text().splitlines() if line in x]}")

        p = subprocess.run(
            [*_nobody([os.getegid()]), sys.executable, "-c", TRIES, str(host.pid)]
            + [str(node_dir), str(site)],
            check=True,
            cwd=shared,
            capture_output=True,
            text=True,
            timeout=120,
        )
        tries = json.loads(p.stdout)
        print(f"[peercred] nobody, in the host's group, against a root host: {tries}")
        assert tries == {
            "signal the host": "PermissionError",
            "read the host's environment": "PermissionError",
            "write the site file": "PermissionError",
            "write in the node folder": "PermissionError",
            "replace the socket": "PermissionError",
            "read the secret": "done",  # the group's: the peer check is what keeps it out
        }
        assert host.poll() is None

        out = _as_nobody(shared, node, [], **env)  # not in the host's group
        assert "Permission denied" in out["error"], out
        assert log.read_text().count("refused a connection") == 1, "the OS refused it first"
        assert "metrics" not in out
    finally:
        _stop(host)

    log = shared / "host-allowing.log"
    host = _host([*base, "--allow-uid", "nobody"], log, env=_env())
    try:
        wait_until(lambda: _serving(node_dir, host, log), 60, "the host listening")
        out = _as_nobody(shared, node, [os.getegid()], **env)
        assert "error" not in out, out
        assert out["metrics"]["world"] == 2 and out["metrics"]["uid"] == 0, "ranks of the host"
        assert out["w"] == [0.0, 2.0, 4.0, 6.0]
        ranks = [out["metrics"]["pid"]]
    finally:
        _stop(host)
    assert not any(pid_alive(p) for p in ranks)

    # A host that allows nobody else (the default) refuses even root, who can reach its
    # private folder: the peer check is its own, not only the folder's mode.
    node_dir = shared / "own" / "node"
    node_dir.parent.mkdir(mode=0o755)
    os.chown(node_dir.parent, NOBODY, NOBODY)
    argv = [*_nobody([]), *base[:4], str(node_dir), *base[5:]]
    log = shared / "host-default.log"
    host = _host(argv, log, env=_env(), cwd=shared)
    try:
        wait_until(lambda: _serving(node_dir, host, log), 60, "the default host listening")
        assert stat.S_IMODE(node_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((node_dir / "host.sock").stat().st_mode) == 0o600
        with pytest.raises(_channel.ChannelError, match="closed the channel before its handshake"):
            _channel.connect(node_dir, timeout=10, host_uid=NOBODY)
        line = f"refused a connection from pid {os.getpid()}, uid 0, gid 0"
        wait_until(lambda: line in log.read_text(), 30, "the default host's log naming root")
    finally:
        _stop(host)


def _unit() -> tuple[dict[str, str], str, dict[str, str]]:
    """The unit's ``[Service]`` settings, its ``ExecStart`` and its ``Environment=``."""
    service: dict[str, str] = {}
    env: dict[str, str] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        key, _, value = line.partition("=")
        if section == "[Service]" and key == "Environment":
            name, _, v = value.partition("=")
            env[name] = v
        elif section == "[Service]":
            service[key] = value
    return service, service["ExecStart"], env


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    """``systemd-analyze verify`` finds nothing to say of the shipped unit (with this
    venv's interpreter in place of ``/opt/rankexec/venv/bin/python``, which verify
    requires to exist)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("no systemd-analyze here; test_the_unit_runs_the_host_as_its_user parses it")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/rankexec/venv/bin/python", sys.executable))
    p = subprocess.run(
        [tool, "verify", str(unit)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert (p.returncode, p.stdout + p.stderr) == (0, ""), p.stdout + p.stderr


def _call_here(app, node: int) -> dict:
    """The ``CALL`` script's ClientApp call, in this process (root, the SuperNode's side)."""
    import numpy as np
    from flwr.app import ArrayRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    run = 61
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, 1
    msg = Message(
        RecordDict({"arrays": ArrayRecord([np.arange(4, dtype=np.float32)])}),
        dst_node_id=node,
        message_type="train",
    )
    reply = app(msg, Context(run, node, {}, RecordDict(), {}))
    if reply.has_error():
        return {"error": reply.error.reason}
    return {
        "metrics": dict(reply.content["metrics"]),
        "w": reply.content["arrays"].to_numpy_ndarrays()[0].tolist(),
    }


def test_the_unit_runs_the_host_as_its_user(shared: Path, monkeypatch) -> None:
    """The unit's ``ExecStart``, run as its user (nobody here) with the unit's umask and
    ``--allow-uid root``: a root ClientApp told the host's uid is served by ranks of
    that uid; one that expects its own uid refuses the host, naming its uid; with no
    host listening, the ClientApp names the folder and starts none."""
    service, exec_start, unit_env = _unit()
    assert service["User"] == "rankexec" and service["RuntimeDirectory"] == "rankexec-flower"
    run_dir = shared / "run-rankexec-flower"  # RuntimeDirectory=, owned by the unit's user
    state = shared / "state"  # StateDirectory=
    for d in (run_dir, state):
        d.mkdir()
        os.chown(d, NOBODY, NOBODY)
    run_dir.chmod(int(service["RuntimeDirectoryMode"], 8))
    site = shared / "flower.json"
    # A lease of 1 s: the run's group closes soon after its message; the service host
    # stays (a host without --service leaves once it has no run and the lease passed).
    site.write_text(json.dumps({"lease_s": 1, **_ranks_python(shared)}))
    site.chmod(0o644)
    node_dir = run_dir / "node"
    env = dict(unit_env)
    env.update(
        RANKEXEC_FLOWER_NODE_DIR=str(node_dir),
        RANKEXEC_FLOWER_SITE=str(site),
        RANKEXEC_FLOWER_ALLOW_UID="root",
        RANKEXEC_FLOWER_NODE_ID="7102",
        XDG_STATE_HOME=str(state),
    )
    line = exec_start.replace("/opt/rankexec/venv/bin/python", sys.executable)
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line)
    argv = [*_nobody([]), *shlex.split(line)]
    log = shared / "unit-host.log"
    host = _host(argv, log, env=_env(**env), umask=int(service["UMask"], 8), cwd=shared)
    try:
        wait_until(lambda: _serving(node_dir, host, log), 60, "the unit's host listening")
        assert node_dir.stat().st_uid == NOBODY
        assert (node_dir / "secret").stat().st_mode & 0o777 == 0o640

        with pytest.raises(_channel.PeerRefused, match=f"of uid {NOBODY}, not the host's uid 0"):
            _channel.connect(node_dir, timeout=10)  # the host's uid is checked first
        import importlib

        monkeypatch.syspath_prepend(str(shared / "app"))
        for k, v in _env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("RANKEXEC_FLOWER_HOST_UID", raising=False)
        monkeypatch.setenv("RANKEXEC_FLOWER_NODE_DIR", str(node_dir))
        app = importlib.import_module("peerapp.client_app").app
        out = _call_here(app, 7102)
        assert "is not a folder of the host's uid 0" in out["error"], out

        monkeypatch.setenv("RANKEXEC_FLOWER_HOST_UID", "nobody")
        out = _call_here(app, 7102)
        assert "error" not in out, (out, log.read_text())
        assert out["metrics"]["uid"] == NOBODY and out["metrics"]["world"] == 2
        assert out["w"] == [0.0, 2.0, 4.0, 6.0]
        rank0 = out["metrics"]["pid"]
        lease = "closed the group of run 61 (the idle lease ran out)"
        wait_until(lambda: lease in log.read_text(), 60, "the run's lease closing its group")
        wait_until(lambda: not pid_alive(rank0), 30, "the run's ranks gone")
        sock = _channel.connect(node_dir, timeout=10, host_uid=NOBODY)
        with sock:  # the service host serves on with no run
            _channel.send(sock, {"op": "status"})
            assert _channel.recv(sock)["run_ids"] == []
        assert host.poll() is None and "shutting down" not in log.read_text()
        _stop(host)
        assert host.returncode == 0, log.read_text()
        out = _call_here(app, 7102)
        assert "a ClientApp does not start it" in out["error"], out
    finally:
        _stop(host)
        sys.modules.pop("peerapp.client_app", None)
        sys.modules.pop("peerapp", None)
    assert not (node_dir / "host.log").exists() and not (node_dir / "start.lock").exists()


def test_the_clientapp_checks_the_site_hosts_folder(tmp_path: Path, monkeypatch) -> None:
    """``RANKEXEC_FLOWER_NODE_DIR`` must be a folder of the host's uid that nobody else
    may write; ``RANKEXEC_FLOWER_HOST_UID`` names a known user."""
    from rankexec.flower import _peer

    d = tmp_path / "node"
    d.mkdir()
    d.chmod(0o770)
    monkeypatch.setenv("RANKEXEC_FLOWER_NODE_DIR", str(d))
    monkeypatch.delenv("RANKEXEC_FLOWER_HOST_UID", raising=False)
    with pytest.raises(_channel.ChannelError, match="can be written by others"):
        _peer.client_dir(1)
    d.chmod(0o750)
    assert _peer.client_dir(1) == d
    monkeypatch.setenv("RANKEXEC_FLOWER_HOST_UID", "nobody")
    with pytest.raises(_channel.ChannelError, match=f"not a folder of the host's uid {NOBODY}"):
        _peer.client_dir(1)
    monkeypatch.setenv("RANKEXEC_FLOWER_HOST_UID", "no-such-user-rankexec")
    with pytest.raises(_channel.ChannelError, match="no user named 'no-such-user-rankexec'"):
        _peer.client_dir(1)


def test_the_host_refuses_bad_peer_settings(tmp_path: Path, capsys) -> None:
    """An unknown user, allowed peers without ``--dir``, a shared folder its group may
    write: the host exits 2 naming each, and serves nothing."""
    from rankexec.flower import host

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o770)
    cases = [
        (["--dir", str(tmp_path / "a"), "--allow-uid", "no-such-user-rankexec"], "no user named"),
        (["--allow-gid", "0"], "--allow-uid/--allow-gid need --dir"),
        (["--dir", str(open_dir), "--allow-uid", "nobody"], "writable by its group"),
    ]
    for extra, why in cases:
        try:
            code = host.main(["--node-id", "7103", *extra])
        except SystemExit as e:  # argparse's error
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and why in err, (extra, code, err[-500:])
    assert not (open_dir / "host.sock").exists()
