"""``rankexec.flower._pull``: a message deflated by Flower's own code (its objects and
object tree, as a SuperNode stores them) pulled with its multi-chunk arrays written into
memory files. The objects are served from a dict by object id, which is what the
SuperNode's object store does; the end-to-end path under a real SuperNode is
test_pull_deployment.py."""

from __future__ import annotations

import hashlib
import os

import flwr.app.message.array as flower_array
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.serde import context_to_proto
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.inflatable.inflatable_utils import (
    ObjectPullError,
    pull_and_inflate_object_from_tree,
)
from flwr.supercore.task_identity import TaskIdentity

from rankexec.flower._codec import own_arrays
from rankexec.flower._pull import pull_message

CHUNK = flower_array.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE


def _message(records: RecordDict) -> Message:
    # A ServerApp's message: Flower takes its run from the task it runs in.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 0, 1
    return Message(records, dst_node_id=1, message_type="train")


def _record(arrays: dict) -> ArrayRecord:
    rec = ArrayRecord()
    for k, v in arrays.items():
        rec[k] = v if isinstance(v, Array) else Array(v)
    return rec


class Store:
    """What a SuperNode's object store serves: each object's deflated content by id,
    and the calls made to it, in order."""

    def __init__(self, message: Message) -> None:
        self.contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
        self.tree = get_object_tree(message)
        self.calls: list[tuple[str, str]] = []

    def pull(self, object_id: str) -> bytes:
        self.calls.append(("pull", object_id))
        if object_id not in self.contents:
            raise ObjectPullError(object_id, "the object could not be found.")
        # A new object for each pull, as the Runtime API's response gives: a pull that
        # kept what it got would show in this process's heap.
        return bytes(memoryview(self.contents[object_id]))

    def confirm(self, object_id: str) -> None:
        self.calls.append(("confirm", object_id))


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "big": rng.standard_normal((3 * CHUNK // 4 + 17,), dtype=np.float32),  # 3+ chunks
        "exact": rng.integers(0, 255, size=(2 * CHUNK - 128,), dtype=np.uint8),
        "zeros": np.zeros((CHUNK,), dtype=np.float32),  # 4 identical chunks but the last
        "small": rng.standard_normal((1000,), dtype=np.float32),  # one chunk: bytes
    }


def test_multi_chunk_arrays_land_in_memory_files_byte_for_byte() -> None:
    model = _model()
    rec = _record(model)
    rec["again"] = rec["big"]  # one Array object under two names
    msg = _message(RecordDict({"arrays": rec, "config": ConfigRecord({"lr": 0.1})}))
    store = Store(msg)
    got, in_files = pull_message(store.tree, store.pull, store.confirm)

    assert in_files == 3, in_files  # big, exact, zeros ("again" is big's object)
    arrays = got.content["arrays"]
    for name in ("big", "exact", "zeros", "again"):
        data = arrays[name].data
        assert type(data).__name__ == "Blob" and data.shared, (name, type(data))
        want = model["big" if name == "again" else name]
        assert np.array_equal(arrays[name].numpy(), want), name
        original = rec[name].data
        assert hashlib.sha256(memoryview(data)).digest() == hashlib.sha256(original).digest()
    assert isinstance(arrays["small"].data, bytes)
    assert np.array_equal(arrays["small"].numpy(), model["small"])
    assert dict(got.content["config"]) == {"lr": 0.1}
    # The confirmation (which lets the SuperNode drop its copy) comes after every pull.
    kinds = [k for k, _ in store.calls]
    assert kinds.count("confirm") == 1 and kinds[-1] == "confirm", kinds[-3:]
    # Each object pulled once; a chunk shared by several places of the zeros too.
    pulled = [oid for k, oid in store.calls if k == "pull"]
    assert len(pulled) == len(set(pulled)), len(pulled) - len(set(pulled))


def test_a_message_without_multi_chunk_arrays_is_flowers_own() -> None:
    model = {"w": np.arange(1000, dtype=np.float64)}
    store = Store(_message(RecordDict({"arrays": _record(model)})))
    got, in_files = pull_message(store.tree, store.pull, store.confirm)
    assert in_files == 0
    assert isinstance(got.content["arrays"]["w"].data, bytes)
    assert np.array_equal(got.content["arrays"]["w"].numpy(), model["w"])


def test_arrays_cut_in_other_sizes_fall_back_to_flowers_pull(monkeypatch, caplog) -> None:
    """The second array cut in chunks of another size than the first's: the layout does
    not fit, nothing was confirmed yet, and the message is pulled again Flower's way."""
    a = Array(np.arange(3 * CHUNK // 8, dtype=np.float64))
    monkeypatch.setattr(flower_array, "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", CHUNK // 2)
    b = Array(np.arange(3 * CHUNK // 8, dtype=np.float64) * 2)
    b.slice_array()  # cut now, in the smaller chunks
    monkeypatch.setattr(flower_array, "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", CHUNK)
    store = Store(_message(RecordDict({"arrays": _record({"a": a, "b": b})})))
    with caplog.at_level("WARNING", logger="flwr"):
        got, in_files = pull_message(store.tree, store.pull, store.confirm)
    assert in_files == 0
    assert "the message is pulled again Flower's way" in caplog.text, caplog.text
    assert np.array_equal(got.content["arrays"]["a"].numpy(), a.numpy())
    assert np.array_equal(got.content["arrays"]["b"].numpy(), b.numpy())
    assert [k for k, _ in store.calls].count("confirm") == 1


def test_an_object_the_store_lacks_raises_and_confirms_nothing() -> None:
    model = _model()
    store = Store(_message(RecordDict({"arrays": _record(model)})))
    chunk = next(oid for oid, c in store.contents.items() if c.startswith(b"ArrayChunk "))
    del store.contents[chunk]
    with pytest.raises(ObjectPullError):
        pull_message(store.tree, store.pull, store.confirm)
    assert "confirm" not in [k for k, _ in store.calls]


def test_the_memory_files_are_all_that_holds_the_arrays() -> None:
    """The pulled chunks are not kept: after the pull, this process's heap did not grow
    by the model (the arrays' bytes sit in memory files, counted as shared memory)."""
    n = 48 * CHUNK // 4  # 48 chunks of float32, ~240 MB
    big = Array(np.full((n,), 3.0, dtype=np.float32))
    store = Store(_message(RecordDict({"arrays": _record({"big": big})})))
    anon_before = _rss_anon()
    got, in_files = pull_message(store.tree, store.pull, store.confirm)
    grown = _rss_anon() - anon_before
    assert in_files == 1
    assert grown < n * 4 // 4, f"the heap grew by {grown >> 20} MiB for a {n * 4 >> 20} MiB array"
    assert (
        float(
            np.frombuffer(got.content["arrays"]["big"].data, dtype=np.uint8)[-4:].view(np.float32)[
                0
            ]
        )
        == 3.0
    )


def _rss_anon() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_a_listener_that_is_not_a_supernode_is_not_taken_for_one() -> None:
    """``supernode_listening_on``: this test process listens on a port; it is found as
    the socket's owner only by its command line, which is not a SuperNode's."""
    import socket

    from rankexec.flower._supernode import (
        listeners,
        runtime_address,
        runtime_port,
        supernode_listening_on,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listeners(port) == [os.getpid()]  # found by its socket...
        assert supernode_listening_on(port) is None  # ...and refused by its command line
    assert listeners(port) == [] and supernode_listening_on(port) is None
    # On another address than the socket's: not that listener.
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listeners(port, "127.0.0.2") == [os.getpid()]
        assert listeners(port, "127.0.0.1") == []
    with socket.socket() as s:  # a wildcard listener takes every address
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listeners(port, "127.0.0.1") == [os.getpid()]
    assert runtime_address(["--appio-api-address", "localhost:9096"])[1] == 9096
    assert runtime_port(["--token", "t", "--runtime-api-address", "127.0.0.1:9094"]) == 9094
    assert runtime_port(["--runtime-api-address=[::1]:9095"]) == 9095
    assert runtime_port(["--runtime-api-address", "nonsense"]) is None
    assert runtime_port([]) is None


def test_records_arrays_and_chunks_shared_across_the_message() -> None:
    """One ArrayRecord object under two names, one array under two keys, a chunk shared
    by a single-chunk and a multi-chunk array: every key reads its bytes, each key has
    an Array of its own (as Flower's inflation gives), and no object is pulled twice."""
    body = np.full((CHUNK // 4,), 7.0, dtype=np.float32)  # its chunk 1: all 7.0
    big = Array(np.concatenate([body, body]))  # 2+ chunks
    single = Array(dtype="x", shape=(CHUNK,), stype="raw", data=bytes(big.data[CHUNK : 2 * CHUNK]))
    rec = _record({"big": big, "twice": big, "single": single})
    msg = _message(RecordDict({"one": rec, "two": rec}))
    store = Store(msg)
    got, in_files = pull_message(store.tree, store.pull, store.confirm)
    assert in_files == 1
    pulled = [oid for k, oid in store.calls if k == "pull"]
    assert len(pulled) == len(set(pulled)), sorted(pulled)
    one, two = got.content["one"], got.content["two"]
    for r in (one, two):
        assert np.array_equal(r["big"].numpy(), big.numpy())
        assert bytes(memoryview(r["twice"].data)) == big.data
        assert r["single"].data == single.data
    # The same sharing as Flower's own inflation: one record object under both names
    # where Flower gives one, and an Array of its own for each key.
    flowers = pull_and_inflate_object_from_tree(
        store.tree, store.pull, store.confirm, return_type=Message
    )
    assert (one is two) == (flowers.content["one"] is flowers.content["two"])
    assert one["big"] is not one["twice"]
    one["big"].shape = (1,)
    assert one["twice"].shape == big.shape


def test_an_error_message_is_flowers_own() -> None:
    asked = _message(RecordDict())
    msg = Message(Error(code=3, reason="boom"), reply_to=asked)  # a node's error reply
    store = Store(msg)
    got, in_files = pull_message(store.tree, store.pull, store.confirm)
    assert in_files == 0 and got.has_error() and got.error.reason == "boom"


def test_a_state_keeping_pulled_arrays_is_given_bytes_for_flowers_serialization() -> None:
    """A handler that keeps received arrays in ``context.state``: Flower's
    ``context_to_proto`` refuses a memory file's view (its field takes ``bytes``), so
    the node's context would be dropped; ``own_arrays`` (what the SuperExec's
    ClientApp process and rankexec's ``ClientApp`` apply) makes it ``bytes``."""
    store = Store(_message(RecordDict({"arrays": _record(_model())})))
    got, _ = pull_message(store.tree, store.pull, store.confirm)
    state = RecordDict({"kept": got.content["arrays"]})
    ctx = Context(run_id=7, node_id=1, node_config={}, state=state, run_config={})
    with pytest.raises(TypeError):
        context_to_proto(ctx)
    own_arrays(ctx.state)
    proto = context_to_proto(ctx)
    assert proto.run_id == 7
    assert np.array_equal(ctx.state["kept"]["big"].numpy(), _model()["big"])


def test_another_executor_than_subprocess_is_refused_naming_it() -> None:
    """``rankexec-flower-superexec --executor kubernetes``: the ClientApp command it
    gives Flower is a path on this machine, which a pod would not have."""
    import subprocess
    import sys
    from pathlib import Path

    command = Path(sys.executable).parent / "rankexec-flower-superexec"
    out = subprocess.run(
        [
            str(command),
            "--insecure",
            "--runtime-api-address",
            "127.0.0.1:1",
            "--executor",
            "kubernetes",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert out.stderr.strip().endswith(
        "rankexec-flower-superexec: error: --executor kubernetes: rankexec-flower-superexec"
        " starts ClientApp processes on this machine only (--executor subprocess)"
    ), out.stderr[-2000:]
