"""rankexec.flower's pieces without a federation: the message codec, zero-copy array
views, the authenticated channel and the site's rules. Real sockets, real Flower
records; seconds."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

from rankexec._staging import stage_releasing
from rankexec.flower import _channel, _codec, _site, ndarrays


@pytest.fixture(autouse=True)
def _identity() -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 3, 11


def test_message_and_context_round_trip_with_arrays_as_views() -> None:
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    content = RecordDict(
        {
            "arrays": ArrayRecord([w, np.ones(5, np.int64)]),
            "config": ConfigRecord({"lr": 0.1, "name": "x", "raw": b"\x00\x01", "l": [1, 2]}),
            "metrics": MetricRecord({"n": 3, "acc": [0.5, 0.75]}),
        }
    )
    msg = Message(content, dst_node_id=5, message_type="train.custom")
    ctx = Context(7, 3, {"partition-id": 1}, RecordDict({"s": ConfigRecord({"k": 1})}), {"a": 2})
    blobs: dict = {}
    spec = _codec.encode_message(msg, blobs)
    cspec = _codec.encode_context(ctx, blobs)
    # What the ranks get: the spec pickled, the arrays' bytes as buffers.
    shared = {k: memoryview(bytes(v)) for k, v in blobs.items()}
    back = _codec.decode_message(_codec.unpack(_codec.pack(spec)), shared)
    cback = _codec.decode_context(_codec.unpack(_codec.pack(cspec)), shared)
    assert back.metadata == msg.metadata
    assert dict(back.content["config"]) == dict(content["config"])
    assert dict(back.content["metrics"]) == dict(content["metrics"])
    got = back.content["arrays"].to_numpy_ndarrays()
    np.testing.assert_array_equal(got[0], w)
    views = ndarrays(back.content["arrays"])
    np.testing.assert_array_equal(views[0], w)
    assert not views[0].flags.writeable and not views[0].flags.owndata
    assert cback.node_config == {"partition-id": 1} and cback.run_config == {"a": 2}
    assert dict(cback.state["s"]) == {"k": 1}
    reply = Message(RecordDict({"m": MetricRecord({"x": 1})}), reply_to=back)
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id


def test_arrays_sharing_one_buffer_travel_once() -> None:
    """Flower hands a received message's arrays of equal content over as one object
    (its wire is content-addressed): they must be staged and mapped once, not once per
    key, and each key must still read its array; the releaser lets go of every key."""
    zeros = Array(np.zeros((256, 1024), np.float32))  # 1 MiB, a LoRA B matrix's start
    ones = Array(np.ones(7, np.float32))
    record = ArrayRecord()
    for key in ("a.lora_B", "b.lora_B", "c.lora_B"):
        record[key] = zeros
    record["bias"] = ones
    msg = Message(RecordDict({"arrays": record}), dst_node_id=5, message_type="train")
    ctx = Context(7, 3, {}, RecordDict({"w": ArrayRecord({"kept": zeros})}), {})
    blobs: dict = {}
    spec = _codec.encode_message(msg, blobs)
    cspec = _codec.encode_context(ctx, blobs)
    assert sorted(len(memoryview(v)) for v in blobs.values()) == sorted(
        [len(zeros.data), len(ones.data)]
    ), "one blob per distinct buffer, the context's included"
    size = stage_releasing(blobs, 1 << 20, _codec.releaser([msg.content, ctx.state]))
    assert size == len(zeros.data)
    assert list(record.keys()) == ["bias"], "every key of the staged buffer let go of"
    assert "kept" not in ctx.state["w"]
    shared = {k: memoryview(v) for k, v in blobs.items()}
    back = _codec.decode_message(spec, shared)
    cback = _codec.decode_context(cspec, shared)
    views = ndarrays(back.content["arrays"])
    assert [a.shape for a in views] == [(256, 1024)] * 3 + [(7,)]
    assert len({a.ctypes.data for a in views[:3]}) == 1, "the three keys share one mapping"
    np.testing.assert_array_equal(back.content["arrays"]["b.lora_B"].numpy(), 0)
    np.testing.assert_array_equal(cback.state["w"]["kept"].numpy(), 0)


def test_shared_array_record_holds_npy_bytes_in_one_sealed_file() -> None:
    """What Flower's ``ArrayRecord`` would hold, byte for byte, every dtype as it is, in
    one memory file that staging passes on without a copy; bfloat16 and objects are
    refused naming the key."""
    import io

    import torch

    from rankexec.flower import shared_array_record

    state = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "h": torch.full((5,), 1.5, dtype=torch.float16),
        "q": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u": torch.tensor([0, 255], dtype=torch.uint8),
        "t": torch.arange(6, dtype=torch.float64).reshape(2, 3).t(),  # not contiguous
        "s": torch.tensor(7, dtype=torch.int64),  # 0-d
    }
    record = shared_array_record(state)
    assert list(record.keys()) == list(state)
    files = set()
    for key, arr in record.items():
        want = state[key].numpy()
        assert type(arr.data).__name__ == "Blob", key
        assert arr.dtype == str(want.dtype) and tuple(arr.shape) == want.shape, key
        np.testing.assert_array_equal(arr.numpy(), want)
        if want.flags.c_contiguous:
            expected = io.BytesIO()
            np.save(expected, want, allow_pickle=False)
            assert bytes(memoryview(arr.data)) == expected.getvalue(), key
        files.add(arr.data.inode)
    assert len(files) == 1, "one memory file for the whole record"
    back = record.to_torch_state_dict()
    for key, tensor in state.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    views = ndarrays(shared_array_record([np.ones((2, 2), np.float32)]))
    assert views[0].tolist() == [[1, 1], [1, 1]] and not views[0].flags.writeable
    # A reply made this way goes through staging as it is: nothing to copy.
    msg = Message(RecordDict({"arrays": record}), dst_node_id=5, message_type="train")
    blobs: dict = {}
    _codec.encode_message(msg, blobs)
    assert stage_releasing(blobs, 1) == 0
    with pytest.raises(TypeError, match="'b16' is torch.bfloat16"):
        shared_array_record({"b16": torch.ones(2, dtype=torch.bfloat16)})
    with pytest.raises(TypeError, match="'0' holds Python objects"):
        shared_array_record([np.array([object()])])


def _serve_once(
    directory: Path, secret: bytes, result: list
) -> tuple[socket.socket, threading.Thread]:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(directory / "host.sock"))
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        with conn:
            try:
                _channel.accept_auth(conn, secret)
                req = _channel.recv(conn)
                _channel.send(conn, {"echo": req})
                result.append("ok")
            except _channel.ChannelError as e:
                result.append(f"refused: {e}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv, t


def test_channel_authenticates_and_moves_buffers(tmp_path: Path) -> None:
    d = _channel.private_dir(tmp_path / "node-1")
    secret = _channel.write_secret(d / "secret")
    assert (d / "secret").stat().st_mode & 0o777 == 0o600
    result: list = []
    srv, t = _serve_once(d, secret, result)
    with srv, _channel.connect(d) as sock:
        import pickle

        big = np.arange(1 << 16, dtype=np.float64)
        _channel.send(sock, {"x": 1, "b": pickle.PickleBuffer(big)})
        out = _channel.recv(sock)
    t.join(10)
    assert out["echo"]["x"] == 1
    assert np.array_equal(np.frombuffer(out["echo"]["b"], np.float64), big)
    assert result == ["ok"]


def test_channel_refuses_a_wrong_secret(tmp_path: Path) -> None:
    d = _channel.private_dir(tmp_path / "node-2")
    _channel.write_secret(d / "secret")
    result: list = []
    srv, t = _serve_once(d, b"another launch's secret".ljust(32, b"!"), result)
    with srv, pytest.raises(_channel.ChannelError):
        _channel.connect(d)
    t.join(10)
    assert result and result[0].startswith("refused")
    # The client's answer is the HMAC of the host's nonce, never the secret itself.
    assert hmac.new(b"k", b"n", hashlib.sha256).digest() != b"k"


def test_a_directory_open_to_others_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o755)
    with pytest.raises(_channel.ChannelError, match="open to other users"):
        _channel.private_dir(d)


def test_the_site_decides_launcher_gpus_program_and_size(tmp_path: Path) -> None:
    site_file = tmp_path / "site.json"
    site_file.write_text(
        '{"python": "/opt/py/bin/python", "env": {"set": {"A": "1"}},'
        ' "max_processes": 4, "gpu": {"devices": ["0", "1"]}, "launchers": ["builtin", "mpirun"]}'
    )
    site = _site.load({"rankexec-site": str(site_file)})
    app = {"num_of_processes": 2, "gpu": {"mode": "per_rank", "devices": ["1"]}}
    cfg = _site.group_config(site, app, "/logs")
    assert cfg["worker"]["program"] == "/opt/py/bin/python"
    assert cfg["gpu"] == {"mode": "per_rank", "devices": ["1"]}, "a subset of the site's"
    assert cfg["env"] == {"set": {"A": "1"}} and cfg["num_of_processes"] == 2
    with pytest.raises(_site.SiteError, match="allows 1 to 4"):
        _site.group_config(site, {"num_of_processes": 8}, "/logs")
    with pytest.raises(_site.SiteError, match="torchrun"):
        _site.group_config(site, {"launcher": {"torchrun": {}}}, "/logs")
    # Exact matching: `mpirun` is allowed, `mpirun` with arguments is another launcher.
    assert _site.group_config(site, {"launcher": {"mpirun": {}}}, "/logs")["launcher"]
    with pytest.raises(_site.SiteError, match="`launchers` in the site file"):
        _site.group_config(
            site, {"launcher": {"mpirun": {"extra_args": ["-x", "LD_PRELOAD=/x.so"]}}}, "/logs"
        )
    with pytest.raises(_site.SiteError, match=r"GPU devices \['7'\]; this node allows"):
        _site.group_config(site, {"gpu": {"devices": ["0", "7"]}}, "/logs")
    with pytest.raises(_site.SiteError, match="GPU devices"):
        _site.group_config({}, {"gpu": {"devices": ["0"]}}, "/logs")
    for key in ("env", "python", "worker"):
        with pytest.raises(_site.SiteError, match=f"the request sets `{key}`: on this node"):
            _site.group_config(site, {key: {}}, "/logs")
    site = _site.load({"rankexec-launcher": "torchrun", "rankexec-gpus": "2,3"})
    cfg = _site.group_config(site, {"launcher": "builtin"}, "/logs")
    assert cfg["launcher"] == "torchrun" and cfg["gpu"] == {"devices": ["2", "3"]}
    site_file.write_text('{"launchres": ["torchrun"]}')
    with pytest.raises(_site.SiteError, match=r"unknown key\(s\) \['launchres'\]"):
        _site.load({"rankexec-site": str(site_file)})
