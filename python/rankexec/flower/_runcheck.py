"""Whether a run is still running, asked the way the node itself asks: the SuperLink's
Fleet API (``GetRun``), with the SuperNode's own connection settings.

Why: ``flwr stop`` never reaches a node. Flower 1.42's SuperNode does not interrupt
the ClientApp in flight, its main loop waits for that ClientApp's reply before it
talks to the SuperLink again, and its state keeps the run as it was when the run's
first message came; the ClientApp's token stays valid. The Control API, which ``flwr``
itself asks, belongs to the federation's users, not to a node's operator. The Fleet
API is the node's own channel: whatever TLS or node authentication the SuperLink uses,
it answers ``GetRun`` with the run while it runs and with ``FLEET_RUN_STATUS_NOT_ALLOWED``
(HTTP 403, code 2007) when it does not: before it starts (no node has its messages yet)
and once it is finished (stopped, completed or failed; a run never runs again). The host asks
every couple of seconds while a run holds a group, so a stopped run's ranks go within
seconds, also while the node's SuperNode is down or hung (the SuperLink answers, not
the SuperNode).

Settings: the SuperNode's own command line (``--superlink``, ``--insecure``,
``--root-certificates``, ``--auth-supernode-private-key``; relative paths from its
working directory), overridden by the site's ``superlink`` and the host's own
arguments (``--superlink``, ``--root-certificates``, ``--node-key``: for a host the
site starts itself).

Identity (every Fleet request is signed by a key the SuperLink knows):

- with SuperNode authentication (the SuperLink's ``--enable-supernode-auth``), the
  node's own key, the operator's ``--auth-supernode-private-key``: the host asks as
  the node itself; it holds no credential the SuperNode's operator does not (the key
  file is read by the user that runs the SuperNode and the host);
- without it (nodes register themselves), a key the host makes and registers the way a
  SuperNode registers itself (``RegisterNode``); it is never activated, so it is never
  online, never sampled and never sent a message, and it is unregistered when the host
  ends (``flwr supernode list`` shows it as ``registered``, then ``unregistered``).

Under the Simulation Engine there is no SuperNode: the host started by a Ray actor
finds the ``flwr-simulation`` process among the actor's ancestors and asks the
SuperLink at its ``--runtime-api-address`` (in flwr 1.42 one HTTP port serves the
Runtime and Fleet APIs), with a probe identity; the actor's end also ends the host.

Caveats: a SuperLink that cannot be reached, or that does not know the run (a restarted
SuperLink without a database), answers nothing: the run is left to its lease (or, under
the Simulation Engine, to the actors' end). A SuperLink with node authentication and a
host without the node's key cannot check (logged once).
"""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankexec.flower._supernode import flag

__all__ = ["FINISHED_CODE", "Fleet", "RunCheck", "settings"]

#: flwr's ApiErrorCode.FLEET_RUN_STATUS_NOT_ALLOWED: GetRun of a run that is not running.
FINISHED_CODE = 2007
# flwr's ApiErrorCode.FLEET_GET_RUN_FAILED: a run the SuperLink does not know.
_GET_RUN_FAILED = 2008
_DEFAULT_SUPERLINK = "127.0.0.1:9092"
_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Fleet:
    """How to reach the SuperLink's Fleet API as this node."""

    superlink: str
    insecure: bool
    root_certificates: str | None  # a PEM file; None: the system's (or insecure)
    node_key: str | None  # the node's OpenSSH EC private key; None: a probe key


def _argv(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _simulation_argv(pid: int) -> list[str]:
    """The command line of the ``flwr-simulation`` process among ``pid``'s ancestors
    (a Ray actor's: raylet, then the simulation process that started Ray), or []."""
    for _ in range(16):
        if pid <= 1:
            return []
        argv = _argv(pid)
        named = any(os.path.basename(a) == "flwr-simulation" for a in argv[:2])
        if named and "--runtime-api-address" in argv:
            return argv
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return []
        ppid = [ln for ln in status.splitlines() if ln.startswith("PPid:")]
        pid = int(ppid[0].split()[1]) if ppid else 0
    return []


def settings(
    supernode_pid: int | None,
    site: Mapping[str, Any],
    superlink: str | None = None,
    root_certificates: str | None = None,
    node_key: str | None = None,
) -> Fleet | None:
    """The Fleet settings for the node: the host's arguments, then the site's
    ``superlink``, then the SuperNode's command line. None when there is no SuperLink
    to ask (no SuperNode, as under the Simulation Engine, and no address given)."""
    argv = _argv(supernode_pid) if supernode_pid is not None else []
    is_supernode = any(os.path.basename(a) == "flower-supernode" for a in argv[:2])
    if not is_supernode:
        argv = []
        sim = _simulation_argv(supernode_pid) if supernode_pid is not None else []
        link = superlink or site.get("superlink") or flag(sim, "--runtime-api-address")
        if link:
            # The Simulation Engine: the SuperLink's one HTTP port serves the Runtime API
            # the simulation process uses and the Fleet API (a probe identity asks).
            root = root_certificates or flag(sim, "--root-certificates")
            return Fleet(
                superlink=str(link),
                insecure=not root and ("--insecure" in sim or not sim),
                root_certificates=str(root) if root else None,
                node_key=node_key,
            )
    cwd = Path("/")
    if is_supernode:
        with contextlib.suppress(OSError):
            cwd = Path(os.readlink(f"/proc/{supernode_pid}/cwd"))

    def path(value: str | None) -> str | None:
        return str(cwd / Path(value).expanduser()) if value else None

    link = superlink or site.get("superlink") or flag(argv, "--superlink")
    if not link and not is_supernode:
        return None
    root = root_certificates or path(flag(argv, "--root-certificates"))
    key = node_key or path(flag(argv, "--auth-supernode-private-key"))
    # Insecure as the SuperNode is, or for an address given without a CA (no SuperNode).
    insecure = not root_certificates and ("--insecure" in argv or not is_supernode and not root)
    return Fleet(
        superlink=str(link or _DEFAULT_SUPERLINK),
        insecure=insecure,
        root_certificates=str(root) if root and not insecure else None,
        node_key=str(key) if key else None,
    )


class RunCheck:
    """Asks the SuperLink whether runs are over, as the node (see the module docs).
    ``finished(run_id)``: True once the run is finished, False while it runs, None when
    the SuperLink gave no answer. Not thread-safe: one watching thread uses it."""

    def __init__(self, fleet: Fleet, node_id: int, log: Callable[[str], None]) -> None:
        self.fleet = fleet
        self.node_id = node_id
        self.log = log
        self._client: Any = None
        self._keys: Any = None  # (private, public)
        self._probe_id: int | None = None
        self._warned: set[str] = set()

    def _warn(self, what: str, text: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self.log(f"run-status check: {text}")

    def _connect(self) -> Any:
        if self._client is not None:
            return self._client
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.serialization import load_ssh_private_key
        from flwr.supercore.interceptors.http.runtime_version import (
            RuntimeVersionHttpInterceptor,
        )
        from flwr.supercore.primitives.asymmetric import generate_key_pairs
        from flwr.supernode.fleet_http_client import FleetHttpClient
        from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

        if self.fleet.node_key:
            key = load_ssh_private_key(Path(self.fleet.node_key).read_bytes(), None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{self.fleet.node_key} is not an EC private key")
            self._keys = (key, key.public_key())
        else:
            self._keys = generate_key_pairs()
        # As FleetHttpClient.from_server_address, with a short timeout: the watching
        # thread must not hang on a SuperLink that does not answer.
        verify: bool | ssl.SSLContext = True
        if self.fleet.root_certificates:
            verify = ssl.create_default_context(cafile=self.fleet.root_certificates)
        self._client = FleetHttpClient(
            f"{'http' if self.fleet.insecure else 'https'}://{self.fleet.superlink}",
            interceptors=[
                RuntimeVersionHttpInterceptor(component_name="SuperNode"),
                NodeAuthHttpInterceptor(*self._keys),
            ],
            verify=False if self.fleet.insecure else verify,
            timeout=_TIMEOUT_S,
        )
        return self._client

    def _identity(self, client: Any) -> int:
        """The node id the requests are signed for."""
        if self.fleet.node_key:
            return self.node_id
        if self._probe_id is None:
            from flwr.proto.fleet_pb2 import RegisterNodeFleetRequest
            from flwr.supercore.primitives.asymmetric import public_key_to_bytes

            public = public_key_to_bytes(self._keys[1])
            res = client.RegisterNode(RegisterNodeFleetRequest(public_key=public))
            probe = self._probe_id = int(res.node_id)
            self.log(
                f"run-status check: registered probe node {self._probe_id} (never"
                f" activated) with the SuperLink at {self.fleet.superlink}"
            )
            return probe
        return self._probe_id

    def finished(self, run_id: int) -> bool | None:
        import httpx
        from flwr.proto.node_pb2 import Node
        from flwr.proto.run_pb2 import GetRunRequest
        from flwr.supercore.error.base import FlowerError

        try:
            client = self._connect()
            node_id = self._identity(client)
            client.GetRun(GetRunRequest(node=Node(node_id=node_id), run_id=run_id))
            return False
        except httpx.HTTPStatusError as e:
            err = FlowerError.from_json(e.response.text)
            code = getattr(err, "code", None)
            message = str(getattr(err, "message", ""))
            if code == FINISHED_CODE:
                # "not running": pending, starting or finished; a node only sees a run's
                # messages once it runs, and a run never runs again, so: finished.
                return True
            if e.response.status_code == 401 and not self.fleet.node_key:
                self._probe_id = None  # unregistered meanwhile: register again next time
            detail = f"[{code}] {message}" if err else e.response.text[:200]
            self._warn(
                f"http-{code or e.response.status_code}",
                f"the SuperLink at {self.fleet.superlink} refused GetRun"
                f" ({e.response.status_code} {detail}); the run is left to its lease"
                + (
                    "; a SuperLink with node authentication needs the node's key (the"
                    " SuperNode's --auth-supernode-private-key or the host's --node-key)"
                    if not self.fleet.node_key and code != _GET_RUN_FAILED
                    else ""
                ),
            )
            return None
        except (httpx.HTTPError, OSError, ValueError, RuntimeError) as e:
            self._warn(
                type(e).__name__,
                f"no answer from the SuperLink at {self.fleet.superlink}: {e}",
            )
            return None

    def close(self) -> None:
        """Unregisters the probe node (if one was registered) and closes the client."""
        client, self._client = self._client, None
        if client is None:
            return
        if self._probe_id is not None:
            from flwr.proto.fleet_pb2 import UnregisterNodeFleetRequest

            with contextlib.suppress(Exception):
                client.UnregisterNode(UnregisterNodeFleetRequest(node_id=self._probe_id))
            self._probe_id = None
        with contextlib.suppress(Exception):
            client.close()
