"""Process helpers for the Flower tests: the suite's own (python/tests/proc_checks.py)."""

from __future__ import annotations

from proc_checks import pid_alive, pids_with_env, wait_until

__all__ = ["pid_alive", "pids_with_env", "wait_until"]
