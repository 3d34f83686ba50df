"""The ServerApp's side of ``rankexec.flower``: ``close_groups``.

Why: a node's rank group lives across rounds in its host; at the end of the
ServerApp's ``main`` every node is told to close this run's group (a message of
``CLOSE_MESSAGE_TYPE``, answered by ``rankexec.flower.ClientApp``), so the ranks do
not wait for their idle lease.

Caveats: a node that does not answer within ``timeout`` is reported ``False``; its
host still closes the run's group when the run ends or its lease runs out.
"""

from __future__ import annotations

from typing import Any

from flwr.app import Message, RecordDict

__all__ = ["CLOSE_MESSAGE_TYPE", "close_groups"]

CLOSE_MESSAGE_TYPE = "query.rankexec_close"


def close_groups(grid: Any, timeout: float = 120.0) -> dict[int, bool]:
    """From the ServerApp, at the end of ``main``: every node closes this run's rank
    group. Returns every node id the grid knows, mapped to whether it answered without
    an error (``False`` for a node that answered an error or did not answer)."""
    nodes = list(grid.get_node_ids())
    messages = [
        Message(RecordDict(), dst_node_id=n, message_type=CLOSE_MESSAGE_TYPE) for n in nodes
    ]
    replies = grid.send_and_receive(messages, timeout=timeout)
    out = {int(n): False for n in nodes}
    for r in replies:
        out[int(r.metadata.src_node_id)] = not r.has_error()
    return out
