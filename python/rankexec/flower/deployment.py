"""A local Flower Deployment Engine, offline, for tests, benchmarks and trying an app.

Why: the tests and the benchmark run apps under Flower's real Deployment Engine
(``flower-superlink``, ``flower-supernode``s, ``flwr run``), never a stand-in. This
module starts one in a private ``FLWR_HOME`` on free ports with telemetry and update
checks off and runtime dependency installation disabled, submits runs, waits for them
on conditions (the run's status and the online nodes through the SuperLink's Control
API, ``rankexec.flower._control``, in-process), and stops every process it
started by pid (``stop()``), SuperExecs included (they follow their parents through
``--parent-pid``).

Production shapes: ``tls=True`` runs the SuperLink with TLS (a CA and a certificate
for 127.0.0.1 made under ``root/tls`` by ``_tls``; the SuperNodes and ``flwr`` trust
the CA); ``node_auth=True`` adds SuperNode authentication (``--enable-supernode-auth``,
a key pair per node under ``root/keys``, each public key registered with ``flwr
supernode register`` before its SuperNode starts). Without either: ``--insecure``.
``pull="files"`` runs each SuperNode with ``--isolation process`` beside a
``rankexec-flower-superexec`` of its own (``rankexec.flower.superexec``: ClientApp
processes that pull a message's arrays into memory files).

Caveats: a loopback test federation; every wait is bounded and raises
``DeploymentError`` with the logs' tails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rankexec._ports import free_port
from rankexec.flower import _control, _tls

__all__ = ["Deployment", "DeploymentError", "free_port"]


class DeploymentError(RuntimeError):
    """A Flower process failed to start, or a run did not end in time."""


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
        simulation_cpus: float | None = None,
        tls: bool = False,
        node_auth: bool = False,
        pull: str = "flower",
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
        # "files": each SuperNode with `--isolation process` and its own
        # `rankexec-flower-superexec`, whose ClientApp processes pull a message's arrays
        # into memory files (rankexec.flower.superexec); "flower": Flower's own.
        if pull not in ("flower", "files"):
            raise ValueError(f"pull is 'flower' or 'files', not {pull!r}")
        self.pull = pull
        self.superexecs: list[subprocess.Popen[bytes]] = []
        # > 0: the Simulation Engine (Ray) with that many virtual SuperNodes instead.
        self.simulation_nodes = simulation_nodes
        # The CPUs Ray gives each virtual node's actor (Flower's default: 2), so how many
        # actors serve the virtual nodes at once.
        self.simulation_cpus = simulation_cpus
        self.port = 0
        self.superlink: subprocess.Popen[bytes] | None = None
        self.supernodes: list[subprocess.Popen[bytes]] = []
        self._logs: list[Path] = []
        self.last_failure = ""  # the ServerApp log of the last run that did not complete
        # TLS (node authentication needs it, as Flower does) and the nodes' keys.
        self.tls = _tls.make_tls(self.root / "tls") if (tls or node_auth) else None
        self.node_keys = (
            [_tls.make_node_key(self.root / "keys", f"node-{i}") for i in range(len(node_configs))]
            if node_auth
            else []
        )
        self._ca = str(self.tls.ca_cert) if self.tls else None

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
                *self._link_security(),
                "--disable-runtime-dependency-installation",
                "--port",
                str(self.port),
                *(["--simulation"] if self.simulation_nodes else []),
            ],
            "superlink.log",
        )
        config = (
            '[superlink]\ndefault = "dep"\n\n'
            f'[superlink.dep]\naddress = "127.0.0.1:{self.port}"\n'
            + (f'root-certificates = "{self._ca}"\n' if self._ca else "insecure = true\n")
        )
        if self.simulation_nodes:
            config += f"\n[superlink.dep.options]\nnum-supernodes = {self.simulation_nodes}\n"
            if self.simulation_cpus is not None:
                config += f"backend.client-resources.num-cpus = {self.simulation_cpus}\n"
        (self.home / "config.toml").write_text(config)
        deadline = time.monotonic() + timeout
        if self.node_keys:
            self._register_nodes(deadline)
        for i, node_config in enumerate(self.node_configs):
            runtime = free_port()
            isolation = ["--isolation", "process"] if self.pull == "files" else []
            node = self._spawn(
                [
                    _bin("flower-supernode"),
                    *self._node_security(i),
                    "--superlink",
                    f"127.0.0.1:{self.port}",
                    "--port",
                    str(runtime),
                    *isolation,
                    "--node-config",
                    node_config,
                ],
                f"supernode-{i}.log",
            )
            self.supernodes.append(node)
            if self.pull == "files":
                # The node's Runtime API is plain HTTP on loopback (Flower's default).
                self.superexecs.append(
                    self._spawn(
                        [
                            _bin("rankexec-flower-superexec"),
                            "--insecure",
                            "--runtime-api-address",
                            f"127.0.0.1:{runtime}",
                            "--parent-pid",
                            str(node.pid),
                        ],
                        f"superexec-{i}.log",
                    )
                )
        while not self._nodes_online():
            for p in [self.superlink, *self.supernodes, *self.superexecs]:
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

    def _link_security(self) -> list[str]:
        if self.tls is None:
            return ["--insecure"]
        args = [
            "--ssl-ca-certfile",
            str(self.tls.ca_cert),
            "--ssl-certfile",
            str(self.tls.server_cert),
            "--ssl-keyfile",
            str(self.tls.server_key),
        ]
        return args + (["--enable-supernode-auth"] if self.node_keys else [])

    def _node_security(self, i: int) -> list[str]:
        if self.tls is None:
            return ["--insecure"]
        args = ["--root-certificates", str(self.tls.ca_cert)]
        if self.node_keys:
            args += ["--auth-supernode-private-key", str(self.node_keys[i].private)]
        return args

    def _register_nodes(self, deadline: float) -> None:
        """``flwr supernode register`` of every node's public key, once the SuperLink
        answers."""
        while _control.online_nodes(f"127.0.0.1:{self.port}", self._ca) is None:
            if self.superlink is None or self.superlink.poll() is not None:
                raise DeploymentError(f"the SuperLink exited\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise DeploymentError(f"the SuperLink did not come up\n{self.log_tail()}")
            time.sleep(0.5)
        for i, key in enumerate(self.node_keys):
            res = self.flwr("supernode", "register", str(key.public), "dep", "--name", f"node-{i}")
            if res.returncode != 0:
                raise DeploymentError(
                    f"flwr supernode register failed ({res.returncode}): {res.stdout}"
                    f"\n{res.stderr}\n{self.log_tail()}"
                )

    def _nodes_online(self) -> bool:
        if self.simulation_nodes:
            return _control.online_nodes(f"127.0.0.1:{self.port}", self._ca) is not None
        n = _control.online_nodes(f"127.0.0.1:{self.port}", self._ca)
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
        return _control.run_status(f"127.0.0.1:{self.port}", run_id, self._ca) or ""

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
        procs = [self.superlink, *self.supernodes, *self.superexecs]
        return [p.pid for p in procs if p is not None]

    def stop(self) -> None:
        """Stops every process it started, by pid (SIGTERM, then SIGKILL)."""
        procs = [p for p in [*self.superexecs, *self.supernodes, self.superlink] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
