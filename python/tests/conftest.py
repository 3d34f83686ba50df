"""Fixtures: a host (`rankexec-pydriver`) driving real rank groups of real Python.

Build first: `cargo build --release` (or `cargo test --workspace`: the driver and the
CLI) and `maturin develop --release` in `python/` (this package). `RANKEXEC_BIN` and
`RANKEXEC_PYDRIVER` override where the binaries are found.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from pathlib import Path

import pytest
from proc_checks import pid_alive, pids_with_env, wait_until  # noqa: F401 (re-exported: tests import them from conftest)

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


COMPONENTS = HERE / "components"
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))


def _binary(var: str, name: str) -> Path:
    """`$var`, else the newer of the release and debug builds (`cargo build --release`
    or `cargo test --workspace` makes them)."""
    if var in os.environ:
        return Path(os.environ[var])
    found = [p for p in (TARGET / "release" / name, TARGET / "debug" / name) if p.exists()]
    if not found:
        return TARGET / "release" / name
    return max(found, key=lambda p: p.stat().st_mtime)


BIN = _binary("RANKEXEC_BIN", "rankexec")
DRIVER = _binary("RANKEXEC_PYDRIVER", "rankexec-pydriver")
# The ranks' `python` is this interpreter, found on PATH.
PYBIN = str(Path(sys.executable).parent)


def env_with_python() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = PYBIN + os.pathsep + env.get("PATH", "")
    env.setdefault("RANKEXEC_LOG", "warn")
    return env


def executor_config(
    path: str,
    n: int,
    args: dict | None = None,
    *,
    log_dir: Path,
    program: list[str] | None = None,
    **extra,
) -> dict:
    cfg = {
        "executor_id": "t",
        "num_of_processes": n,
        "components": [{"id": "t", "path": path, "args": args or {}}],
        "worker": {"program": "python", "args": program or ["-m", "rankexec.worker"]},
        "env": {"set": {"PYTHONPATH": str(COMPONENTS)}},
        "log_dir": str(log_dir),
        "gpu": {"mode": "none"},
        "deadlines": {"startup": "60s", "task": "120s"},
    }
    cfg.update(extra)
    return cfg


class Host:
    """A `rankexec-pydriver` process: one rank group, commands as JSON lines."""

    def __init__(self) -> None:
        if not DRIVER.exists():
            pytest.fail(f"{DRIVER} is missing: run `cargo build --release` first")
        self.proc = subprocess.Popen(
            [str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env_with_python(),
            text=True,
        )
        self.sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def send(self, timeout: float = 120, **cmd) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        if not self.sel.select(timeout):
            raise AssertionError(f"driver did not answer {cmd.get('op')} within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"driver exited (code {self.proc.wait(5)})")
        return json.loads(line)

    def start(self, config: dict) -> dict:
        return self.send(op="start", config=config)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def host():
    h = Host()
    yield h
    h.close()


def read_notes(out_dir: Path, what: str, n: int, timeout: float = 30) -> list[dict]:
    paths = [out_dir / f"{what}-{r}.json" for r in range(n)]
    wait_until(lambda: all(p.exists() for p in paths), timeout, f"{what} notes from {n} ranks")
    return [json.loads(p.read_text()) for p in paths]
