"""``python -m rankexec.flare.run_script [--cwd DIR] [--config JSON] SCRIPT [ARGS...]``:
the rank program of ``rankexec.flare.ScriptExecutor``.

Serves this process as a rank and runs a FLARE Client API script in it, as ``python
SCRIPT ARGS`` would, with ``import nvflare.client as flare`` talking to the rank
runtime (see ``rankexec.flare.client_api``).
"""

from __future__ import annotations

import sys

from rankexec.flare.client_api import main

if __name__ == "__main__":
    sys.exit(main())
