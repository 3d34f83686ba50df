"""FLARE's task tensors downloaded straight into memory files
(``rankexec.flare._download``), fed by FLARE's own producer (``TensorDownloadable``,
what a server's ``TensorDecomposer`` serves) through ``CacheableObject.produce``.

What the OS says is what is checked: each tensor is a mapping of a sealed memory file
(``/proc/self/maps``, ``F_GET_SEALS``), a written page makes a tensor no longer
count as its file, and the files go with the tensors. The whole way, FLARE's
download in the real ``nvflare simulator`` included, is
``test_large_model_example.py`` (its site log names the bytes that arrived in memory
files, and the server's model is exact).
"""

from __future__ import annotations

import fcntl
import gc
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from nvflare.app_opt.pt.decomposers import TensorDecomposer
from nvflare.app_opt.pt.tensor_downloader import TensorDownloadable
from nvflare.fuel.utils import fobs
from nvflare.fuel.utils.fobs import dots

from rankexec.flare import _download
from rankexec.flare._download import MemoryFileConsumer, sealed_slice

from .flare_helpers import wait_until

F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_WRITE = 0x0008


def download(tensors: dict) -> MemoryFileConsumer:
    """FLARE's producer serves ``tensors`` to one receiver, request by request, as its
    download service does; the consumer takes each reply."""
    served = TensorDownloadable(tensors, 2 << 20)
    served.num_receivers = 1
    consumer = MemoryFileConsumer()
    state: dict = {}
    while True:
        rc, data, state = served.produce(state, "site-1")
        if data is None:
            assert rc == "eof", rc
            break
        consumer.consume("ref", state, data)
    consumer.download_completed("ref")
    return consumer


def memfd_inodes() -> dict[int, str]:
    """The inodes of the memory files this process maps, and their lines."""
    out = {}
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:" in line:
                out[int(line.split()[4])] = line
    return out


def open_memfd_inodes() -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/memfd:"):
                out.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            continue
    return out


def mapping_of(address: int) -> int | None:
    """The inode of the memory file mapped at ``address``, if one is."""
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:" not in line:
                continue
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return int(line.split()[4])
    return None


def test_flares_items_arrive_in_sealed_memory_files_and_read_as_sent():
    sent = {
        "T0": torch.randn(1000, 300),
        "T1": torch.randn(50, 7).to(torch.bfloat16),
        "T2": torch.arange(10),
        "T3": torch.zeros(0, 3),
        "T4": torch.tensor(3.5),
        "T5": torch.rand(64) > 0.5,
        "T6": torch.randn(3 << 20).to(torch.float16),
    }
    got = download(sent).result
    assert set(got) == set(sent)
    for key, t in sent.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        assert torch.equal(got[key], t), key
        if t.numel() == 0:
            assert sealed_slice(got[key]) is None
            continue
        blob = sealed_slice(got[key])
        assert blob is not None, key
        # The tensor is a mapping of that very file, and the file is sealed.
        assert mapping_of(got[key].data_ptr()) == blob.inode, key
        assert fcntl.fcntl(blob.fileno, F_GET_SEALS) & F_SEAL_WRITE, key
        assert blob.offset % os.sysconf("SC_PAGE_SIZE") == 0
        assert bytes(blob) == t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(), key


def test_a_written_tensor_is_sent_as_it_is_now_not_as_its_file():
    sent = {"a": torch.randn(1 << 20), "b": torch.randn(1 << 20)}
    got = download(sent).result
    file_before = bytes(sealed_slice(got["a"]))
    got["a"][12345] = 7.0  # one page copied, privately
    assert sealed_slice(got["a"]) is None
    assert sealed_slice(got["b"]) is not None
    assert float(got["a"][12345]) == 7.0
    # The file did not change: a copy-on-write mapping.
    other = download({"a": sent["a"]}).result
    assert bytes(sealed_slice(other["a"])) == file_before
    # A view of part of a tensor, or a copy, is not its file either.
    assert sealed_slice(got["b"][:10]) is None
    assert sealed_slice(got["b"].clone()) is None


def test_a_large_download_comes_in_parts_that_go_with_their_tensors():
    before = set(memfd_inodes()) | open_memfd_inodes()
    sent = {f"T{i}": torch.full((5 << 18,), float(i)) for i in range(60)}  # 60 x 5 MiB
    consumer = download(sent)
    got = consumer.result
    inodes = {sealed_slice(t).inode for t in got.values()}
    # 300 MiB: parts of at least 64 MiB, each at least half of what came before.
    assert 3 <= len(inodes) <= 5, inodes
    assert consumer.in_files == 300 << 20
    sizes = sorted(os.fstat(sealed_slice(t).fileno).st_size for t in got.values())
    assert sizes[0] >= _download.PART_LEAST
    held = (set(memfd_inodes()) | open_memfd_inodes()) - before
    assert inodes <= held
    del got, consumer, sizes
    gc.collect()

    def left() -> set[int]:
        return (set(memfd_inodes()) | open_memfd_inodes()) & inodes

    # A large mapping is unmapped on the extension's `unmap` thread, moments later.
    assert wait_until(lambda: not left(), 10), f"still mapped or open 10 s on: {left()}"


def test_a_malformed_item_fails_the_download_and_leaves_no_file():
    before = set(memfd_inodes()) | open_memfd_inodes()
    served = TensorDownloadable({"x": torch.randn(1 << 20), "y": torch.randn(1 << 20)}, 2 << 20)
    served.num_receivers = 1
    consumer = MemoryFileConsumer()
    _, data, state = served.produce({}, "site-1")
    consumer.consume("ref", state, data)  # the first tensor is in a file now
    _, data, state = served.produce(state, "site-1")
    truncated = [bytes(data[0])[:-16]]
    with pytest.raises(ValueError, match="'y'.*do not hold its shape"):
        consumer.consume("ref", state, truncated)
    consumer.download_failed("ref", "the consumer raised")
    assert consumer.error == "the consumer raised" and consumer.result is None
    gc.collect()
    assert (set(memfd_inodes()) | open_memfd_inodes()) - before == set()


def test_install_makes_flares_own_decomposer_download_into_files_until_the_last_uninstall():
    fobs.register(TensorDecomposer)
    handler = fobs.get_dot_handler(dots.TENSOR_DOWNLOAD)
    assert isinstance(handler, TensorDecomposer)
    assert not _download.installed()
    assert _download.install() and _download.install()
    assert "download" in vars(handler) and _download.installed()
    assert handler.to_downloadable is _download._lean
    assert handler.download.rankexec_original.__func__ is TensorDecomposer.download
    _download.uninstall()
    assert _download.installed()  # one user left
    _download.uninstall()
    assert not _download.installed() and "download" not in vars(handler)
    assert "to_downloadable" not in vars(handler)
    _download.uninstall()  # one too many: nothing to undo
    assert not _download.installed()


def test_a_result_is_served_as_the_same_items_flare_would_serve():
    from nvflare.app_opt.pt.tensor_downloader import TensorConsumer

    sent = {
        "a": torch.randn(300, 7),
        "b": torch.zeros(5, dtype=torch.bfloat16),
        "c": torch.tensor(2.5),
        "d": torch.zeros(0, 2),
        "e": torch.arange(12).reshape(3, 4).t(),  # not contiguous
        "f": torch.rand(9) > 0.5,
    }
    lean = _download.LeanTensorDownloadable(sent, 2 << 20)
    flares = TensorDownloadable({k: v.contiguous() for k, v in sent.items()}, 2 << 20)
    for i in range(len(sent)):
        assert lean.produce_item(i) == flares.produce_item(i), list(sent)[i]
    lean.prefetch_item(1)
    assert lean._prefetch_futures == {}  # nothing is built ahead of its request
    # FLARE's own consumer (the server's) decodes them.
    consumer = TensorConsumer(None, {})
    got = consumer.consume_items([lean.produce_item(i) for i in range(len(sent))], None)
    for key, t in sent.items():
        assert torch.equal(got[key], t), key


def test_serving_a_result_collects_flares_sent_messages_as_it_goes(monkeypatch):
    # FLARE keeps each sent message in reference cycles until a full collection: the
    # producer runs one (and trims the C heap) every _COLLECT_EVERY bytes served.
    calls = []
    monkeypatch.setattr(_download, "_COLLECT_EVERY", 3 << 20)
    monkeypatch.setattr(_download.gc, "collect", lambda *a: calls.append(a) or 0)
    sent = {f"t{i}": torch.zeros(1 << 18) for i in range(7)}  # 1 MiB each
    lean = _download.LeanTensorDownloadable(sent, 2 << 20)
    for i in range(len(sent)):
        lean.produce_item(i)
    assert calls == [(), ()], calls  # full collections, after 3 and 6 MiB served


def _echoed(tensors: dict, tmp_path) -> tuple[dict, dict]:
    """``tensors`` through a group of one Rust rank that returns its input: (the
    host's tensors of the result, as ``ScriptExecutor`` makes them, and its blobs)."""
    from rankexec.flare.arrays import pack_flat, unpack_flat
    from rankexec.host import RankGroup

    from .flare_helpers import worker_program

    blobs, specs, _ = pack_flat(tensors, "params")
    cfg = {
        "executor_id": "t",
        "num_of_processes": 1,
        "components": [{"id": "t", "path": "Echo"}],
        "worker": {"program": worker_program()},
        "log_dir": str(tmp_path),
        "gpu": {"mode": "none"},
    }
    with RankGroup(cfg, workspace=str(tmp_path)) as g:
        result = g.execute("train", {}, blobs)
    params = unpack_flat(result.blobs, specs, writable=False)
    return params, result.blobs


def test_a_results_tensors_are_served_from_their_memory_files(tmp_path, monkeypatch):
    # rank 0's result, in memory files: each item is its header, then the file's own
    # pages (HostBlob.prefixed), byte for byte what FLARE's producer would build.
    from nvflare.app_opt.pt.tensor_downloader import TensorConsumer

    monkeypatch.setattr(_download, "_VIEW_FROM", 2 << 20)  # 1 MiB: tensors this small
    sent = {
        "w": torch.randn(1 << 20),  # 4 MiB
        "h": torch.arange(3 << 19, dtype=torch.float32).to(torch.bfloat16).reshape(3, -1),
        "mid": torch.randn(1 << 18),  # 1 MiB, in a memory file, under _VIEW_FROM: copied
        "tiny": torch.ones(3),  # sent inline by the core: built with a copy
    }
    params, blobs = _echoed(sent, tmp_path)
    assert _download.remember_result(params, blobs) == 3
    names = ("w", "h", "mid", "tiny")
    keys = {f"T{i}": params[name] for i, name in enumerate(names)}  # FLARE's ids
    lean = _download.LeanTensorDownloadable(keys, 2 << 20)
    flares = TensorDownloadable({k: v.clone() for k, v in keys.items()}, 2 << 20)
    items = [lean.produce_item(i) for i in range(len(keys))]
    for i, item in enumerate(items):
        assert bytes(item) == flares.produce_item(i), i
    assert [type(i).__name__ for i in items] == ["memoryview", "memoryview", "bytes", "bytes"]
    assert (lean.in_place, lean.copied) == (2, 2)
    # FLARE packs items under its datum size into its messages (a copy it keeps until a
    # collection): those count toward the next collection, served in place or not.
    assert lean._served == sum(len(i) for i in items)
    for item, name in zip(items[:2], ("w", "h"), strict=True):
        # The tensor's bytes in the item are a mapping of the result's memory file.
        data = np.frombuffer(item, dtype=np.uint8)[item.nbytes - len(blobs[name]) :]
        assert mapping_of(data.ctypes.data) == os.fstat(blobs[name].fileno).st_ino, name
    # The server gets the items as bytes (FLARE sends a buffer as a datum).
    got = TensorConsumer(None, {}).consume_items([bytes(i) for i in items], None)
    for key, t in keys.items():
        assert torch.equal(got[key], t), key
    with pytest.raises(ValueError, match="longer than a page"):
        blobs["w"].prefixed(b" " * (os.sysconf("SC_PAGE_SIZE") + 1))
    with pytest.raises(ValueError, match="not in a memory file"):
        blobs["tiny"].prefixed(b"")


def test_a_results_tensor_written_on_the_host_is_served_as_it_is_now(tmp_path):
    params, blobs = _echoed({"w": torch.zeros(1 << 20)}, tmp_path)
    _download.remember_result(params, blobs)
    params["w"][-1] = 7.0  # a filter's write: a private page of the host's mapping
    lean = _download.LeanTensorDownloadable({"T0": params["w"]}, 2 << 20)
    item = lean.produce_item(0)
    assert isinstance(item, bytes) and (lean.in_place, lean.copied) == (0, 1)
    got = _download.load_tensors(item)["T0"]
    assert got[-1].item() == 7.0 and not got[:-1].any()


def test_a_served_result_lets_go_of_its_memory_files_once_released(tmp_path, monkeypatch):
    # What FLARE kept of the items (the views of the memory files) goes when the upload
    # is released: the result's file is no longer mapped or open in this process.
    monkeypatch.setattr(_download, "_COLLECT_AFTER", 16 << 20)
    params, blobs = _echoed({"w": torch.randn(4 << 20)}, tmp_path)  # 16 MiB
    inode = os.fstat(blobs["w"].fileno).st_ino
    _download.remember_result(params, blobs)
    lean = _download.LeanTensorDownloadable({"T0": params["w"]}, 2 << 20)
    lean.num_receivers = 1
    state: dict = {}
    kept = []
    while True:
        _rc, data, state = lean.produce(state, "server")
        if data is None:
            break
        kept.append([data, kept])  # a reference cycle, as FLARE's streaming makes
    assert lean.in_place == 1
    assert lean._served == 0  # 16 MiB: a datum of its own, FLARE copies nothing
    assert inode in memfd_inodes()
    del data, kept, params, blobs
    lean.release()
    assert wait_until(
        lambda: inode not in memfd_inodes() and inode not in open_memfd_inodes(), 10
    ), memfd_inodes().get(inode)


def test_a_small_upload_is_released_without_a_collection(monkeypatch):
    # A full collection holds the GIL for 100-200 ms on FLARE's callback thread: only
    # an upload of _COLLECT_AFTER bytes or more pays it.
    calls = []
    monkeypatch.setattr(_download.gc, "collect", lambda *a: calls.append(a) or 0)
    lean = _download.LeanTensorDownloadable({"T0": torch.zeros(1 << 10)}, 2 << 20)
    lean.produce_item(0)
    lean.release()
    assert calls == []
    monkeypatch.setattr(_download, "_COLLECT_AFTER", 1)
    lean = _download.LeanTensorDownloadable({"T0": torch.zeros(1 << 10)}, 2 << 20)
    lean.produce_item(0)
    lean.release()
    assert calls == [()]


def test_a_dtype_not_known_here_is_decoded_by_safetensors_into_the_heap():
    # complex64: safetensors knows it, this module does not map it.
    sent = {"z": torch.randn(64, dtype=torch.complex64), "w": torch.randn(1 << 16)}
    consumer = download(sent)
    got = consumer.result
    assert torch.equal(got["z"], sent["z"]) and torch.equal(got["w"], sent["w"])
    assert sealed_slice(got["z"]) is None  # in the heap: staged as before
    assert mapping_of(got["z"].data_ptr()) is None
    assert sealed_slice(got["w"]) is not None
    assert consumer.in_files == sent["w"].numel() * 4


def test_a_site_that_chose_flares_disk_offload_keeps_flares_own_download():
    calls = []

    def flares_own(**kw):
        calls.append(kw)
        return None, {"from": "flare"}

    class Cell:
        def __init__(self, ctx):
            self.ctx = ctx

        def get_fobs_context(self):
            return self.ctx

    download_with = _download._into_files(flares_own)
    offload = fobs.FOBSContextKey.TENSOR_DISK_OFFLOAD
    # Set on the cell (the site's choice), or for this message: FLARE's consumer.
    for cell_ctx, msg_ctx in (({offload: True}, None), ({}, {offload: True})):
        err, items = download_with(
            from_fqcn="server",
            ref_id="r",
            per_request_timeout=1.0,
            cell=Cell(cell_ctx),
            fobs_ctx=msg_ctx,
        )
        assert (err, items) == (None, {"from": "flare"})
    assert [c["ref_id"] for c in calls] == ["r", "r"]
