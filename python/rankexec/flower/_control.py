"""A few questions to an insecure SuperLink's Control API, asked in-process.

Why: the per-node host checks whether its run is still running (to act on ``flwr
stop``), and ``rankexec.flower.deployment`` waits on runs and nodes; spawning the
``flwr`` CLI for each poll costs a second of CPU, a direct HTTP call costs a few
milliseconds. Uses flwr 1.42's ``ControlHttpClient`` as the CLI does.

Caveat: ``--insecure`` SuperLinks without account auth only; every failure returns
None (the caller falls back to its lease or its deadline).
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["online_nodes", "run_status"]


def _client(address: str) -> Any:
    from flwr.cli.cli_client_interceptor import CliClientHttpInterceptor
    from flwr.supercore.control.control_http_client import ControlHttpClient
    from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor

    return ControlHttpClient.from_server_address(
        server_address=address,
        insecure=True,
        root_certificates=None,
        interceptors=[
            CliClientHttpInterceptor(),
            RuntimeVersionHttpInterceptor(component_name="flwr CLI"),
        ],
    )


def run_status(address: str, run_id: int) -> str | None:
    """``"running"``, ``"finished:completed"``, ``"finished:stopped"``..., or None."""
    try:
        from flwr.proto.control_pb2 import ListRunsRequest

        client = _client(address)
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


def online_nodes(address: str) -> int | None:
    """How many SuperNodes are online, or None."""
    try:
        from flwr.proto.control_pb2 import ListNodesRequest

        client = _client(address)
        try:
            res = client.ListNodes(ListNodesRequest())
        finally:
            with contextlib.suppress(Exception):
                client.close()
        return sum(1 for n in res.nodes_info if str(n.status).lower() == "online")
    except Exception:  # noqa: BLE001 - see the module docs
        return None
