"""Large models through ``rankexec.flower.ClientApp`` (issue 31, item 5): the message's
``ArrayRecord`` lands in one memory file once (the ClientApp copies it there and lets
go of Flower's copy; the host hands that same file to every rank), and rank 0's reply
reaches the ClientApp as its memory file, mapped, not copied. This process plays
``flwr-clientapp`` (see test_host.py); the host and the ranks are real.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from rankexec.flower import CLOSE_MESSAGE_TYPE

from .helpers import mapping_of, served_app

APP = """
import os

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from rankexec.flower import ClientApp, ndarrays, shared_array_record

app = ClientApp(num_of_processes=2, deadlines={"startup": "120s", "task": "120s"})


_kept = []


def _status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _mapping(address):
    # The path and inode of the mapping that holds `address`.
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return (parts[5].strip() if len(parts) > 5 else ""), int(parts[4])
    return "", 0


@app.train()
def train(msg, context):
    arrays = ndarrays(msg.content["arrays"])
    places = sorted({_mapping(a.ctypes.data)[0] for a in arrays})
    files = sorted({os.stat(p).st_ino for p in
                    (f"/proc/self/map_files/{line.split()[0]}" for line in
                     open("/proc/self/maps") if "memfd:rankexec-py-blob" in line)} or {0})
    info = {"places": places, "n": len(arrays), "rank": int(os.environ["RANK"]), "pid": os.getpid()}
    if "how" in msg.content and msg.content["how"]["reply"] == "churn":
        # A handler's transient tensors, freed before it returns (1-32 MiB: glibc's heap
        # keeps them resident; the small ones kept alive hold its holes open).
        info["anon_in"] = _status("RssAnon")
        np.ones(16 << 20, dtype=np.uint8)  # glibc's mmap threshold rises, as after any round
        scratch = []
        for i in range(48):
            scratch.append(np.full(8 << 20, i, dtype=np.uint8))
            _kept.append(np.ones(256 << 10, dtype=np.uint8))
        info["anon_peak"] = _status("RssAnon")
        del scratch
        out = shared_array_record([np.ones(4, np.float32)])
    elif "how" in msg.content and msg.content["how"]["reply"] == "shared":
        out = shared_array_record([a + 1 for a in arrays])
        first = next(iter(out.values()))
        info["inode"] = _mapping(np.frombuffer(first.data, dtype=np.uint8).ctypes.data)[1]
    else:
        out = ArrayRecord([a + 1 for a in arrays])
    return Message(RecordDict({"arrays": out, "info": ConfigRecord(info)}), reply_to=msg)
"""


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from served_app(tmp_path, monkeypatch, "bigapp", textwrap.dedent(APP))


_mapping = mapping_of  # the app's twin, in this process


def test_an_array_record_lands_in_one_memory_file_and_the_reply_is_not_copied(app) -> None:
    node, run = 7, 51
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, 1
    # 200 arrays (a state dict's worth of tensors), 16 MiB, over the 64 descriptors a
    # frame could carry were each its own file.
    arrays = [np.full(20_000 + i, i, dtype=np.float32) for i in range(200)]
    msg = Message(
        RecordDict({"arrays": ArrayRecord(arrays)}), dst_node_id=node, message_type="train"
    )
    ctx = Context(run, node, {"rankexec-lease": 30.0}, RecordDict(), {})
    try:
        reply = app(msg, ctx)
        assert not reply.has_error(), reply.error
        info = reply.content["info"]
        print("rank 0 mapped its input from:", info["places"])
        assert info["n"] == 200 and info["rank"] == 0
        assert len(info["places"]) == 1 and "memfd:rankexec-py-blob" in info["places"][0]
        # The ClientApp let go of Flower's copy of the message's arrays.
        assert len(msg.content["arrays"]) == 0
        back = reply.content["arrays"]
        assert len(back) == 200
        for i, (key, arr) in enumerate(back.items()):
            a = arr.numpy()
            assert a.dtype == np.float32 and a.shape == (20_000 + i,), key
            assert a[0] == i + 1 and a[-1] == i + 1, key
            # Flower's Array.data here is a view of rank 0's memory file.
            address = np.frombuffer(arr.data, dtype=np.uint8).ctypes.data
            assert "memfd:rankexec-py-blob" in _mapping(address)[0], (key, _mapping(address))
        # A second message on the same group works the same way.
        msg2 = Message(
            RecordDict({"arrays": ArrayRecord(arrays[:3])}), dst_node_id=node, message_type="train"
        )
        reply2 = app(msg2, ctx)
        assert not reply2.has_error(), reply2.error
        assert reply2.content["info"]["n"] == 3
    finally:
        close = Message(RecordDict(), dst_node_id=node, message_type=CLOSE_MESSAGE_TYPE)
        app(close, ctx)


def test_a_reply_made_with_shared_array_record_leaves_rank_0_as_its_own_file(app) -> None:
    """Rank 0's ``shared_array_record`` is the file the ClientApp maps: the reply is not
    copied again on its way out (with ``ArrayRecord(...)`` rank 0 copies Flower's bytes
    into a new file, so the inodes differ; checked in the same run)."""
    node, run = 8, 52
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, 1
    arrays = [np.full(300_000 + i, i, dtype=np.float16) for i in range(12)]  # 7 MiB
    ctx = Context(run, node, {"rankexec-lease": 30.0}, RecordDict(), {})

    def ask(reply: str) -> Message:
        content = {"arrays": ArrayRecord(arrays), "how": ConfigRecord({"reply": reply})}
        msg = Message(RecordDict(content), dst_node_id=node, message_type="train")
        out = app(msg, ctx)
        assert not out.has_error(), out.error
        return out

    try:
        shared = ask("shared")
        info = shared.content["info"]
        assert info["rank"] == 0 and info["inode"] > 0
        back = shared.content["arrays"]
        assert list(back.keys()) == [str(i) for i in range(12)]
        for i, arr in enumerate(back.values()):
            a = arr.numpy()
            assert a.dtype == np.float16 and a.shape == (300_000 + i,)
            assert a[0] == i + 1 and a[-1] == i + 1
            address = np.frombuffer(arr.data, dtype=np.uint8).ctypes.data
            assert _mapping(address)[1] == info["inode"], "rank 0's own file, mapped here"
        copied = ask("flower")
        address = np.frombuffer(next(iter(copied.content["arrays"].values())).data, np.uint8)
        assert _mapping(address.ctypes.data)[1] not in (0, info["inode"])
    finally:
        close = Message(RecordDict(), dst_node_id=node, message_type=CLOSE_MESSAGE_TYPE)
        app(close, ctx)


def test_what_a_handler_freed_leaves_the_rank(app) -> None:
    """A handler's transient tensors (1-32 MiB, glibc's heap) are given back to the
    kernel once it returns, also when its reply needs no staging
    (``shared_array_record``): rank 0 does not carry them into the next round."""
    node, run = 9, 53
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, 1
    ctx = Context(run, node, {"rankexec-lease": 30.0}, RecordDict(), {})
    content = {
        "arrays": ArrayRecord([np.ones(8, np.float32)]),
        "how": ConfigRecord({"reply": "churn"}),
    }
    msg = Message(RecordDict(content), dst_node_id=node, message_type="train")
    try:
        out = app(msg, ctx)
        assert not out.has_error(), out.error
        info = out.content["info"]
        with open(f"/proc/{info['pid']}/status") as f:
            after = next(int(x.split()[1]) * 1024 for x in f if x.startswith("RssAnon:"))
        mib = {
            k: (v - info["anon_in"]) / (1 << 20)
            for k, v in (("peak", info["anon_peak"]), ("after", after))
        }
        print(f"\n[heap] rank 0's anonymous memory above the handler's start, MiB: {mib}")
        assert mib["peak"] >= 360, mib  # 384 MiB allocated
        assert mib["after"] < 64, mib  # and given back once the handler returned
    finally:
        close = Message(RecordDict(), dst_node_id=node, message_type=CLOSE_MESSAGE_TYPE)
        app(close, ctx)


def _frame(head: bytes, descs: list[tuple[int, int, int]], n_fds: int) -> bytes:
    import struct

    return (
        struct.pack("<QQQ", len(head), len(descs), n_fds)
        + b"".join(struct.pack("<QqQ", *d) for d in descs)
        + head
    )


def test_the_channel_refuses_bad_memory_files_naming_why() -> None:
    import pickle
    import socket

    from rankexec.flower import _channel

    head = pickle.dumps(
        [pickle.PickleBuffer(b"x" * 10)], protocol=5, buffer_callback=lambda b: None
    )
    # A memory file that is not sealed: its sender could change it under the ranks.
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, 4096)
    a, b = socket.socketpair()
    with a, b:
        socket.send_fds(a, [_frame(head, [(10, 0, 0)], 1)], [fd])
        with pytest.raises(_channel.ChannelError, match="a memory file was refused: .*not sealed"):
            _channel.recv(b)
    # A frame whose descriptor count is not what came with it.
    a, b = socket.socketpair()
    with a, b:
        a.sendall(_frame(head, [(10, 0, 0)], 1))
        with pytest.raises(_channel.ChannelError, match="malformed frame"):
            _channel.recv(b)
    # A buffer naming a descriptor that is not there.
    a, b = socket.socketpair()
    with a, b:
        socket.send_fds(a, [_frame(head, [(10, 3, 0)], 1)], [fd])
        with pytest.raises(_channel.ChannelError, match="names memory file 3 of 1"):
            _channel.recv(b)
    os.close(fd)
    # Nothing of it stays open here: every received descriptor was closed.
    memfds = [e for e in os.listdir("/proc/self/fd") if _fd_target(e).startswith("/memfd:unsealed")]
    assert memfds == []


def _fd_target(entry: str) -> str:

    try:
        return os.readlink(f"/proc/self/fd/{entry}")
    except OSError:
        return ""
