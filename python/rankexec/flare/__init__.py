"""rankexec inside NVIDIA FLARE 2.9.

``rankexec.flare.MultiProcessExecutor`` replaces FLARE's own MultiProcessExecutor in a
client's ``config_fed_client.json``: one ``path`` changes. ``rankexec.flare.RankErrorLogger``
is an optional server component that writes the ranks' errors into the server's log.

A site that runs jobs without custom code must allow the classes:
``python -m rankexec.flare allow-list WORKSPACE`` adds ``"rankexec."`` to
``WORKSPACE/local/resources.json``'s ``class_allow_list`` (keeping FLARE's defaults).
"""

from rankexec.flare.arrays import ARRAYS_KEY, from_blobs, to_blobs
from rankexec.flare.executor import ERROR_HEADER, FROM_RANK_PROP, MultiProcessExecutor
from rankexec.flare.server import RankErrorLogger

__all__ = [
    "ARRAYS_KEY",
    "ERROR_HEADER",
    "FROM_RANK_PROP",
    "MultiProcessExecutor",
    "RankErrorLogger",
    "from_blobs",
    "to_blobs",
]
