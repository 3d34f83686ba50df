"""A local Flower Deployment Engine, offline, for tests, benchmarks and trying an app.

Why: the tests and the benchmark run apps under Flower's real Deployment Engine
(``flower-superlink``, ``flower-supernode``s, ``flwr run``), never a stand-in. This
module starts one in a private ``FLWR_HOME`` on free ports with telemetry and update
checks off and runtime dependency installation disabled, submits runs, waits for them
on conditions (the run's status and the online nodes through the SuperLink's Control
API, ``rankexec.flower._control``, in-process), and stops every process it
started by pid (``stop()``), SuperExecs included (they follow their parents through
``--parent-pid``).

Caveats: ``--insecure`` only (a loopback test federation); every wait is bounded and
raises ``DeploymentError`` with the logs' tails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rankexec.flower import _control

__all__ = ["Deployment", "DeploymentError", "free_port"]


class DeploymentError(RuntimeError):
    """A Flower process failed to start, or a run did not end in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else name


class Deployment:
    """A SuperLink and ``len(node_configs)`` SuperNodes under ``root`` (see the module
    docs). ``env`` is added to every process's environment."""

    def __init__(
        self,
        root: Path,
        node_configs: list[str],
        env: dict[str, str] | None = None,
        *,
        simulation_nodes: int = 0,
    ) -> None:
        self.root = Path(root)
        self.home = self.root / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1",
            # Flower starts `flower-superexec`, `flwr-clientapp`... by name.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            **(env or {}),
        }
        self.node_configs = node_configs
        # > 0: the Simulation Engine (Ray) with that many virtual SuperNodes instead.
        self.simulation_nodes = simulation_nodes
        self.port = 0
        self.superlink: subprocess.Popen[bytes] | None = None
        self.supernodes: list[subprocess.Popen[bytes]] = []
        self._logs: list[Path] = []
        self.last_failure = ""  # the ServerApp log of the last run that did not complete

    def _spawn(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        path = self.root / log
        self._logs.append(path)
        with open(path, "ab") as f:
            return subprocess.Popen(
                argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
            )

    def log_tail(self, n: int = 30) -> str:
        out = []
        for p in self._logs:
            with contextlib.suppress(OSError):
                lines = p.read_text(errors="replace").splitlines()[-n:]
                out.append(f"--- {p.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def start(self, timeout: float = 90.0) -> None:
        self.port = free_port()
        self.superlink = self._spawn(
            [
                _bin("flower-superlink"),
                "--insecure",
                "--disable-runtime-dependency-installation",
                "--port",
                str(self.port),
                *(["--simulation"] if self.simulation_nodes else []),
            ],
            "superlink.log",
        )
        config = (
            '[superlink]\ndefault = "dep"\n\n'
            f'[superlink.dep]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        if self.simulation_nodes:
            config += f"\n[superlink.dep.options]\nnum-supernodes = {self.simulation_nodes}\n"
        (self.home / "config.toml").write_text(config)
        for i, node_config in enumerate(self.node_configs):
            self.supernodes.append(
                self._spawn(
                    [
                        _bin("flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{self.port}",
                        "--port",
                        str(free_port()),
                        "--node-config",
                        node_config,
                    ],
                    f"supernode-{i}.log",
                )
            )
        deadline = time.monotonic() + timeout
        while not self._nodes_online():
            for p in [self.superlink, *self.supernodes]:
                if p.poll() is not None:
                    raise DeploymentError(f"{p.args!r} exited ({p.returncode})\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise DeploymentError(f"the federation did not come up\n{self.log_tail()}")
            time.sleep(0.5)

    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [_bin("flwr"), *args],
            env=self.env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _nodes_online(self) -> bool:
        if self.simulation_nodes:
            return _control.online_nodes(f"127.0.0.1:{self.port}") is not None
        n = _control.online_nodes(f"127.0.0.1:{self.port}")
        return n is not None and n >= len(self.node_configs)

    def submit(self, app_dir: Path, run_config: dict[str, Any] | None = None) -> int:
        """``flwr run APP dep``; returns the run id."""
        args = ["run", str(app_dir), "dep", "--format", "json"]
        if run_config:
            parts = []
            for k, v in run_config.items():
                parts.append(f"{k}={json.dumps(v)}")
            args += ["--run-config", " ".join(parts)]
        res = self.flwr(*args, timeout=180)
        m = re.search(r'"run-id"\s*:\s*"?(\d+)', res.stdout)
        if res.returncode != 0 or m is None:
            raise DeploymentError(
                f"flwr run failed ({res.returncode}): {res.stdout}\n{res.stderr}\n{self.log_tail()}"
            )
        return int(m.group(1))

    def status(self, run_id: int) -> str:
        """``running``, ``finished:completed``, ``finished:stopped``... (``""``: unknown)."""
        return _control.run_status(f"127.0.0.1:{self.port}", run_id) or ""

    def wait_run(self, run_id: int, timeout: float) -> str:
        """Waits until the run is finished; returns its status line (``finished:completed``...)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status(run_id)
            if st.startswith("finished"):
                if st != "finished:completed":
                    self.last_failure = self.run_log(run_id)
                return st
            if time.monotonic() > deadline:
                raise DeploymentError(
                    f"run {run_id} still {st!r} after {timeout}s\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def run_log(self, run_id: int) -> str:
        """The run's ServerApp log (``flwr log RUN dep --show``)."""
        res = self.flwr("log", str(run_id), "dep", "--show", timeout=60)
        return res.stdout + res.stderr

    def stop_run(self, run_id: int) -> subprocess.CompletedProcess[str]:
        return self.flwr("stop", str(run_id), "dep", timeout=60)

    def kill_supernode(self, i: int, sig: int = signal.SIGKILL) -> int:
        p = self.supernodes[i]
        p.send_signal(sig)
        p.wait(timeout=30)
        return p.pid

    def pids(self) -> list[int]:
        """The pids of the processes this deployment started (still running or not)."""
        return [p.pid for p in [self.superlink, *self.supernodes] if p is not None]

    def stop(self) -> None:
        """Stops every process it started, by pid (SIGTERM, then SIGKILL)."""
        procs = [p for p in [*self.supernodes, self.superlink] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
