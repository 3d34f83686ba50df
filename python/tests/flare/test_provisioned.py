"""rankexec on a provisioned FLARE deployment, the shape a production site runs (not POC):
`nvflare provision` of a project with a server named by its DNS name
(`server1.example.com`, reached at localhost), two clients named as organisations name
them (`hospital-a`, `hospital-b`) and a project admin (`admin@acme.com`), each started
from its own startup kit (`startup/start.sh`, which keeps `sub_start.sh` restarting its
process until an admin shuts it down), with the kits' own certificates (mutual TLS).

The steps are the guide's own script, `examples/flare/production/site-steps.sh`
(docs/flare-production.md includes it): `nvflare provision`, `python -m rankexec.flare
allow-list` on the server's and both clients' kits, `python -m rankexec.flare policy` on
both clients, allowing the one rank component the sites install, each kit's `start.sh`. Then, through FLARE's admin API
(`nvflare.fuel.flare_api` with the admin's kit), on one deployment shared by the module:

- the Client API example (`examples/flare/client-api/jobs/rankexec`: `ScriptExecutor`,
  2 ranks per site, torch DDP), its deploy map naming the provisioned sites;
- `examples/flare/numpy-fedavg` as a job without custom code, under the site policy;
- an admin abort while the ranks train: `FINISHED:ABORTED`, every rank gone;
- `shutdown all` from the admin API: every process of the deployment (server, clients,
  their `sub_start.sh` loops, job processes, ranks) is gone.

The abort and the shutdown are the page's admin-API block itself (docs/flare-production.md,
`run-in: admin-api`): its statements run as shown, with its kit's and job's folders
mapped to this test's, and the test's waits and checks between them.

Each job's time from submission to its end is printed (`-s` shows it).

CI cost: the module took 242 s on 2 cores beside other suites (provisioning 8 s, start
13 s, the Client API job 74 s, the job without custom code 28 s, the abort 13 s, the
shutdown 7 s; docs/flare-production.md has the figures).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import docrun
import numpy as np
import pytest

from .flare_helpers import REPO, rank_pids, wait_until
from .poc import START_CAP_S, Poc, assert_completed, log_dir_of

JOB_CAP_S = float(os.environ.get("RANKEXEC_POC_JOB_CAP", "240"))
CLIENT_API = REPO / "examples" / "flare" / "client-api" / "jobs" / "rankexec"
PROJECT = "rxprod"
SERVER = "server1.example.com"
ADMIN = "admin@acme.com"
SITES = ["hospital-a", "hospital-b"]


def _project_yml(fed_port: int, admin_port: int) -> str:
    clients = "".join(f"- name: {s}\n  type: client\n  org: acme\n" for s in SITES)
    return (
        "api_version: 3\n"
        f"name: {PROJECT}\n"
        "description: rankexec on a provisioned deployment\n"
        "participants:\n"
        f"- name: {SERVER}\n  type: server\n  org: acme\n"
        f"  fed_learn_port: {fed_port}\n  admin_port: {admin_port}\n"
        # The DNS name is the server's identity; the clients reach it at localhost,
        # which its certificate also names.
        "  default_host: localhost\n  host_names: [localhost, 127.0.0.1]\n"
        f"- name: {ADMIN}\n  type: admin\n  org: acme\n  role: project_admin\n"
        f"{clients}"
        "builders:\n"
        "- path: nvflare.lighter.impl.workspace.WorkspaceBuilder\n"
        "  args:\n    template_file: [master_template.yml]\n"
        "- path: nvflare.lighter.impl.static_file.StaticFileBuilder\n"
        "  args:\n    config_folder: config\n"
        "- path: nvflare.lighter.impl.cert.CertBuilder\n"
        "- path: nvflare.lighter.impl.signature.SignatureBuilder\n"
    )


class Provisioned(Poc):
    """A provisioned deployment under `root`: Poc's free ports, own HOME, admin API
    helpers and leftover check, with an admin `shutdown all` in place of `nvflare poc
    stop`; the fixture provisions and starts it with the page's script."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, clients=len(SITES))
        self.yml.write_text(_project_yml(self.fed_port, self.admin_port))

    @property
    def prod(self) -> Path:
        return self.ws / PROJECT / "prod_00"

    @property
    def sites(self) -> list[str]:
        return list(SITES)

    @property
    def admin_kit(self) -> Path:
        return self.prod / ADMIN

    def session(self) -> Any:
        if self._session is None:
            from nvflare.fuel.flare_api.flare_api import new_secure_session

            self._session = new_secure_session(ADMIN, str(self.admin_kit), timeout=60)
        return self._session

    def error_logs(self, job_id: str) -> dict[str, str]:
        logs = {}
        for site in (SERVER, *self.sites):
            p = self.site(site) / job_id / "error_log.txt"
            if p.exists():
                logs[f"{site}/{job_id}/error_log.txt"] = p.read_text(errors="replace")
        return logs

    def shutdown(self) -> None:
        """`shutdown all` through the admin API (clients first, then the server),
        not waited for by the API: its own wait for the server's end reads the closed
        connection as a communication error and times out after 30 s (nvflare 2.9.0);
        the processes are what the caller checks."""
        from nvflare.fuel.flare_api.api_spec import TargetType

        if self._session is None:
            return
        try:
            self._session.shutdown(TargetType.ALL, wait=False)
        except Exception as e:  # noqa: BLE001 (a server already gone)
            print(f"shutdown all: {type(e).__name__}: {e}")
        try:
            self._session.close()
        except Exception as e:  # noqa: BLE001 (the server is gone)
            print(f"closing the admin session: {type(e).__name__}: {e}")
        self._session = None

    def stop(self) -> list[int]:
        """Shuts the deployment down; returns the pids left after 60 s (then killed)."""
        self.shutdown()
        wait_until(lambda: not self.leftovers(), 60, step=0.2)
        left = self.leftovers()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not self.leftovers(), 10, step=0.1)
        return left


def client_api_job(root: Path, rounds: int | None = None, epochs: int | None = None) -> Path:
    """The Client API example with its deploy map naming the provisioned sites (its apps
    keep their folder names)."""
    job = root / f"client-api-{time.monotonic_ns()}"
    shutil.copytree(CLIENT_API, job)
    meta = json.loads((job / "meta.json").read_text())
    meta["deploy_map"] = {
        "app_server": ["server"],
        "app_site-1": [SITES[0]],
        "app_site-2": [SITES[1]],
    }
    (job / "meta.json").write_text(json.dumps(meta, indent=2))
    if rounds is not None:
        server_cfg = job / "app_server" / "config" / "config_fed_server.json"
        server = json.loads(server_cfg.read_text())
        server["workflows"][0]["args"]["num_rounds"] = rounds
        server_cfg.write_text(json.dumps(server, indent=2))
    if epochs is not None:
        for app in ("app_site-1", "app_site-2"):
            cfg = job / app / "config" / "config_fed_client.json"
            client = json.loads(cfg.read_text())
            client["executors"][0]["executor"]["args"]["script_args"] = f"--epochs {epochs}"
            cfg.write_text(json.dumps(client, indent=2))
    return job


WHERE = "docs/flare-production.md (admin-api)"


def admin_api_block(d: Provisioned, job: Path) -> list[str]:
    """docs/flare-production.md's admin-API block, statement by statement, with the page's
    kit folder and job folder mapped to this deployment's and `job` (a copy: FLARE signs
    the folder it submits)."""
    return docrun.statements(
        "docs/flare-production.md",
        "admin-api",
        paths={"ws/rxprod/prod_00": d.prod, "examples/flare/client-api/jobs/rankexec": job},
    )


def rank_log_says(d: Provisioned, job_id: str, site: str, text: str) -> bool:
    for log in d.job_dir(site, job_id).rglob("rankexec/rank-0/stdout.log"):
        if text in log.read_text(errors="replace"):
            return True
    return False


def job_rank_pids(d: Provisioned, job_id: str) -> list[int]:
    return [p for p in rank_pids(d.ws) if job_id in log_dir_of(p)]


def run_job(d: Provisioned, job: Path) -> tuple[str, dict, float]:
    """Submits `job`, waits for its end; returns its id, meta and seconds it took."""
    t0 = time.monotonic()
    job_id = d.submit(job)
    meta = d.wait_status(job_id, "FINISHED", JOB_CAP_S)
    return job_id, meta, time.monotonic() - t0


@pytest.fixture(scope="module")
def prov(tmp_path_factory):
    root = tmp_path_factory.mktemp("provisioned")
    d = Provisioned(root)
    code = root / "site-code"
    code.mkdir()
    shutil.copy(REPO / "examples/flare/numpy-fedavg/app/custom/np_delta.py", code)
    d.component = code / "np_delta.py"
    # docs/flare-production.md's steps, the page's script itself, with this test's
    # project.yml (free ports), folders and rank code: provision, allow-list on the
    # three kits, the clients' policy, each kit's start.sh (in the script's session).
    site_steps = REPO / "examples" / "flare" / "production" / "site-steps.sh"
    env = dict(
        d.env,
        PROJECT_YML=str(d.yml),
        WS=str(d.ws),
        KIT=str(d.prod),
        SERVER=SERVER,
        SITES=" ".join(d.sites),
        COMPONENT=f"{d.component}:AddDelta",
        PROVISION_ARGS="--force",
    )
    out = root / "site-steps.out"
    t0 = time.monotonic()
    try:
        steps = docrun.start(["bash", str(site_steps)], out, cwd=root, env=env)
        rc = docrun.finish(steps, out, 180, str(site_steps))
        text = out.read_text(errors="replace")
        assert rc == 0, f"{site_steps} exited {rc}:\n{text[-4000:]}"
        for kit in (SERVER, *d.sites):
            assert (d.site(kit) / "startup" / "start.sh").exists(), text[-4000:]
            assert (d.site(kit) / "local" / "resources.json").exists(), text[-4000:]
        for site in d.sites:
            assert (d.site(site) / "local" / "rankexec.json").exists(), text[-4000:]
        s = d.session()
        ok = wait_until(lambda: d._clients_up(s), START_CAP_S, step=0.5)
        assert ok, f"clients did not connect: {s.get_system_info()}"
        print(f"site steps -> both clients connected: {time.monotonic() - t0:.1f} s")
        yield d
    finally:
        left = d.stop()
        assert not left, f"the deployment left these processes behind: {left}"
        assert not rank_pids(d.ws)


def test_the_kits_are_provisioned_ones(prov):
    """What differs from POC: participant names, certificates naming them, the admin's
    role in its own certificate, and no POC marker."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    def subject(cert: Path) -> x509.Name:
        return x509.load_pem_x509_certificate(cert.read_bytes()).subject

    server = subject(prov.site(SERVER) / "startup" / "server.crt")
    assert server.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == SERVER
    for site in SITES:
        c = subject(prov.site(site) / "startup" / "client.crt")
        assert c.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == site
        fed = json.loads((prov.site(site) / "startup" / "fed_client.json").read_text())
        assert json.dumps(fed).count("localhost") >= 1, fed
    admin = subject(prov.admin_kit / "startup" / "client.crt")
    assert admin.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == ADMIN
    assert admin.get_attributes_for_oid(NameOID.UNSTRUCTURED_NAME)[0].value == "project_admin"
    info = prov.session().get_system_info()
    assert sorted(c.name for c in info.client_info) == SITES


def test_the_client_api_example_with_script_executor(prov, tmp_path):
    job_id, meta, secs = run_job(prov, client_api_job(tmp_path))
    print(f"Client API job (ScriptExecutor, 2 sites x 2 ranks): {secs:.1f} s")
    assert_completed(prov, job_id, meta)
    for site in prov.sites:
        assert rank_log_says(prov, job_id, site, f"{site} round 2:"), site
    assert wait_until(lambda: not job_rank_pids(prov, job_id), 30, step=0.1)


def test_a_job_without_custom_code_under_the_site_policy(prov, tmp_path):
    from .poc import numpy_job_without_custom_code

    job_id, meta, secs = run_job(
        prov, numpy_job_without_custom_code(tmp_path, prov.component, rounds=3)
    )
    print(f"job without custom code (numpy-fedavg, 3 rounds): {secs:.1f} s")
    assert not meta.get("byoc"), meta
    assert_completed(prov, job_id, meta)
    result = Path(prov.session().download_job_result(job_id, str(tmp_path / "result")))
    models = list(result.rglob("server.npy"))
    assert models, f"no server.npy in the job's result {result}"
    initial = np.arange(1, 10, dtype=np.float32).reshape(3, 3)
    np.testing.assert_allclose(np.load(models[0]), initial + 3.0)
    assert not job_rank_pids(prov, job_id)


def test_an_admin_abort_while_the_ranks_train(prov, tmp_path):
    """The page's admin-API block up to its abort: its session from the admin's kit, its
    `submit_job`, then (once the ranks train) its status, which must be RUNNING, and its
    `abort_job`; its `shutdown` is the last test's."""
    stmts = admin_api_block(prov, client_api_job(tmp_path, rounds=50, epochs=40))
    assert [x for x in stmts if ".abort_job(" in x] and [x for x in stmts if ".shutdown(" in x]
    ns: dict[str, Any] = {}
    PAGE_SESSION.append(ns)
    rest = iter(stmts)
    for stmt in rest:  # up to and including the submission
        docrun.execute(stmt, ns, WHERE)
        if ".submit_job(" in stmt:
            break
    job_id = ns["job_id"]
    assert wait_until(
        lambda: all(rank_log_says(prov, job_id, s, "round 0:") for s in prov.sites),
        JOB_CAP_S,
        step=0.2,
    ), prov.meta(job_id)
    pids = job_rank_pids(prov, job_id)
    assert len(pids) == 4, pids  # 2 sites x 2 ranks, training
    t0 = time.monotonic()
    for stmt in rest:  # the status, the abort
        if ".shutdown(" in stmt:
            break
        value = docrun.execute(stmt, ns, WHERE)
        if ".get_job_meta(" in stmt:
            assert value == "RUNNING", value
    meta = prov.wait_status(job_id, "FINISHED", JOB_CAP_S)
    assert meta.get("status") == "FINISHED:ABORTED", meta
    gone = wait_until(lambda: not job_rank_pids(prov, job_id), 60, step=0.05)
    print(f"admin abort -> every rank gone: {time.monotonic() - t0:.2f} s")
    assert gone, f"ranks still alive after the abort: {job_rank_pids(prov, job_id)}"


# The namespace the page's block ran in (its admin session `s`), for its `shutdown`.
PAGE_SESSION: list[dict[str, Any]] = []


def test_shutdown_all_leaves_nothing(prov):
    """The last test: the page's `shutdown` statement, from its own admin session, ends
    every process of the deployment (the fixture's teardown then finds nothing to kill)."""
    assert prov.leftovers(), "the deployment is running before the shutdown"
    assert PAGE_SESSION, "the abort test, which runs the page's block up to here, ran first"
    ns = PAGE_SESSION[-1]
    (stmt,) = [x for x in admin_api_block(prov, CLIENT_API) if ".shutdown(" in x]
    t0 = time.monotonic()
    docrun.execute(stmt, ns, WHERE)
    gone = wait_until(lambda: not prov.leftovers(), 60, step=0.2)
    print(f"shutdown all -> every process gone: {time.monotonic() - t0:.1f} s")
    for session in (ns.get("s"), prov._session):
        try:
            if session is not None:
                session.close()
        except Exception as e:  # noqa: BLE001 (the server is gone)
            print(f"closing an admin session: {type(e).__name__}: {e}")
    prov._session = None  # nothing left for the teardown's own shutdown
    assert gone, f"alive after shutdown all: {prov.leftovers()}"
    assert not rank_pids(prov.ws)
