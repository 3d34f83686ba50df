"""The guide's Flower deployment commands, run as the pages show them (their `run-in`
blocks, read from the pages through ``docrun.console``):

1. docs/flower-production.md, ``link-and-node``: a SuperLink with TLS and SuperNode
   authentication, ``flwr supernode register`` of the node's public key, the SuperNode
   with the CA and its private key, and ``flwr supernode list``, which shows it online.
   They run in a folder holding the files the page names under those names (``ca.crt``,
   ``server.pem``, ``server.key``, ``node-0``, ``node-0.pub``, made by ``_tls`` as
   ``Deployment(node_auth=True)`` makes them), with the Control API user's federation
   ``my-federation`` in the test's ``FLWR_HOME``; then a node without a registered key
   is refused (node authentication is on);
2. docs/flower-site.md, ``supernode-site``: the SuperNode whose ``--node-config`` names a
   site file (``rankexec-site="..."``), against an ``--insecure`` SuperLink; it comes
   online, and the node host's reading of its rules (``_site.supernode_settings`` of the
   SuperNode's pid, then ``_site.load``: what ``Host`` does for every message) finds
   that site file, the page's own (its ``file:`` block), and refuses past its limit
   naming it;
3. docs/flower-production.md, ``lean-node``: the SuperNode with ``--isolation process``
   and ``rankexec-flower-superexec`` beside it, against an ``--insecure`` SuperLink;
   the SuperExec takes the SuperNode as its ``--parent-pid``, and a run of
   ``pull_app``'s three multi-chunk arrays completes with every byte as sent on both
   ranks, the SuperExec's output naming the three arrays.

The only changes to the page's commands are the test's declared substitutions: the
SuperLink's address the page shows (``link.example.org:9092``, ``10.0.0.1:9092``) is
127.0.0.1 and a free port, and the site file's path is the test's copy. A daemon
(``flower-superlink``, ``flower-supernode``) is started with ``bash -c`` in a process
group of its own, the next command runs once it answers (what a reader waits for),
and its output is compared with the page's lines once it is stopped (SIGTERM; it must
still be running then, and exit 0 or by that signal). Every daemon is stopped in ``finally``, its pid
asserted gone, and no process carrying the test's folder in its environment is left.

Caveat: a SuperNode started as the pages show it serves its own Runtime API on
Flower's default 127.0.0.1:9094, so that port must be free (the test says so if not).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

import docrun
from docblocks import REPO, blocks, check_output

from rankexec.flower import _control, _runcheck, _site, _tls
from rankexec.flower.deployment import Deployment, free_port

from .helpers import pid_alive, pids_with_env, wait_until
from .pull_app import write_app

DAEMONS = ("flower-superlink", "flower-supernode", "rankexec-flower-superexec")
SUPERNODE_RUNTIME_PORT = 9094  # flower-supernode's --port default (flwr 1.42)


def _env(tmp: Path) -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)  # flwr, flower-superexec: the test venv's
    return {
        **os.environ,
        "HOME": str(tmp / "home"),
        "FLWR_HOME": str(tmp / "flwr-home"),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "PYTHONUNBUFFERED": "1",
        "PATH": os.pathsep.join([str(docrun.TARGET / "release"), bindir, os.environ["PATH"]]),
    }


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _shown(step: docrun.Step) -> str:
    """The command as the page shows it (its `\\` line ends, its comment), with the
    test's substitutions: ``Step.cmd`` where docrun gives it, else the argv joined."""
    return getattr(step, "cmd", "") or shlex.join(step.argv)


class Daemons:
    """The page's daemons, each started with ``bash -c`` in a session of its own."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[tuple[docrun.Step, subprocess.Popen[bytes], Path]] = []

    def start(self, step: docrun.Step, env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = self.tmp / f"daemon-{len(self.started)}.log"
        with log.open("wb") as f:
            p = subprocess.Popen(
                ["bash", "-c", _shown(step)],
                cwd=step.cwd,
                env=env | step.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.started.append((step, p, log))
        return p

    def alive(self) -> None:
        for step, p, log in self.started:
            assert p.poll() is None, (
                f"`{_shown(step)}` exited {p.returncode}:\n{log.read_text()[-3000:]}"
            )

    def stop_and_check(self) -> None:
        """SIGTERM to each group, newest first, once its output has the page's lines (a
        node is online at the SuperLink a moment before it logs its ID: 10 s); then each
        daemon's output and exit code against the page's lines."""
        for step, _, log in self.started:
            deadline = time.monotonic() + 10
            while check_output(step.expected, log.read_text(errors="replace")) is not None:
                if time.monotonic() > deadline:
                    break  # compared below, after the stop
                time.sleep(0.1)
        for _, p, _ in reversed(self.started):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for step, p, log in self.started:
            out = log.read_text(errors="replace")
            # Stopped by the test: 0, or the SIGTERM itself (flower-superlink's exit).
            assert p.returncode in (0, -signal.SIGTERM), f"exited {p.returncode}\n{out[-3000:]}"
            err = check_output(step.expected, out)
            assert err is None, f"`{_shown(step)}`: {err}\n{out[-3000:]}"

    def kill_all(self) -> None:
        """Whatever is left of every group (finally): SIGKILL, then every pid gone."""
        for _, p, _ in self.started:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        for _, p, _ in self.started:
            assert not pid_alive(p.pid), f"daemon {p.pid} still running"


def _run_step(step: docrun.Step, tmp: Path, env: dict[str, str], n: int) -> str:
    rc, out = docrun.run(step, tmp / f"step-{n}.log", 120, env)
    err = step.check(rc, out)
    assert err is None, f"`{shlex.join(step.argv)}`: {err}\n{out[-3000:]}"
    return out


def _wait_nodes(daemons: Daemons, link: str, ca: str | None, n: int) -> None:
    """Until the SuperLink at `link` answers with at least `n` nodes online (60 s), the
    daemons still running."""
    deadline = time.monotonic() + 60
    while (got := _control.online_nodes(link, ca)) is None or got < n:
        daemons.alive()
        assert time.monotonic() < deadline, f"{link}: not {n} nodes online in 60 s ({got})"
        time.sleep(0.25)


def _leave_nothing(tmp: Path, daemons: Daemons, dep: Deployment | None = None) -> None:
    try:
        daemons.kill_all()
        if dep is not None:
            dep.stop()
        wait_until(lambda: not pids_with_env(str(tmp)), 30, "no process of the test left")
    finally:
        for pid in pids_with_env(str(tmp)):  # never leave anything behind
            os.kill(pid, signal.SIGKILL)


def test_the_tls_and_node_auth_commands_run_as_shown(tmp_path: Path) -> None:
    """docs/flower-production.md's SuperLink, registration, SuperNode and node list,
    as shown: the SuperNode comes online with TLS and its own key."""
    assert _port_free(SUPERNODE_RUNTIME_PORT), "127.0.0.1:9094 (the SuperNode's) is taken"
    tls = _tls.make_tls(tmp_path)  # ca.crt, server.pem, server.key
    key = _tls.make_node_key(tmp_path, "node-0")  # node-0, node-0.pub
    assert (tls.ca_cert.name, tls.server_cert.name, tls.server_key.name) == (
        "ca.crt",
        "server.pem",
        "server.key",
    )
    assert (key.private.name, key.public.name) == ("node-0", "node-0.pub")
    port = free_port()
    link = f"127.0.0.1:{port}"
    # The Control API user's federation (what the page's `my-federation` is).
    (tmp_path / "flwr-home").mkdir()
    (tmp_path / "flwr-home" / "config.toml").write_text(
        f'[superlink.my-federation]\naddress = "{link}"\nroot-certificates = "{tls.ca_cert}"\n'
    )
    steps = docrun.console(
        "docs/flower-production.md",
        "link-and-node",
        paths={"link.example.org": Path("127.0.0.1"), "9092": Path(str(port))},
        cwd=tmp_path,
    )
    names = [Path(s.argv[0]).name for s in steps]
    assert names[0] == "flower-superlink" and "flower-supernode" in names, names
    env = _env(tmp_path)
    daemons = Daemons(tmp_path)
    t0 = time.monotonic()
    try:
        online = 0
        for n, step in enumerate(steps):
            name = Path(step.argv[0]).name
            if name in DAEMONS:
                daemons.start(step, env)
            else:
                _run_step(step, tmp_path, env, n)
            # What a reader waits for before the next command: the SuperLink answers
            # (its Control API), the SuperNode is online.
            if name == "flower-superlink":
                _wait_nodes(daemons, link, str(tls.ca_cert), 0)
            elif name == "flower-supernode":
                online += 1
                _wait_nodes(daemons, link, str(tls.ca_cert), online)
        assert online == 1
        # Node authentication is on: a node without a registered key is refused (the
        # keyless probe a node host would register; the check test_production.py makes).
        said: list[str] = []
        keyless = _runcheck.Fleet(link, False, str(tls.ca_cert), None)
        check = _runcheck.RunCheck(keyless, 0, said.append)
        try:
            assert check.finished(1) is None
        finally:
            check.close()  # an open connection would hold the SuperLink's shutdown
        assert len(said) == 1 and "needs the node's key" in said[0], said
        daemons.alive()
        daemons.stop_and_check()
    finally:
        _leave_nothing(tmp_path, daemons)
    print(f"\n[page commands] flower-production.md link-and-node: {time.monotonic() - t0:.1f}s")


def _page_site_file() -> str:
    """docs/flower-site.md's site file (its `file:` block)."""
    (b,) = [
        b
        for b in blocks(REPO / "docs" / "flower-site.md")
        if b.marker == ("file", "/tmp/rankexec-docs/flower.json")
    ]
    return b.text


def test_the_supernode_with_a_site_file_runs_as_shown(tmp_path: Path) -> None:
    """docs/flower-site.md's SuperNode, as shown, with the page's site file at the path
    its --node-config names: it comes online, and the host's reading of the SuperNode's
    rules finds that file."""
    assert _port_free(SUPERNODE_RUNTIME_PORT), "127.0.0.1:9094 (the SuperNode's) is taken"
    site_file = tmp_path / "flower.json"
    site_file.write_text(_page_site_file())
    dep = Deployment(tmp_path / "link", [])  # an --insecure SuperLink, no SuperNode
    daemons = Daemons(tmp_path)
    t0 = time.monotonic()
    try:
        dep.start()
        link = f"127.0.0.1:{dep.port}"
        steps = docrun.console(
            "docs/flower-site.md",
            "supernode-site",
            paths={"10.0.0.1:9092": Path(link), "/etc/rankexec/flower.json": site_file},
            cwd=tmp_path,
        )
        assert [Path(s.argv[0]).name for s in steps] == ["flower-supernode"]
        p = daemons.start(steps[0], _env(tmp_path))
        _wait_nodes(daemons, link, None, 1)
        # What the node's host reads (Host.__init__, then read_site for every message):
        # the SuperNode's own command line names the site file.
        settings = _site.supernode_settings(p.pid)
        assert settings is not None, _site.proc_argv(p.pid)
        node_config, env_site, superlink = settings
        assert node_config.get("rankexec-site") == str(site_file), node_config
        assert superlink == link
        site = _site.load(node_config, env_site)
        page = json.loads(_page_site_file())
        assert {k: site[k] for k in page} == page
        with pytest.raises(_site.SiteError, match=f"in the site file {site_file}"):
            _site.group_config(site, {"num_of_processes": page["max_processes"] + 1}, str(tmp_path))
        daemons.alive()
        daemons.stop_and_check()
    finally:
        _leave_nothing(tmp_path, daemons, dep)
    print(f"\n[page commands] flower-site.md supernode-site: {time.monotonic() - t0:.1f}s")


def test_the_node_with_rankexecs_superexec_runs_as_shown(tmp_path: Path) -> None:
    """docs/flower-production.md's SuperNode with ``--isolation process`` and
    ``rankexec-flower-superexec`` beside it, as shown, against an ``--insecure``
    SuperLink: the node comes online, a run whose message carries three multi-chunk
    arrays completes with every byte as sent on both ranks, the node's host watches
    that SuperNode (found by its Runtime API port), the SuperExec's output names the
    three arrays, and the SuperExec leaves with the SuperNode."""
    assert _port_free(SUPERNODE_RUNTIME_PORT), "127.0.0.1:9094 (the SuperNode's) is taken"
    rx = {"RANKEXEC_FLOWER_DIR": str(tmp_path / "rx")}
    env = _env(tmp_path) | rx
    dep = Deployment(tmp_path / "link", [], env=rx)
    daemons = Daemons(tmp_path)
    t0 = time.monotonic()
    try:
        dep.start()
        link = f"127.0.0.1:{dep.port}"
        steps = docrun.console(
            "docs/flower-production.md",
            "lean-node",
            paths={"10.0.0.1:9092": Path(link)},
            cwd=tmp_path,
        )
        names = [Path(s.argv[0]).name for s in steps]
        assert names == ["flower-supernode", "rankexec-flower-superexec"], names
        node = daemons.start(steps[0], env)
        _wait_nodes(daemons, link, None, 1)
        superexec = daemons.start(steps[1], env)
        result = tmp_path / "result.json"
        run = dep.submit(write_app(tmp_path, "rankexec"), {"result-file": str(result)})
        status = dep.wait_run(run, 600)
        assert status == "finished:completed", f"{status}\n{dep.last_failure}"
        res = json.loads(result.read_text())
        assert res.get("plus_one"), res
        for rank in (0, 1):
            seen = json.loads(Path(f"{result}.rank{rank}").read_text())
            assert {k: v[0] for k, v in seen.items()} == res["digests"], (rank, seen)
        # The node's host was told which SuperNode to watch: the page's.
        hosts = [p for p in pids_with_env(str(tmp_path)) if b"rankexec.flower.host" in _cmdline(p)]
        assert len(hosts) == 1, hosts
        assert f"--supernode-pid\0{node.pid}\0".encode() in _cmdline(hosts[0]), _cmdline(hosts[0])
        daemons.alive()
        # The SuperNode stopped (as its service would be): the SuperExec leaves with it.
        os.killpg(node.pid, signal.SIGTERM)
        node.wait(timeout=30)  # reaped, as its service manager would (a zombie "exists")
        wait_until(lambda: superexec.poll() is not None, 30, "the SuperExec gone with its node")
        print(f"[page commands] the SuperExec exited {superexec.returncode} after its node")
        daemons.stop_and_check()  # the node's output, the SuperExec's (the arrays named)
    finally:
        _leave_nothing(tmp_path, daemons, dep)
    print(f"\n[page commands] flower-production.md lean-node: {time.monotonic() - t0:.1f}s")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
