"""The data path's copies (issue 41): what travels without a copy, what is copied with
``pwrite``, and the host-to-device API's fallbacks.

- A rank sending back numpy or torch views of its input sends the input's own memory
  file (the host maps the inode it sent); a view at no page boundary and a
  copy-on-write view are copied (their bytes as the rank saw them).
- ``SharedBuffer.write_at``: the bytes land in the buffer's own file; refused past the
  end and once sealed.
- ``rankexec.tensors.to_device``: CPU tensors pass through, overlapping ranges are
  registered once, a refused registration is undone and named, and without a GPU
  ``pin=True`` raises ``PinError`` while the default falls back.
"""

from __future__ import annotations

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


def test_to_device_passes_cpu_tensors_and_falls_back_without_a_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    from rankexec import tensors

    base = torch.arange(3 * 4096, dtype=torch.uint8)
    sd = {"x": base[:100], "y": base[5000:9000], "z": torch.ones(10)}
    same = tensors.to_device(sd, "cpu")
    assert all(same[k] is sd[k] for k in sd)
    ranges = tensors.pinned_ranges(sd)
    page = 4096
    assert (base.data_ptr() - base.data_ptr() % page) in [a for a, _ in ranges]
    assert len(ranges) == 2, "x and y share one storage: one range for both"

    class Refuses:
        def __init__(self) -> None:
            self.registered: list[int] = []
            self.unregistered: list[int] = []

        def cudaHostRegister(self, addr, length, flags):
            assert flags == 9 and length % page == 0 and addr % page == 0
            if self.registered:
                return 712  # cudaErrorHostMemoryAlreadyRegistered
            self.registered.append(addr)
            return 0

        def cudaHostUnregister(self, addr):
            self.unregistered.append(addr)
            return 0

    fake = Refuses()
    with pytest.raises(tensors.PinError, match="CUDA error 712"):
        tensors._register(ranges, fake)
    assert fake.unregistered == fake.registered, "a refusal undoes the others"
    if torch.cuda.is_available():
        return  # the GPU path is measured by scripts/gpu_check.py h2d
    with pytest.raises(tensors.PinError):
        tensors.to_device(sd, "cuda", pin=True)
    monkeypatch.setenv("RANKEXEC_PIN_HOST", "0")
    with pytest.raises((RuntimeError, AssertionError)):  # pageable, and no GPU at all
        tensors.to_device(sd, "cuda")
