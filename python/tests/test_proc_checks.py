"""The suite's own guard: `proc_checks.owned` kills a child a test started, and the
group it leads, when the test fails inside it (an exception, not a clean exit)."""

from __future__ import annotations

import subprocess

import pytest
from proc_checks import owned, pid_alive, wait_until


def test_a_failing_test_leaves_neither_its_child_nor_the_childs_children():
    # `sh` leads its own group and starts a grandchild there, as a host starts ranks.
    proc = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!; wait"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    with pytest.raises(RuntimeError, match="the test failed"), owned(proc):
        assert pid_alive(grandchild)
        raise RuntimeError("the test failed")
    assert proc.returncode is not None, "the child is reaped"
    wait_until(lambda: not pid_alive(grandchild), 30, f"grandchild {grandchild} gone")


def test_a_child_that_already_exited_is_left_alone():
    proc = subprocess.Popen(["true"])
    with owned(proc):
        proc.wait(timeout=30)
    assert proc.returncode == 0
