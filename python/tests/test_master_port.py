"""The rendezvous port (`MASTER_PORT`) is reserved for a group's life among the
executors of this network namespace (executor/src/admission/ports.rs): groups started
side by side, as the sites of one FLARE simulator are, never get the same port, and the
reservation is a socket the OS holds for the executor until the group stops.

Checked by what the OS says: the port's abstract socket name cannot be bound by this
process while the group lives, can be once it stopped, and no file is left anywhere
(the run directory holds nothing after the groups).
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from conftest import executor_config, wait_until

from rankexec.host import RankGroup

GROUPS = 6


def runtime_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "rankexec" if runtime else Path(f"/tmp/rankexec-{os.geteuid()}")


def reserved(port: int) -> bool:
    """Whether `port`'s name is bound elsewhere: by binding it (and letting go)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.bind(f"\0rankexec-master-port-{port}")
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
        return False


def lock_files() -> set[str]:
    """The first version's lock files (`ports/<port>`), which a killed host left behind."""
    try:
        return set(os.listdir(runtime_dir() / "ports"))
    except FileNotFoundError:
        return set()


def test_groups_started_side_by_side_get_distinct_ports_held_until_they_stop(tmp_path):
    before = lock_files()
    groups = []
    try:
        for i in range(GROUPS):
            cfg = executor_config("echo:MasterPort", 2, log_dir=tmp_path / f"g{i}")
            g = RankGroup(cfg, workspace=str(tmp_path / f"w{i}"))
            groups.append(g)
        ports = []
        for g in groups:
            r = g.execute("t", {}, {})
            ports.append(r.meta["port"])
        print("ports:", ports)
        assert len(set(ports)) == GROUPS, f"a port was handed to two groups: {ports}"
        for port in ports:
            assert reserved(port), f"port {port} is not reserved while its group lives"
    finally:
        for g in groups:
            g.close()
    for port in ports:
        wait_until(
            lambda p=port: not reserved(p),
            timeout=10,
            what=f"the reservation of port {port} to go with its group",
        )
    made = lock_files() - before
    assert not made, f"lock files of the first version's kind: {sorted(made)}"
