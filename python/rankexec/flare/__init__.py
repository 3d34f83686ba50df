"""rankexec inside NVIDIA FLARE 2.9.

``rankexec.flare.MultiProcessExecutor`` replaces FLARE's own MultiProcessExecutor in a
client's ``config_fed_client.json``: one ``path`` changes. ``rankexec.flare.RankErrorLogger``
is an optional server component that writes the ranks' errors into the server's log.
``rankexec.flare.ScriptExecutor`` runs an unchanged Client API script as a rank group;
``rankexec.flare.use_rank_groups(recipe, num_of_processes=N)`` makes a FLARE 2.9 recipe
use it for every client script (``rankexec.flare.recipe``).

A site that runs jobs without custom code must allow the classes:
``python -m rankexec.flare allow-list WORKSPACE`` adds ``rankexec.flare.MultiProcessExecutor``,
``rankexec.flare.ScriptExecutor`` and ``rankexec.flare.RankErrorLogger`` to
``WORKSPACE/local/resources.json``'s ``class_allow_list`` (keeping FLARE's defaults), and
with ``--script PATH`` allows that Client API script in the site policy. What such jobs may then make the
executor run is the site's policy, ``WORKSPACE/local/rankexec.json``
(``rankexec.flare.policy``; ``python -m rankexec.flare policy WORKSPACE`` writes one).

The FLARE classes are imported on first use, so rank code that only needs
``rankexec.flare.arrays`` (``unpack_data``, ``pack_data``, ``from_blobs``, ``to_blobs``)
does not import nvflare.
"""

from __future__ import annotations

import importlib
from typing import Any

from rankexec.flare.arrays import (
    ARRAYS_KEY,
    Member,
    Unsendable,
    from_blobs,
    pack_data,
    to_blobs,
    unpack_data,
)

__all__ = [
    "ARRAYS_KEY",
    "ERROR_HEADER",
    "FROM_RANK_PROP",
    "Member",
    "MultiProcessExecutor",
    "RankErrorLogger",
    "ScriptExecutor",
    "ScriptRunner",
    "Unsendable",
    "from_blobs",
    "pack_data",
    "to_blobs",
    "unpack_data",
    "use_rank_groups",
]

_LAZY = {
    "MultiProcessExecutor": "rankexec.flare.executor",
    "ERROR_HEADER": "rankexec.flare.executor",
    "FROM_RANK_PROP": "rankexec.flare.executor",
    "RankErrorLogger": "rankexec.flare.server",
    "ScriptExecutor": "rankexec.flare.script_executor",
    "ScriptRunner": "rankexec.flare.job",
    "use_rank_groups": "rankexec.flare.recipe",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rankexec.flare' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names with the lazy ones (``dir()``, tab completion and the API
    reference's inspection see them)."""
    return sorted(set(globals()) | set(__all__))
