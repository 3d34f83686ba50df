"""``python -m rankexec.flare.run_script [--cwd DIR] [--config JSON] SCRIPT [ARGS...]``:
the rank program of ``rankexec.flare.ScriptExecutor``.

Serves this process as a rank and runs a FLARE Client API script in it, as ``python
SCRIPT ARGS`` would, with ``import nvflare.client as flare`` talking to the rank
runtime (see ``rankexec.flare.client_api``).

Before anything is imported (nvflare takes a second), the rank asks the kernel to
SIGKILL it when the process that spawned it dies (``PR_SET_PDEATHSIG`` on the main
thread, which lives as long as the process): a SIGKILLed FLARE client leaves no rank,
whatever the script is doing (measured: a rank busy in torch when its parent died was
not always ended by the runtime's own exit).
"""

from __future__ import annotations

import os
import sys


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    if parent == 1:
        os._exit(3)  # the spawner is already gone
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the prctl
        os._exit(3)


if __name__ == "__main__":
    _die_with_parent()
    from rankexec.flare._script_rank import main

    sys.exit(main())
