"""Fixtures for the FLARE tests (helpers are in flare_helpers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .flare_helpers import Sim, worker_program


@pytest.fixture(scope="session")
def rust_worker() -> str:
    w = worker_program()
    if not os.access(w, os.X_OK):
        pytest.fail(f"{w} is missing: run `cargo build --release -p rankexec-sub-worker` first")
    return w


@pytest.fixture
def sim_runner(tmp_path):
    sims: list[Sim] = []

    def start(job: Path, ws: Path, clients: int = 2) -> Sim:
        s = Sim(job, ws, clients)
        sims.append(s)
        return s

    yield start
    for s in sims:
        s.kill()
