"""torchrun's variables on every rank, whatever launched it.

PyTorch, Lightning, Hugging Face and FLARE's examples read ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (``torch.cuda.set_device(LOCAL_RANK)``,
``init_process_group("env://")``). The builtin launcher and torchrun set them; mpirun,
srun and MPICH set their own (``OMPI_COMM_WORLD_*``, ``SLURM_*``, ``PMI_*``). Before the
rank runtime starts (no runtime thread reads the environment while it changes),
``export`` fills in torchrun's names from the runtime's own reading of the launcher's
variables, so a script written for torchrun runs unchanged under every launcher.
Variables the launcher set are kept as they are.

Caveat: only the process's own environment changes (``os.environ``); a library that
read it before (in ``sitecustomize``, say) keeps what it read.
"""

from __future__ import annotations

import os

from rankexec import _rankexec

__all__ = ["export"]


def export() -> None:
    """Sets torchrun's rank variables where unset, from the launcher's (see the module
    docs). Call it before ``_rankexec.start``; a process that is no rank is left as is."""
    found = _rankexec.rank_identity()
    if found is None:
        return
    for name, value in zip(("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"), found):
        os.environ.setdefault(name, str(value))
