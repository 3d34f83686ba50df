"""Large models through ``rankexec.flare.ScriptExecutor`` (issue 31), on the
executor's real rank group (real interpreters running the script), without the
simulator: FLARE's decoded copy released once the model is in shared memory, rank 0's
result taken from its memory file without a copy, dtypes as they are, and memory
files not counted against ``max_frame``.
"""

from __future__ import annotations

import json
import os
import threading
import weakref

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.shareable import ReturnCode

from .flare_helpers import wait_until
from .test_client_api import CAP_S, PREAMBLE, Group


@pytest.fixture
def groups():
    made: list[Group] = []

    def make(tmp_path, script: str, **kw) -> Group:
        g = Group(tmp_path, script, **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.group.close()


DTYPES = (
    PREAMBLE
    + """
    import torch
    flare.init()
    while flare.is_running():
        m = flare.receive()
        if m is None:   # a rank that does not receive (FLARE's semantics)
            continue
        seen = {k: [type(v).__module__, str(v.dtype)] for k, v in m.params.items()}
        mark("received", json.dumps(seen))
        if os.path.exists(os.path.join(args.marks, "hold")):
            while not os.path.exists(os.path.join(args.marks, "go")):
                time.sleep(0.01)
        out = {}
        for k, v in m.params.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                v.add_(1)  # in place, in its own dtype: no upcast
            elif isinstance(v, torch.Tensor):
                v.add_(1)
            else:
                v = v + np.ones(1, dtype=v.dtype)
            out[k] = v
        flare.send(FLModel(params=out, meta={"seen": seen}))
"""
)


def _execute_in_thread(g: Group, shareable) -> tuple[threading.Thread, list]:
    """Runs a ``train`` task on ``g``'s executor on a thread; its reply lands in the list."""
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.signal import Signal

    replies: list = []
    t = threading.Thread(
        target=lambda: replies.append(g.executor.execute("train", shareable, FLContext(), Signal()))
    )
    t.start()
    return t, replies


def _mapped_from_memfd(address: int) -> str | None:
    """The memory file whose mapping in this process holds `address`, if any."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                path = parts[5].strip() if len(parts) > 5 else ""
                return path if path.startswith("/memfd:") else None
    return None


def test_torch_dtypes_travel_as_they_are_and_the_result_is_not_copied(tmp_path, groups):
    g = groups(
        tmp_path,
        DTYPES,
        params_exchange_format="pytorch",
        server_expected_format="pytorch",
    )
    sent = {
        "bf16": torch.full((300, 300), 1.5, dtype=torch.bfloat16),
        "f16": torch.full((300, 300), 2.5, dtype=torch.float16),
        "i8": torch.full((300, 300), -3, dtype=torch.int8),
        "u8": torch.full((300, 300), 200, dtype=torch.uint8),
        "f32": torch.full((300, 300), 0.5, dtype=torch.float32),
    }
    reply = g.execute("train", {k: v.clone() for k, v in sent.items()})
    assert reply.get_return_code(ReturnCode.OK) == ReturnCode.OK, reply
    dxo = from_shareable(reply)
    seen = dxo.meta["seen"]
    print("rank 0 saw:", json.dumps(seen))
    assert seen == {k: ["torch", str(v.dtype)] for k, v in sent.items()}
    for k, v in sent.items():
        got = dxo.data[k]
        assert isinstance(got, torch.Tensor) and got.dtype == v.dtype, k
        assert torch.equal(got, v + 1), k
        # The host's tensor is a (copy-on-write) mapping of rank 0's memory file.
        where = _mapped_from_memfd(got.data_ptr())
        assert where is not None and "rankexec-blobs" in where, (k, where)


def test_numpy_dtypes_travel_as_they_are(tmp_path, groups):
    g = groups(tmp_path, DTYPES)
    sent = {
        "f16": np.full(50_000, 2.5, dtype=np.float16),
        "i8": np.full(70_000, -3, dtype=np.int8),
        "u8": np.full(70_000, 200, dtype=np.uint8),
        "f64": np.full(10_000, 0.25, dtype=np.float64),
    }
    reply = g.execute("train", {k: v.copy() for k, v in sent.items()})
    assert reply.get_return_code(ReturnCode.OK) == ReturnCode.OK, reply
    dxo = from_shareable(reply)
    assert dxo.meta["seen"] == {k: ["numpy", str(v.dtype)] for k, v in sent.items()}
    for k, v in sent.items():
        got = dxo.data[k]
        assert got.dtype == v.dtype, k
        np.testing.assert_array_equal(got, v + np.ones(1, dtype=v.dtype))


def test_flares_decoded_copy_is_released_while_the_ranks_run(tmp_path, groups):
    g = groups(tmp_path, DTYPES)
    (g.marks / "hold").write_text("")
    arrays = {f"w{i}": np.full(1 << 20, i, dtype=np.float32) for i in range(4)}
    refs = {k: weakref.ref(v) for k, v in arrays.items()}
    shareable = DXO(DataKind.WEIGHTS, data=arrays).to_shareable()
    del arrays
    t, replies = _execute_in_thread(g, shareable)
    try:
        assert wait_until(lambda: (g.marks / "received").exists(), timeout=CAP_S)
        # Rank 0 holds the model (from the memory file); this process no longer does.
        alive = [k for k, r in refs.items() if r() is not None]
        assert alive == [], f"FLARE's copies still alive while the ranks run: {alive}"
        assert from_shareable(shareable).data == {}, "the task's DXO data was released"
    finally:
        (g.marks / "go").write_text("")
        t.join(CAP_S)
    assert replies and replies[0].get_return_code(ReturnCode.OK) == ReturnCode.OK
    got = from_shareable(replies[0]).data
    assert sorted(got) == [f"w{i}" for i in range(4)]
    assert float(got["w3"][0]) == 4.0


def test_memory_files_do_not_count_against_max_frame(tmp_path, groups):
    # 8 MiB of weights in 40 tensors with a 64 KiB frame limit: only inline bytes count.
    g = groups(tmp_path, DTYPES, group_cfg={"max_frame": "64KiB"})
    sent = {f"h.{i}.w": np.full(52_429, i, dtype=np.float32) for i in range(40)}
    reply = g.execute("train", {k: v.copy() for k, v in sent.items()})
    assert reply.get_return_code(ReturnCode.OK) == ReturnCode.OK, reply
    got = from_shareable(reply).data
    for k, v in sent.items():
        np.testing.assert_array_equal(got[k], v + 1)


def _memory_files(pids: list[int], at_least: int, name: str) -> dict[int, list[str]]:
    """The memory files `name*` of at least `at_least` bytes each of `pids` holds open
    or maps."""
    held: dict[int, list[str]] = {}
    for pid in pids:
        names = []
        try:
            entries = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for e in entries:
            path = f"/proc/{pid}/fd/{e}"
            try:
                if (
                    os.readlink(path).startswith(f"/memfd:{name}")
                    and os.stat(path).st_size >= at_least
                ):
                    names.append(f"fd {e}")
            except OSError:
                continue
        with open(f"/proc/{pid}/maps") as f:
            names += [
                line.split()[5]
                for line in f
                if f"/memfd:{name}" in line and _span(line) >= at_least
            ]
        if names:
            held[pid] = names
    return held


def _file_sizes(pid: int, name: str) -> dict[int, int]:
    """The memory files `name*` `pid` holds open: their inodes and sizes."""
    out: dict[int, int] = {}
    for e in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{e}"
        try:
            if os.readlink(path).startswith(f"/memfd:{name}"):
                st = os.stat(path)
                out[st.st_ino] = st.st_size
        except OSError:
            continue
    return out


def _span(line: str) -> int:
    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    return hi - lo


def test_a_large_input_is_let_go_once_rank_0_has_it(tmp_path, groups):
    # 320 MiB (over the 64 MiB that ranks hold until they answer): once rank 0 has its
    # own copy, no process of the site holds the memory file it came in, so the script's
    # result is the model's second copy, not its third.
    g = groups(tmp_path, DTYPES)
    (g.marks / "hold").write_text("")
    arrays = {f"h.{i}.w": np.full(20 << 20, i, dtype=np.float32) for i in range(4)}
    shareable = DXO(DataKind.WEIGHTS, data=arrays).to_shareable()
    del arrays
    t, replies = _execute_in_thread(g, shareable)
    try:
        assert wait_until(lambda: (g.marks / "received").exists(), timeout=CAP_S)
        # The input's memory files (staged by the host): once rank 0 has its copy (in
        # files of its own), neither the host nor the other rank holds them.
        others = [os.getpid(), *g.pids[1:]]
        assert wait_until(lambda: not _memory_files(others, 64 << 20, "rankexec"), 30), (
            f"still held: {_memory_files(others, 64 << 20, 'rankexec')}"
        )
        # Rank 0's own copy, one file per part of the model (4 x 80 MiB).
        own = _file_sizes(g.pids[0], "rankexec-py-blob")
        assert sum(own.values()) >= 320 << 20 and len(own) == 4, own
    finally:
        (g.marks / "go").write_text("")
        t.join(CAP_S)
    assert replies and replies[0].get_return_code(ReturnCode.OK) == ReturnCode.OK
    assert float(from_shareable(replies[0]).data["h.3.w"][0]) == 4.0


TORCH_IN_PLACE = (
    PREAMBLE
    + """
    import torch
    flare.init()
    while flare.is_running():
        m = flare.receive()
        if m is None:   # a rank that does not receive (FLARE's semantics)
            continue
        for v in m.params.values():
            v.add_(1)  # in place: the tensors rank 0 received are the ones it sends
        flare.send(FLModel(params=m.params))
        for v in m.params.values() if m.params else ():
            v.add_(100)  # after send: private to this rank, the sent model is sealed
"""
)


def test_rank_0_sends_its_updated_params_without_a_copy(tmp_path, groups):
    g = groups(
        tmp_path,
        TORCH_IN_PLACE,
        params_exchange_format="pytorch",
        server_expected_format="pytorch",
    )
    sent = {f"h.{i}.w": torch.full((512, 512), float(i), dtype=torch.bfloat16) for i in range(8)}
    reply = g.execute("train", {k: v.clone() for k, v in sent.items()})
    assert reply.get_return_code(ReturnCode.OK) == ReturnCode.OK, reply
    got = from_shareable(reply).data
    for k, v in sent.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v + 1), k
        # The host maps rank 0's own params file (the one it received into), sealed.
        where = _mapped_from_memfd(got[k].data_ptr())
        assert where is not None and "rankexec-py-blob" in where, (k, where)


USER_IN_PLACE = (
    PREAMBLE
    + """
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    flare.init()

    def wait_for(name):
        while not os.path.exists(os.path.join(args.marks, name)):
            time.sleep(0.01)

    while True:     # the issue's user script (benchmarks/flare/inplace_client.py)
        go = [rank == 0 and flare.is_running()]
        dist.broadcast_object_list(go, src=0)   # the other rank waits here, in gloo
        if not go[0]:
            break
        if rank == 0:
            m = flare.receive()
            for t in m.params.values():
                t.add_(1)   # in place; the loop variable `t` outlives the loop
            flare.send(m)   # the received FLModel itself
            mark("sent")
            wait_for("go")
        dist.barrier()
    dist.destroy_process_group()
"""
)


def test_after_send_the_site_holds_what_the_script_still_references(tmp_path, groups):
    # The plain in-place script (rank 0 sends the received FLModel back and keeps
    # a loop variable; the other rank waits, not in flare): once the result is back,
    # the other rank holds nothing of the input, and rank 0 only the part of its own
    # copy that its leftover tensor is in (one 64 MiB part of 256 MiB), not the model.
    g = groups(
        tmp_path,
        USER_IN_PLACE,
        params_exchange_format="pytorch",
        server_expected_format="pytorch",
    )
    sent = {f"h.{i}.w": torch.full((16 << 20,), float(i)) for i in range(4)}
    reply = g.execute("train", {k: v.clone() for k, v in sent.items()})
    try:
        assert reply.get_return_code(ReturnCode.OK) == ReturnCode.OK, reply
        got = from_shareable(reply).data
        for k, v in sent.items():
            assert torch.equal(got[k], v + 1), k
        del got, reply
        assert wait_until(lambda: (g.marks / "sent").exists(), timeout=CAP_S)
        # The other rank answered its part at once: it holds no memory file (the
        # input's included), though it never called flare since.
        assert wait_until(lambda: not _memory_files([g.pids[1]], 1 << 20, "rankexec"), 30), (
            f"the other rank holds {_memory_files([g.pids[1]], 1 << 20, 'rankexec')}"
        )

        # Rank 0: only the file of the part `t` is in (64 MiB), not the model's 256 MiB.
        def own() -> int:
            return sum(n for n in _file_sizes(g.pids[0], "rankexec").values() if n >= 1 << 20)

        assert wait_until(lambda: own() <= 64 << 20, 30), f"rank 0 holds {own()} bytes"
        assert own() == 64 << 20, "the part `t` is in stays (the script still uses it)"
    finally:
        (g.marks / "go").write_text("")
