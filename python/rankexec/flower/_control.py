"""A few questions to a SuperLink's Control API, asked in-process.

Why: ``rankexec.flower.deployment`` waits on runs and nodes; spawning the
``flwr`` CLI for each poll costs a second of CPU, a direct HTTP call costs a few
milliseconds. Uses flwr 1.42's ``ControlHttpClient`` as the CLI does.

Caveat: SuperLinks without account auth only (``--insecure``, or TLS with
``root_certificates``, the CA's PEM file); every failure returns None (the caller
falls back to its deadline). The node's host does not use it: it asks the Fleet API
(``_runcheck``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

__all__ = ["online_nodes", "run_status"]


def _client(address: str, root_certificates: str | None = None) -> Any:
    from flwr.cli.cli_client_interceptor import CliClientHttpInterceptor
    from flwr.supercore.control.control_http_client import ControlHttpClient
    from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor

    return ControlHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        # The PEM's bytes (a path would reach httpx as a deprecated `verify=<str>`).
        root_certificates=Path(root_certificates).read_bytes() if root_certificates else None,
        interceptors=[
            CliClientHttpInterceptor(),
            RuntimeVersionHttpInterceptor(component_name="flwr CLI"),
        ],
    )


def run_status(address: str, run_id: int, root_certificates: str | None = None) -> str | None:
    """``"running"``, ``"finished:completed"``, ``"finished:stopped"``..., or None."""
    try:
        from flwr.proto.control_pb2 import ListRunsRequest

        client = _client(address, root_certificates)
        try:
            res = client.ListRuns(ListRunsRequest(run_id=run_id))
        finally:
            with contextlib.suppress(Exception):
                client.close()
        run = res.run_dict.get(run_id)
        if run is None:
            return None
        st = run.status
        return f"{st.status}:{st.sub_status}" if st.sub_status else str(st.status)
    except Exception:  # noqa: BLE001 - see the module docs
        return None


def online_nodes(address: str, root_certificates: str | None = None) -> int | None:
    """How many SuperNodes are online, or None."""
    try:
        from flwr.proto.control_pb2 import ListNodesRequest

        client = _client(address, root_certificates)
        try:
            res = client.ListNodes(ListNodesRequest())
        finally:
            with contextlib.suppress(Exception):
                client.close()
        return sum(1 for n in res.nodes_info if str(n.status).lower() == "online")
    except Exception:  # noqa: BLE001 - see the module docs
        return None
