"""`rankexec.tensors`: safetensors layout in shared memory, unpacked without copies."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from safetensors.numpy import load as st_load
from safetensors.torch import load as st_load_torch

import rankexec
from rankexec import tensors


def test_pack_is_safetensors_and_unpack_views_the_same_memory():
    sd = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([1, 2, 3], dtype=torch.int64),
        "h": torch.ones(2, 2, dtype=torch.bfloat16),
        "e": torch.zeros(0),
    }
    buf = tensors.pack(sd, {"round": "3"})
    blob = buf.seal()
    assert blob.shared and blob.inode == buf.inode
    # The safetensors library reads it as its own format.
    theirs = st_load_torch(blob.tobytes())
    assert all(torch.equal(theirs[k], v) for k, v in sd.items())
    assert tensors.metadata(blob) == {"round": "3"}
    back = tensors.unpack(blob, "torch")
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    # numpy views point into the blob's mapping and are read-only.
    only_np = tensors.pack({"w": np.arange(6, dtype=np.float32)}).seal()
    a = tensors.unpack(only_np)["w"]
    base = only_np.address
    assert base <= a.ctypes.data < base + only_np.nbytes
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 1
    # Copy-on-write views write privately.
    w = tensors.unpack(only_np, writable=True)["w"]
    w[0] = 42
    assert tensors.unpack(only_np)["w"][0] == 0
    assert st_load(only_np.tobytes())["w"].tolist() == [0, 1, 2, 3, 4, 5]


def test_fedavg_blobs_round_trip():
    model = torch.nn.Linear(300, 100)
    blobs = tensors.to_blobs(model.state_dict())
    assert isinstance(blobs["weight"], rankexec.SharedBuffer), "large tensors go to shm"
    back = tensors.from_blobs(blobs, model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v)


def test_shared_buffer_seals_with_live_views_and_refuses_writes_after():
    buf = rankexec.SharedBuffer(1 << 20)
    view = np.frombuffer(buf, dtype=np.uint8)
    view[:] = 5
    blob = buf.seal()
    assert buf.sealed and blob.inode == buf.inode
    view[0] = 9  # an old view writes privately, never into the sealed file
    assert np.frombuffer(blob, dtype=np.uint8)[0] == 5
    assert not np.frombuffer(buf, dtype=np.uint8).flags.writeable, "read-only after sending"
    # A writable view is refused (CPython's argument parsing reports it as TypeError).
    with pytest.raises((TypeError, rankexec.BufferSealed)):
        io.BytesIO(b"x").readinto(buf)
    with pytest.raises(TypeError):
        memoryview(blob)[0] = 1
