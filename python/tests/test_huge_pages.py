"""Huge pages for memory files (issue 41; the protocol's ``os::huge``): where the kernel
gives shared memory huge pages only on request (``shmem_enabled`` = ``advise``), a
host's staged input, a ``SharedBuffer`` written with ``write_at`` and one filled through
its own mapping are allocated as 2 MiB pages, and every process that reads them (a rank,
the host reading a result) maps them whole (``ShmemPmdMapped`` in ``/proc/self/smaps``);
under ``never`` the same paths give 4 KiB pages and the same bytes.

The setting is the host's: these tests set it (as root, restoring it after; ``advise``
with the command docs/large-models.md gives) or run under the one in place when it is
the one they need, and skip otherwise.
"""

from __future__ import annotations

import contextlib
import os
import subprocess

import docrun
import numpy as np
import pytest
from components.huge import pmd_kib
from conftest import PYBIN, executor_config
from proc_checks import wait_until

from rankexec._rankexec import SharedBuffer
from rankexec.host import RankGroup

MIB = 1 << 20
KNOB = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
PER_SIZE = "/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled"


def selected(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


@contextlib.contextmanager
def shmem_setting(value: str):
    """The kernel's shmem huge-page setting at ``value`` for the block: set (and put
    back after) where this process may, else the test is skipped unless it already is."""
    before = selected(KNOB)
    if before is None:
        pytest.skip("no transparent huge pages for shared memory in this kernel")
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            pmd = int(f.read())
    except (OSError, ValueError):
        pmd = 0
    if pmd != 2 * MIB:
        pytest.skip(f"huge pages here are {pmd} bytes, the checks assume 2 MiB")
    per_size = selected(PER_SIZE)
    if per_size not in (None, "inherit"):
        pytest.skip(f"the 2 MiB size has its own setting: {per_size}")
    if before == value:
        yield
        return
    if not os.access(KNOB, os.W_OK):
        pytest.skip(f"shmem_enabled is {before}, not {value}, and this user cannot set it")
    if value == "advise":
        # As the guide tells a site's administrator to (docs/large-models.md).
        (step,) = docrun.console("docs/large-models.md", "shmem-advise", shell=True)
        p = subprocess.run(step.argv, check=False, capture_output=True, text=True, timeout=30)
        assert (why := step.check(p.returncode, p.stdout + p.stderr)) is None, why
    else:
        with open(KNOB, "w") as f:
            f.write(value)
    assert selected(KNOB) == value
    try:
        yield
    finally:
        with open(KNOB, "w") as f:
            f.write(before)


@pytest.fixture(autouse=True)
def python_on_path(monkeypatch):
    monkeypatch.setenv("PATH", PYBIN + os.pathsep + os.environ.get("PATH", ""))


def read_every_page(buf) -> tuple[np.ndarray, int]:
    view = np.frombuffer(buf, dtype=np.uint8)
    return view, int(view.sum(dtype=np.uint64))


def round_trips(tmp_path, blobs):
    """``blobs`` to two ranks and back (rank 0 returns views of its input), twice: the
    first task's input goes to a fresh memory file, the second's to the one prepared
    after the first (``host::staging``). For each task, rank 0's meta and for each blob
    the host's ``pmd_kib`` of the result and its sum."""
    cfg = executor_config("huge:HugeReader", 2, log_dir=tmp_path)
    out = []
    size = sum(b.nbytes for b in blobs.values())
    with RankGroup(cfg, workspace=str(tmp_path)) as g:
        for i in range(2):
            if i == 1:
                # The second task's input goes to the file prepared after the first.
                wait_until(lambda: g.staged_bytes == size, 30, "a prepared memory file")
            r = g.execute("t", {}, blobs)
            host = {}
            for name in blobs:
                view, total = read_every_page(r.blobs[name])
                host[name] = (pmd_kib(view.ctypes.data), total)
                del view
            out.append((r.meta, host))
            del r
    return out


def filled_buffers() -> dict[str, SharedBuffer]:
    """A buffer written with ``write_at`` (``pwrite``) and one filled through its own
    mapping, 16 MiB each, sealed."""
    written = SharedBuffer(16 * MIB)
    written.write_at(0, np.arange(16 * MIB, dtype=np.uint8))
    mapped = SharedBuffer(16 * MIB)
    np.frombuffer(memoryview(mapped), dtype=np.uint8)[:] = 7
    return {"written": written.seal(), "mapped": mapped.seal()}


def every_path(tmp_path, setting):
    """Under ``setting`` (a ``shmem_setting``): the sum of a 24 MiB input the host stages
    (its own copy, at ``execute``), the two tasks' ``round_trips`` of it and the
    ``filled_buffers``."""
    staged = np.arange(24 * MIB, dtype=np.uint8)
    want = int(staged.sum(dtype=np.uint64))
    with setting:
        return want, round_trips(tmp_path, {"staged": staged}), filled_buffers()


def test_under_advise_every_path_gives_huge_pages_and_every_reader_maps_them_whole(tmp_path):
    want, tasks, blobs = every_path(tmp_path, shmem_setting("advise"))
    for meta, host in tasks:
        assert meta["sums"]["staged"] == want and host["staged"][1] == want
        # At least half in huge pages: a fragmented host may back some with 4 KiB ones,
        # and without huge pages there are none (the next test).
        assert meta["pmd_kib"]["staged"] >= 12 * 1024, f"the rank's mapping: {tasks}"
        assert host["staged"][0] >= 12 * 1024, f"the host's mapping of the result: {tasks}"
    for name, blob in blobs.items():
        view, total = read_every_page(blob)
        want = int(np.arange(16 * MIB, dtype=np.uint8).sum(dtype=np.uint64))
        assert total == (want if name == "written" else 7 * 16 * MIB), name
        assert pmd_kib(view.ctypes.data) >= 8 * 1024, f"{name}: {pmd_kib(view.ctypes.data)} KiB"


def test_under_never_the_same_paths_give_small_pages_and_the_same_bytes(tmp_path):
    want, tasks, blobs = every_path(tmp_path, shmem_setting("never"))
    for meta, host in tasks:
        assert meta["sums"]["staged"] == want and host["staged"][1] == want
        assert meta["pmd_kib"]["staged"] == 0 and host["staged"][0] == 0, tasks
    for name, blob in blobs.items():
        view, _ = read_every_page(blob)
        assert pmd_kib(view.ctypes.data) == 0, name
