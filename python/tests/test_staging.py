"""``rankexec._staging.stage_in_parts``: a model's large buffers into several sealed
memory files at once (what FLARE's ``ScriptExecutor`` and Flower's ``ClientApp`` and
rank 0 do with a message), each source let go of as soon as it is copied.

Real memory files, checked by their inodes and seals; the sources' release by weak
references."""

from __future__ import annotations

import fcntl
import os
import threading
import weakref

import numpy as np
import pytest

from rankexec._staging import PART_MIN, stage_in_parts

MIB = 1 << 20
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_WRITE = 0x0008


class Owned(np.ndarray):
    """An ndarray a weak reference can follow (plain ndarrays take none)."""


def arrays(n: int, each: int) -> dict[str, np.ndarray]:
    return {f"t{i}": np.full(each, i % 251, dtype=np.uint8).view(Owned) for i in range(n)}


def test_a_model_goes_into_several_sealed_files_in_order_each_source_let_go_of():
    blobs: dict[str, object] = {"small": b"abc"}
    blobs |= arrays(60, 5 * MIB)  # 300 MiB: parts of at least 64 MiB
    blobs["tail"] = np.arange(7, dtype=np.int64)  # under the threshold: left as it is
    order = list(blobs)
    sources = {k: weakref.ref(v) for k, v in blobs.items() if isinstance(v, Owned)}
    released: list[str] = []
    stage_in_parts(blobs, release=lambda name, _src: released.append(name))

    assert list(blobs) == order, "the caller's order is kept"
    assert blobs["small"] == b"abc" and isinstance(blobs["tail"], np.ndarray)
    assert sorted(released) == sorted(sources), "release called once per staged buffer"
    assert not [k for k, ref in sources.items() if ref() is not None], "sources freed"
    files: dict[int, int] = {}
    for i, name in enumerate(sources):
        blob = blobs[name]
        assert (np.frombuffer(blob, dtype=np.uint8) == i % 251).all(), name
        assert os.fstat(blob.fileno).st_size >= 5 * MIB
        assert fcntl.fcntl(blob.fileno, F_GET_SEALS) & F_SEAL_WRITE, f"{name} sealed"
        files[blob.inode] = os.fstat(blob.fileno).st_size
    assert 3 <= len(files) <= 5, files
    # Every part holds at least 64 MiB but the last, which may hold less.
    assert all(size >= PART_MIN for size in sorted(files.values())[1:]), files


def test_release_is_called_one_call_at_a_time_from_the_staging_threads():
    # Two threads inside `release` at once would meet at the barrier; one call at a
    # time, the first call's wait times out.
    blobs = arrays(16, 16 * MIB)  # 256 MiB: four parts, four threads
    meet = threading.Barrier(2)
    met: list[bool] = []
    threads: set[int] = set()

    def release(_name: str, _src: object) -> None:
        threads.add(threading.get_ident())
        if not met:
            try:
                meet.wait(timeout=1.0)
                met.append(True)
            except threading.BrokenBarrierError:
                met.append(False)

    stage_in_parts(blobs, release=release)
    assert met == [False], "two release calls overlapped"
    assert len(threads) > 1, "the parts were staged by several threads"


def test_a_failing_release_fails_the_staging_and_keeps_every_name():
    blobs = arrays(8, 32 * MIB)
    order = list(blobs)

    def release(name: str, _src: object) -> None:
        if name == "t5":
            raise RuntimeError("t5 cannot be let go of")

    with pytest.raises(RuntimeError, match="t5"):
        stage_in_parts(blobs, release=release)
    assert list(blobs) == order
