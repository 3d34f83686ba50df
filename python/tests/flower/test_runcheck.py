"""rankexec.flower._runcheck without a federation: where the node host's run-status check
gets its settings (a real process named ``flower-supernode``, its relative paths read
from its working directory), and each answer it gives when the SuperLink cannot be
asked. The SuperLink's own answers (a run that runs, a stopped run, TLS, node keys) are
in test_production.py. Seconds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from rankexec.flower import _runcheck, _tls

from .helpers import pid_alive, wait_until


@pytest.fixture
def supernode(tmp_path: Path):
    """A process that looks like a SuperNode with TLS and a node key (relative paths)."""
    argv = [
        "flower-supernode",
        "-c",
        "import time; time.sleep(120)",
        "--superlink",
        "link.example.org:9092",
        "--root-certificates",
        "certs/ca.crt",
        "--auth-supernode-private-key=keys/node-0",
    ]
    p = subprocess.Popen(argv, executable=sys.executable, cwd=tmp_path)
    try:
        wait_until(
            lambda: Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(b"flower-"), 30, "argv"
        )
        yield p.pid
    finally:
        p.kill()
        p.wait(30)
    assert not pid_alive(p.pid)


def test_settings_come_from_the_supernodes_own_command_line(supernode, tmp_path: Path) -> None:
    fleet = _runcheck.settings(supernode, {})
    assert fleet == _runcheck.Fleet(
        superlink="link.example.org:9092",
        insecure=False,
        root_certificates=str(tmp_path / "certs/ca.crt"),
        node_key=str(tmp_path / "keys/node-0"),
    )
    # The host's own arguments (a host the site starts) and the site's address win.
    fleet = _runcheck.settings(
        supernode, {"superlink": "10.0.0.1:9092"}, None, "/etc/ca.pem", "/etc/node.key"
    )
    assert fleet is not None
    assert (fleet.superlink, fleet.root_certificates, fleet.node_key) == (
        "10.0.0.1:9092",
        "/etc/ca.pem",
        "/etc/node.key",
    )


def test_under_the_simulation_engine_the_simulation_process_names_the_superlink(
    tmp_path: Path,
) -> None:
    """A Ray actor's ancestors include ``flwr-simulation`` (raylet's parent): its
    ``--runtime-api-address`` is the SuperLink's port."""
    code = (
        "import subprocess, sys, time;"
        " c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
        " print(c.pid, flush=True); time.sleep(120)"
    )
    argv = ["flwr-simulation", "-c", code, "--runtime-api-address", "127.0.0.1:9091"]
    p = subprocess.Popen(
        [*argv, "--token", "t", "--insecure"],
        executable=sys.executable,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        actor = int(p.stdout.readline())
        fleet = _runcheck.settings(actor, {})
        assert fleet == _runcheck.Fleet("127.0.0.1:9091", True, None, None)
        os.kill(actor, signal.SIGKILL)
    finally:
        p.kill()
        p.wait(30)


def test_no_supernode_and_no_address_means_no_check() -> None:
    # The Simulation Engine: the pid is a Ray actor, not a SuperNode.
    assert _runcheck.settings(None, {}) is None
    assert _runcheck.settings(1, {}) is None  # init is no SuperNode
    fleet = _runcheck.settings(None, {"superlink": "127.0.0.1:9092"})
    assert fleet is not None and fleet.insecure  # an address without a CA


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_superlink_that_does_not_answer_leaves_the_run_to_its_lease(tmp_path: Path) -> None:
    said: list[str] = []
    fleet = _runcheck.Fleet(f"127.0.0.1:{_closed_port()}", True, None, None)
    check = _runcheck.RunCheck(fleet, 7, said.append)
    assert check.finished(1) is None
    assert check.finished(1) is None
    assert len(said) == 1 and "no answer from the SuperLink" in said[0], said  # said once
    check.close()


def test_a_node_key_that_is_not_an_ec_key_is_refused(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = tmp_path / "ed25519"
    key.write_bytes(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    said: list[str] = []
    fleet = _runcheck.Fleet(f"127.0.0.1:{_closed_port()}", True, None, str(key))
    assert _runcheck.RunCheck(fleet, 7, said.append).finished(1) is None
    assert "not an EC private key" in said[0], said
    said.clear()
    missing = _runcheck.Fleet(f"127.0.0.1:{_closed_port()}", True, None, str(tmp_path / "no"))
    assert _runcheck.RunCheck(missing, 7, said.append).finished(1) is None
    assert "No such file" in said[0], said


def test_the_test_ca_signs_a_certificate_for_the_loopback_address(tmp_path: Path) -> None:
    import ssl

    tls = _tls.make_tls(tmp_path / "tls")
    key = _tls.make_node_key(tmp_path / "keys", "node-0")
    assert tls.server_key.stat().st_mode & 0o777 == 0o600
    assert key.private.stat().st_mode & 0o777 == 0o600
    assert key.public.read_text().startswith("ecdsa-sha2-nistp384 ")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tls.server_cert, tls.server_key)
    client = ssl.create_default_context(cafile=str(tls.ca_cert))
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(True)
        b.setblocking(True)
        import threading

        done: list[str] = []

        def serve() -> None:
            with server.wrap_socket(a, server_side=True) as s:
                done.append(s.recv(2).decode())

        t = threading.Thread(target=serve)
        t.start()
        with client.wrap_socket(b, server_hostname="127.0.0.1") as c:
            c.sendall(b"ok")
        t.join(30)
    assert done == ["ok"]
