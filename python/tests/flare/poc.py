"""A real FLARE deployment for tests: `nvflare poc prepare` + `nvflare poc start`, driven
through FLARE's admin API (`nvflare.fuel.flare_api`), stopped and checked empty after.

Each `Poc` lives in its own folder: its own `HOME` (so `nvflare poc prepare` does not
rewrite the user's `~/.nvflare/config.conf`), its own `NVFLARE_POC_WORKSPACE`, and a
`project.yml` with free ports (two deployments, or a developer's own POC on 8002/8003,
do not collide). `nvflare poc start` runs in a session of its own; `stop()` runs `nvflare
poc stop`, then SIGKILLs whatever is still alive that belongs to this deployment (found
through /proc: its workspace in the command line or the environment) and returns what
it had to kill, so a test can assert that nothing was left.

(A module of its own, not conftest.py; see flare_helpers.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rankexec._ports import free_port

from .flare_helpers import NVFLARE, wait_until

PROJECT = "rxpoc"
ADMIN = "admin@nvidia.com"
START_CAP_S = float(os.environ.get("RANKEXEC_POC_START_CAP", "120"))


def _project_yml(fed_port: int, admin_port: int, clients: int) -> str:
    sites = "".join(
        f"- name: site-{i}\n  type: client\n  org: nvidia\n" for i in range(1, clients + 1)
    )
    return (
        "api_version: 3\n"
        f"name: {PROJECT}\n"
        "description: rankexec POC test\n"
        "participants:\n"
        "- name: server\n  type: server\n  org: nvidia\n"
        f"  fed_learn_port: {fed_port}\n  admin_port: {admin_port}\n  default_host: localhost\n"
        f"- name: {ADMIN}\n  type: admin\n  org: nvidia\n  role: project_admin\n"
        f"{sites}"
        "builders:\n"
        "- path: nvflare.lighter.impl.workspace.WorkspaceBuilder\n"
        "  args:\n    template_file: [master_template.yml]\n"
        "- path: nvflare.lighter.impl.static_file.StaticFileBuilder\n"
        "  args:\n    config_folder: config\n"
        "- path: nvflare.lighter.impl.cert.CertBuilder\n"
        "- path: nvflare.lighter.impl.signature.SignatureBuilder\n"
    )


def _proc_mentions(pid: int, needle: bytes) -> bool:
    for part in ("cmdline", "environ"):
        try:
            if needle in Path(f"/proc/{pid}/{part}").read_bytes():
                return True
        except OSError:
            return False
    return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Poc:
    """One POC deployment (server, `clients` clients) under `root`."""

    def __init__(self, root: Path, clients: int = 2) -> None:
        self.root = root
        self.clients = clients
        self.home = root / "home"
        self.ws = root / "ws"
        self.home.mkdir(parents=True, exist_ok=True)
        self.fed_port = free_port()
        self.admin_port = free_port()
        self.yml = root / "project.yml"
        self.yml.write_text(_project_yml(self.fed_port, self.admin_port, clients))
        self.env = dict(os.environ)
        self.env.update(
            HOME=str(self.home),
            NVFLARE_POC_WORKSPACE=str(self.ws),
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        self.starter: subprocess.Popen | None = None
        self._session: Any = None

    # --- the kit ------------------------------------------------------------------
    @property
    def prod(self) -> Path:
        return self.ws / PROJECT / "prod_00"

    def site(self, name: str) -> Path:
        return self.prod / name

    @property
    def sites(self) -> list[str]:
        return [f"site-{i}" for i in range(1, self.clients + 1)]

    @property
    def admin_kit(self) -> Path:
        return self.prod / ADMIN

    def nvflare(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(NVFLARE), *args],
            check=False,
            env=self.env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def prepare(self) -> None:
        r = self.nvflare("poc", "prepare", "-i", str(self.yml), "--force")
        assert r.returncode == 0, f"nvflare poc prepare: {r.stdout}\n{r.stderr}"
        assert (self.site("site-1") / "local" / "resources.json.default").exists(), r.stdout

    def site_step(self, *args: str) -> subprocess.CompletedProcess:
        """`python -m rankexec.flare ARGS` as a site operator runs it."""
        return subprocess.run(
            [sys.executable, "-m", "rankexec.flare", *args],
            check=False,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    # --- running ------------------------------------------------------------------
    def start(self) -> None:
        self.out = open(self.root / "poc-start.out", "w")  # noqa: SIM115
        self.starter = subprocess.Popen(
            [str(NVFLARE), "poc", "start", "-ex", ADMIN, "--timeout", str(int(START_CAP_S))],
            env=self.env,
            cwd=self.root,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        rc = self.starter.wait(timeout=START_CAP_S + 30)
        text = (self.root / "poc-start.out").read_text(errors="replace")
        assert rc == 0, f"nvflare poc start exited {rc}:\n{text[-4000:]}"
        s = self.session()
        ok = wait_until(lambda: self._clients_up(s), START_CAP_S, step=0.5)
        assert ok, f"clients did not connect: {s.get_system_info()}"

    def _clients_up(self, s: Any) -> bool:
        info = s.get_system_info()
        return len(info.client_info) >= self.clients

    def session(self) -> Any:
        if self._session is None:
            from nvflare.fuel.flare_api.flare_api import new_secure_session

            self._session = new_secure_session(ADMIN, str(self.admin_kit), timeout=60)
        return self._session

    def submit(self, job: Path) -> str:
        """Submits a copy of `job` (FLARE signs the folder it submits, in place)."""
        copy = self.root / "submitted" / f"{job.name}-{time.monotonic_ns()}"
        shutil.copytree(job, copy)
        return self.session().submit_job(str(copy))

    def meta(self, job_id: str) -> dict:
        return self.session().get_job_meta(job_id)

    def wait_status(self, job_id: str, prefix: str, timeout: float) -> dict:
        """Waits until the job's status starts with `prefix` or it finished; returns
        its meta (a test asserts on the status)."""
        last: dict = {}

        def reached() -> bool:
            nonlocal last
            last = self.meta(job_id)
            status = str(last.get("status", ""))
            return status.startswith((prefix, "FINISHED"))

        wait_until(reached, timeout, step=0.25)
        return last

    def job_dir(self, site: str, job_id: str) -> Path:
        return self.site(site) / job_id

    def job_processes(self, job_id: str) -> list[int]:
        """The live client job processes of a job (their command line names it)."""
        needle = job_id.encode()
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if needle in cmd and b"worker_process" in cmd and _alive(int(d.name)):
                found.append(int(d.name))
        return found

    def error_logs(self, job_id: str) -> dict[str, str]:
        logs = {}
        for site in ("server", *self.sites):
            p = self.site(site) / job_id / "error_log.txt"
            if p.exists():
                logs[f"{site}/{job_id}/error_log.txt"] = p.read_text(errors="replace")
        return logs

    def leftovers(self) -> list[int]:
        needle = str(self.ws).encode()
        return [
            int(d.name)
            for d in Path("/proc").iterdir()
            if d.name.isdigit()
            and int(d.name) != os.getpid()
            and _alive(int(d.name))
            and _proc_mentions(int(d.name), needle)
        ]

    def stop(self) -> list[int]:
        """`nvflare poc stop`; returns the pids it left behind (then SIGKILLed)."""
        if self._session is not None:
            try:
                self._session.close()
            except Exception as e:  # noqa: BLE001 (a dead server: nothing to close)
                print(f"closing the admin session: {e}")
            self._session = None
        self.nvflare("poc", "stop", timeout=120)
        wait_until(lambda: not self.leftovers(), 30, step=0.2)
        left = self.leftovers()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not self.leftovers(), 10, step=0.1)
        if getattr(self, "out", None):
            self.out.close()
        return left


def numpy_job_without_custom_code(root: Path, site_component: Path, rounds: int = 3) -> Path:
    """`examples/flare/numpy-fedavg` as a job without custom code: its rank class is
    installed on the site (`site_component`, an absolute path the site policy names),
    and the job only names it."""
    from .flare_helpers import REPO

    src = REPO / "examples" / "flare" / "numpy-fedavg"
    root.mkdir(parents=True, exist_ok=True)
    job = root / f"numpy-fedavg-site-{time.monotonic_ns()}"
    shutil.copytree(src, job)
    shutil.rmtree(job / "app" / "custom")
    cfg = job / "app" / "config" / "config_fed_client.json"
    client = json.loads(cfg.read_text())
    client["executors"][0]["executor"]["args"]["rank_component"] = f"{site_component}:AddDelta"
    cfg.write_text(json.dumps(client, indent=2))
    server_cfg = job / "app" / "config" / "config_fed_server.json"
    server = json.loads(server_cfg.read_text())
    for wf in server.get("workflows", []):
        if "num_rounds" in wf.get("args", {}):
            wf["args"]["num_rounds"] = rounds
    server_cfg.write_text(json.dumps(server, indent=2))
    return job


def log_dir_of(pid: int) -> str:
    """The `RANKEXEC_LOG_DIR=...` entry of a rank's environment ("" once it is gone):
    the folder names the job, so it tells whose rank a pid is."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return ""
    for var in env.split(b"\0"):
        if var.startswith(b"RANKEXEC_LOG_DIR="):
            return var.decode(errors="replace")
    return ""


def assert_completed(d: Poc, job_id: str, meta: dict) -> None:
    """The job finished as completed and no site logged an error."""
    assert meta.get("status") == "FINISHED:COMPLETED", json.dumps(meta, indent=1)[:3000]
    bad = {k: v for k, v in d.error_logs(job_id).items() if v.strip()}
    assert not bad, json.dumps(bad, indent=1)[:6000]
