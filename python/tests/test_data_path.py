"""The data path's copies (issue 41): what travels without a copy, what is copied with
``pwrite``, and the host-to-device API's fallbacks.

- A rank sending back numpy or torch views of its input sends the input's own memory
  file (the host maps the inode it sent); a view at no page boundary and a
  copy-on-write view are copied (their bytes as the rank saw them).
- ``SharedBuffer.write_at``: the bytes land in the buffer's own file; refused past the
  end and once sealed.
- ``rankexec.tensors.to_device``: CPU tensors pass through; ranges are one per tensor,
  those sharing a page registered once; every registration is undone after the copies,
  after a refusal (named, or the range copied from pageable memory) and after a copy
  that raised; without a GPU ``pin=True`` raises ``PinError`` while the default falls
  back.
"""

from __future__ import annotations

import itertools
import mmap
import os

import numpy as np
import pytest
from conftest import PYBIN, executor_config

from rankexec._rankexec import BufferSealed, SharedBuffer
from rankexec._staging import stage_releasing
from rankexec.host import RankGroup

MIB = 1 << 20


@pytest.fixture(autouse=True)
def python_on_path(monkeypatch):
    monkeypatch.setenv("PATH", PYBIN + os.pathsep + os.environ.get("PATH", ""))


def test_views_of_the_input_go_back_as_the_input_file_and_others_are_copied(tmp_path):
    cfg = executor_config("views:SendViews", 2, log_dir=tmp_path)
    a = np.arange(3 * MIB, dtype=np.uint32).view(np.uint8)[: 5 * MIB + 123]
    b = np.full(2 * MIB, 7, dtype=np.uint8)
    blobs = {"a": a.copy(), "b": b.copy()}
    stage_releasing(blobs)  # the host's own memory file, as Flower's host stages it
    sent = os.fstat(blobs["a"].fileno).st_ino
    with RankGroup(cfg, workspace=str(tmp_path)) as g:
        r = g.execute("t", {}, blobs)
    assert set(r.meta["inodes"].values()) == {sent}
    for name, src in (("a", a), ("b", b)):
        for key in (name, name + ".torch"):
            got = r.blobs[key]
            assert os.fstat(got.fileno).st_ino == sent, f"{key}: the input's file, no copy"
            assert np.array_equal(np.frombuffer(got, dtype=np.uint8), src), key
        tail = r.blobs[name + ".tail"]
        assert os.fstat(tail.fileno).st_ino != sent, "not at a page boundary: copied"
        assert np.array_equal(np.frombuffer(tail, dtype=np.uint8), src[1:])
        cow = np.frombuffer(r.blobs[name + ".cow"], dtype=np.uint8)
        assert os.fstat(r.blobs[name + ".cow"].fileno).st_ino != sent
        assert cow[0] == 99 and np.array_equal(cow[1:], src[1:]), "the rank's write travels"
    import torch

    want = torch.arange(4097, dtype=torch.float32).to(torch.bfloat16).view(torch.uint8)
    assert bytes(r.blobs["bf16"]) == want.numpy().tobytes(), "bfloat16 travels as its bytes"


def test_a_large_input_and_a_ranks_large_copies_are_written_to_several_files_at_once(tmp_path):
    """320 MiB in four arrays: the host writes them into two memory files of two
    consecutive arrays each, at once (one file takes one write at a time); the rank's
    views go back as those files, and its 640 MiB of copies go out in several files."""
    cfg = executor_config("views:SendViews", 1, log_dir=tmp_path)
    names = "abcd"
    blobs = {n: np.full(80 * MIB, i + 1, dtype=np.uint8) for i, n in enumerate(names)}
    with RankGroup(cfg, workspace=str(tmp_path)) as g:
        r = g.execute("t", {}, blobs)
    inodes = r.meta["inodes"]
    assert len(set(inodes.values())) == 2, inodes
    assert inodes["a"] == inodes["b"] != inodes["c"] == inodes["d"], "consecutive arrays"
    copies = set()
    for i, n in enumerate(names):
        got = r.blobs[n]
        assert os.fstat(got.fileno).st_ino == inodes[n], f"{n}: the input's own file"
        assert (np.frombuffer(got, dtype=np.uint8) == i + 1).all(), n
        tail = r.blobs[n + ".tail"]
        assert len(tail) == 80 * MIB - 1 and (np.frombuffer(tail, dtype=np.uint8) == i + 1).all()
        cow = np.frombuffer(r.blobs[n + ".cow"], dtype=np.uint8)
        assert cow[0] == 99 and (cow[1:] == i + 1).all()
        copies |= {os.fstat(r.blobs[n + k].fileno).st_ino for k in (".tail", ".cow")}
    assert len(copies) > 1, "the rank's 640 MiB of copies in more than one file"
    assert not copies & set(inodes.values())


def test_write_at_fills_the_buffers_own_file_and_refuses_past_the_end_and_once_sealed():
    buf = SharedBuffer(3 * 4096 + 5)
    inode = buf.inode
    buf.write_at(4096, np.full(4096, 3, dtype=np.uint8))
    buf.write_at(3 * 4096, b"hello")
    view = np.frombuffer(memoryview(buf), dtype=np.uint8)
    assert view[:4096].sum() == 0 and (view[4096:8192] == 3).all()
    assert bytes(view[3 * 4096 :]) == b"hello"
    with pytest.raises(ValueError, match="do not fit"):
        buf.write_at(3 * 4096 + 1, b"hello")
    blob = buf.seal()
    assert blob.inode == inode and bytes(memoryview(blob)[-5:]) == b"hello"
    with pytest.raises(BufferSealed):
        buf.write_at(0, b"x")


class FakeCudart:
    """Stands in for the CUDA runtime's two calls where no GPU is (the real ones run in
    scripts/gpu_check.py h2d): records each range, refuses the addresses in `refuse`
    with cudaErrorHostMemoryAlreadyRegistered, and refuses a page registered twice."""

    def __init__(self, refuse=()) -> None:
        import threading

        self.lock = threading.Lock()
        self.live: dict[int, int] = {}
        self.threads: set[int] = set()
        self.refuse = set(refuse)

    def cudaHostRegister(self, addr, length, flags):
        import threading

        assert flags == 9 and length % 4096 == 0 and addr % 4096 == 0
        with self.lock:
            self.threads.add(threading.get_ident())
            if addr in self.refuse or any(
                a < addr + length and addr < a + n for a, n in self.live.items()
            ):
                return 712
            self.live[addr] = length
        return 0

    def cudaHostUnregister(self, addr):
        with self.lock:
            assert self.live.pop(addr, None) is not None, "unregistered twice"
        return 0


def test_to_device_passes_cpu_tensors_and_falls_back_without_a_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    from rankexec import _pin, tensors

    page = 4096
    mem = mmap.mmap(-1, 4 * page)  # page-aligned, as a memory file's mapping is
    base = torch.frombuffer(mem, dtype=torch.uint8)
    # x and w share base's first page; y starts on the next one; z is its own storage.
    sd = {
        "x": base[:100],
        "w": base[200:300],
        "y": base[page + 904 : 3 * page],
        "z": torch.ones(10),
    }
    same = tensors.to_device(sd, "cpu")
    assert all(same[k] is sd[k] for k in sd)
    groups = _pin.groups(sd)
    first = base.data_ptr() - base.data_ptr() % page
    assert (first, page, ["w", "x"]) in groups, "x and w share a page: one range"
    assert sorted(n for _, _, names in groups for n in names) == ["w", "x", "y", "z"]
    assert all(a + n <= b for (a, n, _), (b, _, _) in itertools.pairwise(groups))
    assert tensors.pinned_ranges(sd) == [(a, n) for a, n, _ in groups]

    # Every range registered (by several threads), each tensor copied once, all undone.
    api = FakeCudart()
    copied: list[int] = []
    out = _pin.copy_pinned(
        sd,
        api,
        lambda t: copied.append(t.data_ptr()) or t.clone(),
        lambda: None,
        strict=True,
        threads=4,
    )
    assert list(out) == list(sd) and all(torch.equal(out[k], sd[k]) for k in sd)
    assert len(copied) == len(sd) and api.live == {}

    # A refused range: strict raises naming it, after undoing the others; the default
    # copies that range's tensors from pageable memory.
    y_range = next(a for a, _, names in groups if names == ["y"])
    api = FakeCudart(refuse={y_range})
    with pytest.raises(tensors.PinError, match="CUDA error 712"):
        _pin.copy_pinned(sd, api, lambda t: t.clone(), lambda: None, strict=True, threads=4)
    assert api.live == {}, "a refusal undoes the others"
    out = _pin.copy_pinned(sd, api, lambda t: t.clone(), lambda: None, strict=False, threads=4)
    assert all(torch.equal(out[k], sd[k]) for k in sd) and api.live == {}

    # A copy that raises (a CUDA error, say) leaves nothing registered either.
    def broken(t):
        raise RuntimeError("copy failed")

    api = FakeCudart()
    with pytest.raises(RuntimeError, match="copy failed"):
        _pin.copy_pinned(sd, api, broken, lambda: None, strict=False, threads=4)
    assert api.live == {}
    if torch.cuda.is_available():
        return  # the GPU path is measured by scripts/gpu_check.py h2d
    with pytest.raises(tensors.PinError):
        tensors.to_device(sd, "cuda", pin=True)
    monkeypatch.setenv("RANKEXEC_PIN_HOST", "0")
    with pytest.raises((RuntimeError, AssertionError)):  # pageable, and no GPU at all
        tensors.to_device(sd, "cuda")


def test_a_hosts_torch_tensors_of_any_dtype_go_to_the_ranks_as_their_bytes(tmp_path):
    """``RankGroup.execute`` takes torch tensors as blobs, bfloat16 included (no buffer
    of its own): the rank's views of them come back as the same bytes."""
    import torch

    cfg = executor_config("views:SendViews", 1, log_dir=tmp_path)
    w = {
        "w16": torch.arange(3 * MIB, dtype=torch.float32).to(
            torch.bfloat16
        ),  # not "bf16": SendViews adds its own
        "i8": torch.arange(4096, dtype=torch.int8),
    }
    want = {k: v.view(torch.uint8).numpy().tobytes() for k, v in w.items()}
    with RankGroup(cfg, workspace=str(tmp_path)) as g:
        r = g.execute("t", {}, w, consume=True)
        assert w == {}, "consume: the host's dict is emptied"
        for name, data in want.items():
            assert bytes(r.blobs[name]) == data, name
        # What is no buffer is refused naming its blob (it named none).
        with pytest.raises(TypeError, match="blob `w`: a list is not a buffer"):
            g.execute("t", {}, {"w": [1, 2]})
