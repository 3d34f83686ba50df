"""``ClientApp(arrays_to="rank0")`` (issue 41, item 3 for Flower): rank 0 alone receives
the message's arrays, as a writable copy in memory files of its own, taken part by part
while the input is let go; a handler that updates them in place and replies
``shared_array_record`` of them sends those files, sealed, without a copy. This process
plays ``flwr-clientapp`` (as test_large_arrays.py); the host and the ranks are real, and
the checks read what the OS says: which memory files exist in the node's processes (by
inode, from ``/proc/PID/fd`` and ``/proc/PID/map_files``) while rank 0's handler holds
its arrays, and which file the reply is mapped from here.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from rankexec.flower import CLOSE_MESSAGE_TYPE, ClientApp

from .helpers import mapping_of, pids_with_env, served_app, wait_until

# The app: a module of its own (own_app.py), so that the guide can show it as it runs.
APP = Path(__file__).with_name("own_app.py")


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from served_app(tmp_path, monkeypatch, "ownapp", APP.read_text())


def _memory_files(pids: list[int]) -> dict[int, int]:
    """Every memory file the processes ``pids`` hold open or map: inode -> size (from
    the descriptors and mappings; a mapping whose file cannot be read counts with the
    end of its furthest mapping from ``/proc/PID/maps``)."""
    found: dict[int, int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            continue  # the process is gone
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/memfd:"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            end = int(parts[2], 16) + hi - lo
            found[int(parts[4])] = max(found.get(int(parts[4]), 0), end)
        for folder in (f"/proc/{pid}/fd", f"/proc/{pid}/map_files"):
            try:
                names = os.listdir(folder)
            except OSError:
                continue  # the process is gone
            for name in names:
                path = os.path.join(folder, name)
                try:
                    if not os.readlink(path).startswith("/memfd:"):
                        continue
                    st = os.stat(path)
                except OSError:
                    continue
                found[st.st_ino] = st.st_size
    return found


def _ask(app: ClientApp, arrays: list[np.ndarray], node: int, run: int, how: dict) -> Message:
    ctx = Context(run, node, {"rankexec-lease": 30.0}, RecordDict(), {})
    content = {"arrays": ArrayRecord(arrays), "how": ConfigRecord(how)}
    msg = Message(RecordDict(content), dst_node_id=node, message_type="train")
    return app(msg, ctx)


def _close(app: ClientApp, node: int, run: int) -> None:
    ctx = Context(run, node, {"rankexec-lease": 30.0}, RecordDict(), {})
    app(Message(RecordDict(), dst_node_id=node, message_type=CLOSE_MESSAGE_TYPE), ctx)


def test_rank_0_owns_the_arrays_and_the_node_holds_them_once(app, tmp_path: Path) -> None:
    """While rank 0's handler holds its writable arrays, the only large memory files in
    the node (this process, the host, both ranks) are rank 0's own: the message's input
    files are gone. Its in-place update goes back as those very files (the reply's
    arrays are mapped here from rank 0's inodes) with the values it wrote."""
    node, run = 17, 71
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, 1
    # 96 MiB in 24 arrays: more than one part (parts of at least 64 MiB).
    arrays = [np.full(1 << 20, i, dtype=np.float32).reshape(1024, -1) for i in range(24)]
    model = sum(a.nbytes for a in arrays)
    hold = tmp_path / "hold"
    hold.mkdir()
    os.mkfifo(hold / "go")
    got: dict = {}
    before = set(_memory_files([os.getpid()]))  # earlier tests' files in this process

    def call() -> None:
        got["reply"] = _ask(app, arrays, node, run, {"hold": str(hold), "extra": False})

    caller = threading.Thread(target=call)
    caller.start()
    try:
        ready = hold / "ready"
        wait_until(lambda: ready.exists() or not caller.is_alive(), 120, "rank 0's arrays")
        assert ready.exists(), f"the handler did not get so far: {got.get('reply')}"
        info = json.loads(ready.read_text())
        mine = [os.getpid(), *pids_with_env(str(tmp_path / "rx"))]
        files = {k: v for k, v in _memory_files(mine).items() if k not in before}
    finally:
        # Let the handler go on: a writer that comes and goes wakes its select (none
        # waits there if the handler never got so far: ENXIO).
        try:
            os.close(os.open(hold / "go", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        caller.join(120)
    try:
        assert not caller.is_alive(), "the message was not answered"
        other = json.loads((hold / "rank1").read_text())
        assert other == {"rank": 1, "n": 0}, "rank 1 saw the message's arrays"
        large = {ino: size for ino, size in files.items() if size >= 1 << 20}
        print(f"\n[own] rank 0's files {info['inodes']}; the node's large memory files {large}")
        assert info["n"] == 24 and info["writable"], info
        assert info["inodes"] and 0 not in info["inodes"], info
        # Rank 0's own files hold the model; nothing else large is left in the node.
        assert set(large) == set(info["inodes"]), (large, info["inodes"])
        assert model <= sum(large.values()) < model + (8 << 20), (model, large)
        reply = got["reply"]
        assert not reply.has_error(), reply.error
        back = reply.content["arrays"]
        assert list(back.keys()) == [str(i) for i in range(24)]
        for i, arr in enumerate(back.values()):
            a = arr.numpy()
            assert a.shape == (1024, 1024) and a.dtype == np.float32
            assert a[0, 0] == i + 1 and a[-1, -1] == i + 1
            address = np.frombuffer(arr.data, dtype=np.uint8).ctypes.data
            assert mapping_of(address)[1] in info["inodes"], "rank 0's own file, not a copy"
    finally:
        _close(app, node, run)


def test_arrays_that_are_not_the_messages_are_copied(app) -> None:
    """A reply mixing rank 0's own arrays with new ones: the new ones (and a part of an
    own array) are copied into a new file; the own ones are sent as their files. A
    small model (under 1 MiB) is rank 0's private copy, writable, and goes back
    copied."""
    node, run = 18, 72
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, 1
    arrays = [np.full(1 << 20, i, dtype=np.float32) for i in range(3)]  # 12 MiB
    try:
        reply = _ask(app, arrays, node, run, {"hold": "", "extra": True})
        assert not reply.has_error(), reply.error
        info = reply.content["info"]
        back = reply.content["arrays"]
        assert list(back.keys()) == ["0", "1", "2", "extra", "flat0"]
        where = {
            k: mapping_of(np.frombuffer(v.data, dtype=np.uint8).ctypes.data)[1]
            for k, v in back.items()
        }
        assert {where[k] for k in "012"} <= set(info["inodes"]), (where, info["inodes"])
        assert where["extra"] not in info["inodes"] and where["extra"] == where["flat0"]
        np.testing.assert_array_equal(back["extra"].numpy(), np.arange(1000, dtype=np.float32))
        np.testing.assert_array_equal(back["flat0"].numpy(), np.ones(10, np.float32))
        for i in range(3):
            assert back[str(i)].numpy()[-1] == i + 1
        small = _ask(app, [np.zeros(16, np.float64)], node, run, {"hold": "", "extra": False})
        assert not small.has_error(), small.error
        assert small.content["info"]["writable"]
        np.testing.assert_array_equal(small.content["arrays"]["0"].numpy(), np.ones(16))
    finally:
        _close(app, node, run)


def test_the_rank_side_takes_one_writable_copy_per_array() -> None:
    """The rank side: rank 1 lets go of the message's arrays and decodes empty
    ``ArrayRecord``s, keeping a blob the context's state shares; rank 0 gets a writable
    copy of each array, so that two arrays Flower sent as one buffer (equal content),
    or an array the state shares, do not change together when one is written."""
    from rankexec.flower import _arrays, _codec
    from rankexec.flower._rank import _take_arrays

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 73, 0, 1
    blobs: dict = {}
    first = np.arange(8, dtype=np.float32)
    msg = Message(
        RecordDict(
            {"arrays": ArrayRecord([first, np.ones(4, np.float32), np.ones(4, np.float32)])}
        ),
        dst_node_id=1,
        message_type="train",
    )
    rec = msg.content["arrays"]
    rec["2"].data = rec["1"].data  # equal content: one buffer, as Flower delivers it
    state = RecordDict({"kept": ArrayRecord([np.zeros(2, np.float32)])})
    mspec = _codec.encode_message(msg, blobs)
    # The state holds the message's first array's very bytes: one blob for both.
    state["kept"]["0"].data = rec["0"].data
    cspec = {"state": _codec.encode_records(state, "s", blobs)}
    names = _codec.array_blobs(mspec)
    assert len(names) == 2, "three arrays, two blobs"
    assert set(_codec.array_blobs({"content": cspec["state"]})) == {names[0]}

    other = dict(blobs)
    spec1 = {"message": json_copy(mspec), "context": cspec}
    _take_arrays(spec1, other, rank=1)
    assert set(other) == {names[0]}, "rank 1 keeps only what the state needs"
    assert len(_codec.decode_message(spec1["message"], other).content["arrays"]) == 0

    own = dict(blobs)
    spec0 = {"message": json_copy(mspec), "context": cspec}
    _take_arrays(spec0, own, rank=0)
    m0 = _codec.decode_message(spec0["message"], own)
    c0 = _codec.decode_records(cspec["state"], own)
    got = _arrays.ndarrays(m0.content["arrays"], writable=True)
    assert all(a.flags.writeable for a in got)
    for a in got:
        a += 1
    np.testing.assert_array_equal(got[0], first + 1)
    np.testing.assert_array_equal(got[1], np.full(4, 2, np.float32))
    np.testing.assert_array_equal(got[2], np.full(4, 2, np.float32))  # not 3: its own
    # The state's array (the same bytes as the message's first) is unchanged.
    np.testing.assert_array_equal(_arrays.ndarrays(c0["kept"])[0], first)
    # Read-only input views asked writable: copies.
    ro = _arrays.ndarrays(msg.content["arrays"], writable=True)
    assert all(a.flags.writeable for a in ro)
    _arrays.release_owned()


def json_copy(spec: dict) -> dict:
    """A spec as a rank reads it: decoded from its JSON."""
    from rankexec.flower import _codec

    return _codec.unpack(_codec.pack(spec))


def test_arrays_to_is_all_or_rank0_for_the_app_and_the_host() -> None:
    from rankexec.flower._runs import _spec

    with pytest.raises(ValueError, match="arrays_to is 'all' or 'rank0'"):
        ClientApp(arrays_to="rank1")
    base = {"message": {}, "context": {}}
    assert _spec({"spec": {**base, "arrays_to": "rank0"}, "blobs": {}})[0] is not None
    spec, why = _spec({"spec": {**base, "arrays_to": "everyone"}, "blobs": {}})
    assert spec is None and "arrays_to 'everyone'" in why, why
