"""Where a rank group started from Python finds its worker program.

The wheel (``scripts/wheel.sh``) carries the ``rankexec`` command-line binary and the
Rust rank program ``rankexec-worker`` in ``rankexec/_bin/``, so an installed package
needs no checkout, no ``target/`` and no cargo: the ``rankexec`` console command execs
the first, and a worker program named ``rankexec-worker`` (the executor's default) or
``rankexec`` without a path runs the packaged binary, which is of this package's
version, before anything of that name elsewhere.

Any other program named without a path (``python``) is looked up next to
``sys.executable`` first: the executor looks next to the running executable, which for a
Python host is the interpreter's real file (``/usr/bin/python3.11`` for a venv's
``bin/python``), and there ``python`` is an interpreter without the venv's packages. A
name found in neither place is left to the executor (next to the real executable, then
``PATH``), as before.

A package built from a checkout (``maturin develop``, ``pip install ./python``) or from
the sdist has no ``_bin/``: ``binary`` returns None there, and ``command`` (what the
``rankexec`` console command runs) falls back to the checkout's ``target/release`` (a
``maturin develop`` install), then to another ``rankexec`` on ``PATH`` (``cargo
install``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["BIN_DIR", "PACKAGED", "binary", "command", "resolve_worker"]

BIN_DIR = Path(__file__).resolve().parent / "_bin"
# The programs the wheel ships, by the names job configurations use.
PACKAGED = ("rankexec", "rankexec-worker")
# The executor's default rank program when a configuration names none.
_DEFAULT_WORKER = "rankexec-worker"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def binary(name: str) -> str | None:
    """The packaged program ``name`` (an absolute path), or None when this installation
    has none (a checkout or sdist build)."""
    if name not in PACKAGED:
        return None
    path = BIN_DIR / name
    return str(path) if _executable(path) else None


def command(skip: str | None = None) -> str | None:
    """The ``rankexec`` binary the console command runs: the packaged one; else, in a
    checkout's development install, ``target/release/rankexec`` (``CARGO_TARGET_DIR``
    honoured); else the first ``rankexec`` on ``PATH`` that is not ``skip`` (the console
    script itself). None when there is none."""
    packaged = binary("rankexec")
    if packaged is not None:
        return packaged
    repo = Path(__file__).resolve().parents[2]
    if (repo / "Cargo.toml").is_file() and (repo / "python" / "pyproject.toml").is_file():
        target = Path(os.environ.get("CARGO_TARGET_DIR") or repo / "target")
        if not target.is_absolute():
            target = repo / target
        built = target / "release" / "rankexec"
        if _executable(built):
            return str(built)
    me = os.path.realpath(skip) if skip else None
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(folder or ".") / "rankexec"
        if _executable(candidate) and os.path.realpath(candidate) != me:
            return str(candidate)
    return None


def _beside_interpreter(name: str) -> str | None:
    if not sys.executable:
        return None
    path = Path(sys.executable).parent / name
    return str(path) if _executable(path) else None


def resolve_worker(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``config`` with its worker program (``rankexec-worker`` when it names none) made
    a path when it is a bare name found in the package's ``_bin/`` or next to
    ``sys.executable``. Returns ``config`` itself when nothing changes; never modifies
    it."""
    if not isinstance(config, Mapping):
        return config  # the caller reports what is not a configuration
    worker = config.get("worker")
    if worker is None:
        worker = {}
    if not isinstance(worker, Mapping):
        return config  # the executor's configuration check reports it
    program = worker.get("program", _DEFAULT_WORKER)
    if not isinstance(program, str) or not program or "/" in program:
        return config
    found = binary(program) or _beside_interpreter(program)
    if found is None:
        return config
    return {**config, "worker": {**worker, "program": found}}
