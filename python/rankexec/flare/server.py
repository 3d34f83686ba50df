"""A server-side widget that writes the ranks' errors into the server's log.

A client whose rank group fails replies ``EXECUTION_EXCEPTION`` with the typed error
in the reply's ``rankexec_error`` header. FLARE's workflows log only the return code;
with ``{"id": "rankexec_errors", "path": "rankexec.flare.RankErrorLogger", "args": {}}``
among the server's components, the server's log (and ``error_log.txt``) also says
which site's rank failed and why.
"""

from __future__ import annotations

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey, ReservedKey
from nvflare.apis.fl_context import FLContext

from rankexec.flare.executor import ERROR_HEADER


class RankErrorLogger(FLComponent):
    """Logs the ``rankexec_error`` header of every client result that carries one."""

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type != EventType.BEFORE_PROCESS_SUBMISSION:
            return
        result = fl_ctx.get_prop(FLContextKey.TASK_RESULT)
        if result is None:
            return
        error = result.get_header(ERROR_HEADER)
        if not error:
            return
        peer = fl_ctx.get_peer_context()
        site = peer.get_identity_name() if peer else fl_ctx.get_prop(ReservedKey.IDENTITY_NAME)
        self.log_error(fl_ctx, f"rank group on {site} failed: {error}")
