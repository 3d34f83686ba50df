"""The DXO <-> task conversion (rankexec.flare.arrays and the adapter's use of it),
with real numpy, torch and FLARE objects: tensors of every dtype keep dtype and shape
without a copy on the way in, collections nest, and what cannot travel is an error
naming its key, never dropped."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import Shareable

from rankexec._staging import MAX_PARTS, PART_MIN
from rankexec.flare.arrays import (
    Member,
    Unsendable,
    from_blobs,
    pack_data,
    parts_of,
    unpack_data,
)
from rankexec.flare.executor import ERROR_HEADER, MultiProcessExecutor

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _bytes(blobs):
    """The blobs as a rank receives them: other memory, read-only."""
    return {k: bytes(memoryview(v).cast("B")) for k, v in blobs.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (3,), (2, 3)], ids=str)
def test_a_tensor_comes_back_with_its_dtype_shape_and_values(dtype, shape):
    t = (torch.arange(int(np.prod(shape)) or 1)[: int(np.prod(shape))] % 3).to(dtype).reshape(shape)
    meta, blobs = pack_data({"t": t})
    if t.numel():
        assert blobs["t"].ctypes.data == t.data_ptr()  # no copy on the way in
    back = unpack_data(meta, _bytes(blobs))["t"]
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(back, t)
    back.add_(1) if dtype != torch.bool else back.logical_not_()  # writable


def test_a_collection_nests_and_keeps_names_apart():
    model = DXO(DataKind.WEIGHTS, {"w": torch.ones(2, dtype=torch.bfloat16), "a/b": np.zeros(1)})
    inner = DXO(DataKind.METRICS, {"acc": np.float32(0.5), "hist": np.arange(3)}, meta={"m": 1})
    data = {"model": model, "a": DXO(DataKind.COLLECTION, {"b": inner}), "a/b/hist": np.ones(2)}
    meta, blobs = pack_data(data, kind=DataKind.COLLECTION, meta={"round": 3})
    assert len(blobs) == 4 and meta["dxo_kind"] == "COLLECTION" and meta["dxo_meta"] == {"round": 3}
    back = unpack_data(meta, _bytes(blobs))
    assert set(back) == {"model", "a", "a/b/hist"}
    assert isinstance(back["model"], Member) and back["model"].data_kind == "WEIGHTS"
    assert back["model"].data["w"].dtype == torch.bfloat16
    np.testing.assert_array_equal(back["model"].data["a/b"], np.zeros(1))
    b = back["a"].data["b"]
    assert b.data_kind == "METRICS" and b.meta == {"m": 1} and b.data["acc"] == 0.5
    np.testing.assert_array_equal(b.data["hist"], np.arange(3))
    np.testing.assert_array_equal(back["a/b/hist"], np.ones(2))


@pytest.mark.parametrize(
    "data, key",
    [
        ({"w": np.zeros(2), "opt": object()}, "data.opt"),
        ({"cfg": {"layers": [1, {2, 3}]}}, "data.cfg.layers[1]"),
        ({"cfg": {1: "x"}}, "data.cfg[1]"),
        ({"big": 1 << 70}, "data.big"),
        ({"o": np.array([object()])}, "data.o"),
        ({"s": torch.zeros(3).to_sparse()}, "data.s"),
        ({"m": DXO(DataKind.WEIGHTS, {"f": lambda: 0})}, "data.m.f"),
    ],
)
def test_what_cannot_travel_is_an_error_naming_its_key(data, key):
    with pytest.raises(Unsendable) as e:
        pack_data(data)
    assert e.value.key == key, e.value
    assert f"`{key}`" in str(e.value)


def test_the_adapter_refuses_an_unsendable_task_with_the_key():
    """The executor's own conversion of a real FLARE task: EXECUTION_EXCEPTION naming
    the key (a group is never involved: the conversion comes first)."""
    shareable = DXO(DataKind.WEIGHTS, {"w": np.zeros(2), "opt": object()}).to_shareable()
    with pytest.raises(Unsendable) as e:
        MultiProcessExecutor._task_input(shareable)
    assert e.value.key == "data.opt"
    meta = DXO(DataKind.WEIGHTS, {"w": np.zeros(2)}, meta={"hook": print}).to_shareable()
    with pytest.raises(Unsendable) as e:
        MultiProcessExecutor._task_input(meta)
    assert e.value.key == "meta.hook"
    reply = MultiProcessExecutor._failed(f"task input {e.value}")
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "meta.hook" in reply.get_header(ERROR_HEADER)


def test_a_task_that_is_not_a_dxo_keeps_its_items():
    s = Shareable()
    s["w"] = np.arange(3, dtype=np.int16)
    s["note"] = "x"
    meta, blobs, dxo = MultiProcessExecutor._task_input(s)
    assert dxo is None and meta["dxo_values"] == {"note": "x"}
    np.testing.assert_array_equal(unpack_data(meta, _bytes(blobs))["w"], s["w"])


def test_the_reply_keeps_tensors_members_and_extra_meta(tmp_path):
    ex = MultiProcessExecutor(rank_component="x:Y")
    inner = DXO(DataKind.METRICS, {"t": torch.tensor(1.5, dtype=torch.float16)}, meta={"k": 1})
    dxo = DXO(DataKind.COLLECTION, {"m": inner, "w": torch.ones(2, dtype=torch.int64)})
    meta, blobs = pack_data(dxo.data, kind=dxo.data_kind, meta={})
    meta["NUM_STEPS_CURRENT_ROUND"] = 4
    meta["train_loss"] = 0.25
    reply = ex._reply(meta, _bytes(blobs), meta["dxo_arrays"], dxo)
    from nvflare.apis.dxo import from_shareable

    out = from_shareable(reply)
    assert out.data_kind == "COLLECTION" and out.meta == {"NUM_STEPS_CURRENT_ROUND": 4}
    assert out.data["w"].dtype == torch.int64 and torch.equal(out.data["w"], torch.ones(2).long())
    m = out.data["m"]
    assert isinstance(m, DXO) and m.meta == {"k": 1}
    assert m.data["t"].dtype == torch.float16 and m.data["t"].item() == 1.5
    assert reply.get_header("rankexec_meta") == {"train_loss": 0.25}


def test_from_blobs_reads_numpy_and_torch_specs():
    meta, blobs = pack_data({"a": np.eye(2, dtype=np.float32), "t": torch.ones(3).half()})
    out = from_blobs(_bytes(blobs), meta["dxo_arrays"])
    np.testing.assert_array_equal(out["a"], np.eye(2))
    assert out["t"].dtype == torch.float16


def test_a_result_whose_blob_does_not_match_its_spec_is_an_error_naming_it():
    ex = MultiProcessExecutor(rank_component="x:Y")
    dxo = DXO(DataKind.WEIGHTS, {"w": np.zeros(4, dtype=np.float32)})
    meta, _ = pack_data(dxo.data, kind=dxo.data_kind)
    bad = {"w": b"\0" * 7}  # 7 bytes for 4 float32
    with pytest.raises(Unsendable) as e:
        ex._reply(meta, bad, meta["dxo_arrays"], dxo)
    assert e.value.key == "w" and "needs 16" in str(e.value)
    spec = {"dxo_arrays": {"t": {"dtype": "no_such_dtype", "shape": [1], "framework": "torch"}}}
    with pytest.raises(Unsendable) as e:
        ex._reply(spec, {"t": b"\0" * 4}, None, dxo)
    assert e.value.key == "t" and "unknown torch dtype" in str(e.value)


@pytest.mark.parametrize(
    "sizes",
    [
        [128 << 20] * 8,  # the 8 x 128 MiB: a part each
        [(i % 7 + 1) << 20 for i in range(424)],  # a transformer's 1-7 MiB tensors
        [3 << 20] * 5 + [2 << 30],  # small ones, then one larger than all of them
        [1 << 10] * 3,  # under one part
    ],
)
def test_a_model_travels_in_at_most_16_parts_of_at_least_64_mib(sizes):
    named = {f"t{i}": n for i, n in enumerate(sizes)}
    parts = parts_of(named)
    assert [n for part in parts for n in part] == list(named)  # every name once, in order
    assert 1 <= len(parts) <= MAX_PARTS
    for part in parts[:-1]:
        assert sum(named[n] for n in part) >= PART_MIN
