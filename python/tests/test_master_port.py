"""The rendezvous port (`MASTER_PORT`) is reserved for a group's life among this
user's executors (executor/src/admission/ports.rs): groups started side by side, as the
sites of one FLARE simulator are, never get the same port, and the reservation is a
lock the OS holds for the executor until the group stops.

Checked by what the OS says: the port's lock file in the user's private directory
cannot be locked by this process while the group lives, and is gone once it stopped.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from conftest import executor_config, wait_until

from rankexec.host import RankGroup

GROUPS = 6


def ports_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "rankexec" if runtime else Path(f"/tmp/rankexec-{os.geteuid()}")
    return base / "ports"


def locked_elsewhere(port: int) -> bool:
    try:
        f = open(ports_dir() / str(port), "rb")  # noqa: SIM115
    except FileNotFoundError:  # a stopped group's lease removes its file
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_groups_started_side_by_side_get_distinct_ports_held_until_they_stop(tmp_path):
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
            assert locked_elsewhere(port), f"port {port} is not reserved while its group lives"
    finally:
        for g in groups:
            g.close()
    for port in ports:
        wait_until(
            lambda p=port: not (ports_dir() / str(p)).exists(),
            timeout=10,
            what=f"the lock file of port {port} to go with its group",
        )
