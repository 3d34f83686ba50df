"""A launcher for ranks on two emulated nodes: this network namespace (node 0) and the
namespace NS (node 1), for test_netns.py. The executor runs it as a `command` launcher.

    two_nodes.py torchrun NS HOST_ADDR PEER_ADDR HOST_IF PEER_IF WORLD PROGRAM ARGS...
        `torchrun --nnodes=2` on both nodes (WORLD/2 ranks each), c10d rendezvous at
        HOST_ADDR, gloo over the veth pair. Ends both agents when one ends, or on SIGTERM.

    two_nodes.py mpirun NS HOST_ADDR PEER_ADDR WORLD PROGRAM ARGS...
        `mpirun` with WORLD/2 slots on each node; Open MPI starts its daemon on the other
        node through this script's `rsh` mode (its `plm_rsh_agent`, standing in for ssh).

    two_nodes.py detached NS WORLD PROGRAM ARGS...
        WORLD ranks in NS, each in a session of its own (`RANK`, `WORLD_SIZE`, ...), the
        way ssh leaves processes on another host: a SIGTERM ends this launcher only, so
        the ranks must notice by themselves that the host is gone. Waits for them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from rankexec._ports import free_port

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _torchrun(argv: list[str]) -> int:
    ns, host, peer, host_if, peer_if, world, *cmd = argv
    per_node = int(world) // 2
    # torchrun's c10d endpoint needs a port chosen up front (its own limitation).
    port = free_port(host)
    rdzv_id = os.environ.get("RANKEXEC_LAUNCH_ID", "rankexec")

    def agent(node: int, addr: str, ifname: str) -> subprocess.Popen:
        args = [
            TORCHRUN,
            "--nnodes=2",
            f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{port}",
            f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=is_host={'1' if node == 0 else '0'}",
            f"--local-addr={addr}",
            "--max-restarts=0",
            "--no-python",
            *cmd,
        ]
        if node == 1:
            args = ["ip", "netns", "exec", ns, *args]
        env = dict(os.environ, GLOO_SOCKET_IFNAME=ifname)
        return subprocess.Popen(args, env=env)

    agents = [agent(0, host, host_if), agent(1, peer, peer_if)]

    def stop(*_: object) -> None:
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    _pid, status = os.wait()  # the first agent to end ends the job
    stop()
    for a in agents:
        try:
            a.wait(timeout=30)
        except subprocess.TimeoutExpired:
            a.kill()
            a.wait()
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _mpirun(argv: list[str]) -> int:
    ns, host, peer, world, *cmd = argv
    per_node = int(world) // 2
    subnet = host.rsplit(".", 1)[0] + ".0/24"
    env = dict(
        os.environ,
        TWO_NODES_NS=ns,
        OMPI_MCA_plm_rsh_agent=f"{sys.executable} {Path(__file__).resolve()} rsh",
        OMPI_MCA_oob_tcp_if_include=subnet,
        OMPI_MCA_btl_tcp_if_include=subnet,
        OMPI_MCA_btl="self,tcp",
        OMPI_MCA_pml="ob1",
        OMPI_MCA_odls_base_sigkill_timeout="0",
    )
    args = ["mpirun", "--host", f"{host}:{per_node},{peer}:{per_node}", "-np", world]
    if os.geteuid() == 0:
        args.append("--allow-run-as-root")
    # mpirun ends its ranks on SIGTERM (its own signal handling).
    return subprocess.call([*args, "--bind-to", "none", *cmd], env=env)


def _rsh(argv: list[str]) -> int:
    # Called by mpirun as `rsh HOST COMMAND...` for the other node: run it there.
    _host, *cmd = argv
    ns = os.environ["TWO_NODES_NS"]
    os.execvp("ip", ["ip", "netns", "exec", ns, "/bin/sh", "-c", " ".join(cmd)])
    return 127


def _detached(argv: list[str]) -> int:
    ns, world, *cmd = argv
    n = int(world)
    ranks = []
    for r in range(n):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_WORLD_SIZE=str(n),
        )
        ranks.append(
            subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, start_new_session=True)
        )
    # SIGTERM (the host's teardown) ends this launcher only: default action.
    code = 0
    for p in ranks:
        code = code or p.wait()
    return code


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    modes = {"torchrun": _torchrun, "mpirun": _mpirun, "rsh": _rsh, "detached": _detached}
    sys.exit(modes[mode](rest))
