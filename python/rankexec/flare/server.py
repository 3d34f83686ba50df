"""A server-side widget that writes the ranks' errors into the server's log.

A client whose rank group fails replies ``EXECUTION_EXCEPTION`` with the typed error
in the reply's ``rankexec_error`` header. FLARE's workflows log only the return code;
with ``{"id": "rankexec_errors", "path": "rankexec.flare.RankErrorLogger", "args": {}}``
among the server's components, the server's log (and ``error_log.txt``) also says
which site's rank failed and why.
"""

from __future__ import annotations

from typing import Any

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey, ReservedKey
from nvflare.apis.fl_context import FLContext

from rankexec.flare.executor import ERROR_HEADER, keep_rankexec_out_of_custom


class RankErrorLogger(FLComponent):
    """Logs the ``rankexec_error`` header of every client result that carries one."""

    # The documented path (what sites allow, what FLARE's Job API exports).
    __module__ = "rankexec.flare"

    def add_to_fed_job(self, job: Any, ctx: Any, **kwargs: Any) -> Any:
        """FLARE's Job API hook (``job.to(RankErrorLogger(), "server")``): adds this
        component without copying this package's source into the job."""
        keep_rankexec_out_of_custom(job)
        return job.add_component(comp_id=ctx.comp_id or "rankexec_errors", obj=self, ctx=ctx)

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
