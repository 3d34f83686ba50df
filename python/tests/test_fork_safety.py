"""A fork() while a memory file is mapped writable must not break shared memory.

A child forked while the parent holds a writable shared mapping of a memory file (an
unsealed `SharedBuffer` on a rank, or a file the host keeps prepared for the next
input) used to inherit the mapping, and sealing the file then failed with EBUSY for
as long as the child lived: the rank's reply failed, and the host's `execute` failed
with "cannot copy the input into shared memory". Real forks here: PyTorch DataLoader
workers in a Python rank, and `os.fork` / a `multiprocessing` fork pool in the host.
"""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
from conftest import PYBIN, TARGET, executor_config, pid_alive, wait_until

from rankexec.host import RankGroup

WORKER = str(TARGET / "release" / "rankexec-worker")


@pytest.fixture(autouse=True)
def python_on_path(monkeypatch):
    # The ranks' `python` is this interpreter.
    monkeypatch.setenv("PATH", PYBIN + os.pathsep + os.environ.get("PATH", ""))


def test_rank_with_persistent_dataloader_workers_replies_with_shared_buffers(tmp_path):
    pytest.importorskip("torch")
    nbytes = 4 << 20
    cfg = executor_config("forking:LoaderRank", 2, {"nbytes": nbytes}, log_dir=tmp_path)
    with RankGroup(cfg, workspace=str(tmp_path)) as g:
        g.start()
        pids = g.pids()
        workers: list[int] = []
        for i in range(4):
            r = g.execute("train", {"fill": i + 1})
            out = np.frombuffer(r.blobs["out"], dtype=np.uint8)
            assert r.blobs["out"].shared and out.size == nbytes
            assert (out == i + 1).all(), f"task {i}: wrong bytes"
            # The DataLoader's two persistent workers were forked while the first
            # task's buffer was mapped writable, and they are still alive.
            children = r.meta["children"]
            assert len(children) >= 2, r.meta
            if not workers:
                workers = children
            assert children == workers, "the persistent workers were replaced"
            assert g.pids() == pids, "the group was relaunched"
        assert all(pid_alive(p) for p in workers)


def _block_until_closed(fd: int, others: list[int]) -> None:
    """A forked child: closes the write ends it inherited (`others`), waits until the
    parent closes its end of the pipe, then leaves."""
    try:
        for w in others:
            os.close(w)
        os.read(fd, 1)
    finally:
        os._exit(0)


def _square(x: int) -> int:
    return x * x


def test_host_that_forks_between_tasks_still_sends_large_inputs(tmp_path):
    size = 8 << 20
    cfg = {
        "executor_id": "f",
        "num_of_processes": 2,
        "components": [{"id": "f", "path": "Echo", "args": {}}],
        "worker": {"program": WORKER},
        "log_dir": str(tmp_path),
    }
    children: list[int] = []
    closers: list[int] = []
    ctx = multiprocessing.get_context("fork")
    pool = None
    try:
        with RankGroup(cfg, workspace=str(tmp_path)) as g:
            g.start()
            pids = g.pids()
            for i in range(4):
                data = np.full(size, i + 1, dtype=np.uint8)
                r = g.execute("t", {"i": i}, {"w": data})
                back = np.frombuffer(r.blobs["w"], dtype=np.uint8)
                assert (back == i + 1).all() and r.meta["i"] == i
                # A file for the next input of this size is prepared (mapped writable)
                # in the background after each task: fork while it is.
                assert wait_until_true(lambda: g.staged_bytes == size)
                r_fd, w_fd = os.pipe()
                pid = os.fork()
                if pid == 0:
                    _block_until_closed(r_fd, [*closers, w_fd])
                os.close(r_fd)
                children.append(pid)
                closers.append(w_fd)
                if pool is None:
                    pool = ctx.Pool(2)
                    assert pool.map(_square, range(4)) == [0, 1, 4, 9]
                assert all(pid_alive(c) for c in children)
            assert g.pids() == pids
    finally:
        # The pool's workers inherited the first child's write end: stop them first.
        if pool is not None:
            pool.terminate()
            pool.join()
        for fd in closers:
            os.close(fd)
        for c in children:
            os.waitpid(c, 0)


def wait_until_true(cond, timeout: float = 30) -> bool:
    try:
        wait_until(cond, timeout, "the condition")
    except AssertionError:
        return False
    return True


def test_rank_buffer_mapped_writable_by_user_code_is_sent_as_a_sealed_copy(tmp_path):
    cfg = executor_config("forking:UserMappingRank", 1, log_dir=tmp_path)
    with RankGroup(cfg, workspace=str(tmp_path)) as g:
        g.start()
        pids = g.pids()
        for i in range(3):
            r = g.execute("t", {"fill": 10 + i})
            assert r.meta["copied"] is True
            assert (np.frombuffer(r.blobs["out"], dtype=np.uint8) == 10 + i).all()
        assert g.pids() == pids


def test_host_staged_file_mapped_writable_by_user_code_is_sent_as_a_sealed_copy(tmp_path):
    import mmap

    size = 4 << 20
    cfg = {
        "executor_id": "u",
        "num_of_processes": 2,
        "components": [{"id": "u", "path": "Echo", "args": {}}],
        "worker": {"program": WORKER},
        "log_dir": str(tmp_path),
    }
    kept = []
    with RankGroup(cfg, workspace=str(tmp_path)) as g:
        g.start()
        for i in range(3):
            g.prepare([size])
            assert g.staged_bytes == size
            # Map every prepared memory file writable, as user code could.
            for entry in os.listdir("/proc/self/fd"):
                path = f"/proc/self/fd/{entry}"
                try:
                    if "memfd:rankexec-staged" not in os.readlink(path):
                        continue
                    fd = os.open(path, os.O_RDWR)
                except OSError:
                    continue
                try:
                    kept.append(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_WRITE))
                finally:
                    os.close(fd)
            assert kept, "no prepared memory file found"
            data = np.full(size, 20 + i, dtype=np.uint8)
            r = g.execute("t", {}, {"w": data})
            assert (np.frombuffer(r.blobs["w"], dtype=np.uint8) == 20 + i).all()
    for m in kept:
        m.close()
