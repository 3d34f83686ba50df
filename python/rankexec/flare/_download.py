"""FLARE's task tensors written straight into memory files as they are downloaded.

FLARE 2.9 sends a task's torch tensors by reference: the job process downloads them
from the server one tensor at a time (``TensorDecomposer``, one safetensors item per
tensor), and its ``TensorConsumer`` decodes each item into a tensor of its own heap. A
rank group then needs that model in shared memory: a second copy (the staging of
``ScriptExecutor``), and for that time the model twice on the site.

``install()`` (``ScriptExecutor`` calls it at START_RUN) has FLARE's registered
tensor decomposer download with ``MemoryFileConsumer`` instead: each item's bytes are
written (``pwrite``) to a page-aligned place in a memory file as it arrives and the
item is let go, so FLARE's decoded copy never exists; the files are sealed when the
download ends. FLARE, and anything else in this process that reads the task, gets
ordinary writable tensors: copy-on-write mappings of those files (a write copies the
page it touches, privately; the file does not change). ``sealed_slice(tensor)`` then
gives the executor the sealed file's slice under a tensor that still shows exactly
what was downloaded (no page of it written: the kernel's page map says so), which the
ranks are sent as it is: no staging copy. A tensor that was written to, or that is not
one of these, is staged as before.

The files are parts of at least 64 MiB, each new one at least a sixth of what came
before (a model of 14 GB arrives in about 30 files, under the 64 descriptors a frame
may pass), so that rank 0, which takes its own copy, lets go of the input one part at
a time and holds at most a seventh of the model twice.

A result goes back through FLARE's download service, which the server pulls from,
one tensor an item (a safetensors file of one tensor: its header, then its bytes).
``remember_result`` marks the tensors ``ScriptExecutor`` made from the ranks' result
(copy-on-write mappings of rank 0's sealed memory files); ``LeanTensorDownloadable``
serves such a tensor of 1 MiB and up, while no page of it was written, as its header
and the memory file's own pages in one read-only buffer (``HostBlob.prefixed``): no
copy in the job process for one of 10 MiB and up, which FLARE sends as a datum of its
own, by reference; FLARE packs a smaller one into its message, its one copy. Any other
tensor is built with one copy, none ahead of its request. FLARE's streaming keeps what
it sent in reference cycles that only a full collection frees: every 128 MiB copied
(by us or into FLARE's messages), and once an upload of 64 MiB or more is over
(``release``), the garbage collector runs and the C heap is trimmed (without it a 1 GiB result left about one
more model in the job process until the next task; BENCHMARKS.md, "FLARE's download
into memory files", "A result served from its memory files").

Caveats: only tensors (``TENSOR_DOWNLOAD``); numpy arrays are decoded by FLARE as
before. An item served without a copy is a read-only buffer (a ``memoryview``), not
``bytes``: FLARE's messaging sends any buffer as a datum and the receiver gets bytes, but
code that called ``produce_item`` itself and wanted ``bytes`` would have to copy. The tensors' storage is a mapping (``torch.frombuffer``): writable, but it
cannot be resized (``resize_`` raises; FLARE's own tensors could be), and this holds
for every task tensor the job process downloads while ``install`` is in effect, other
executors' included. A site that set FLARE's tensor disk offload keeps it (FLARE's own consumer).
An item in a dtype this module does not know is decoded by safetensors into the heap,
as FLARE does, and staged. ``install`` sets the ``download`` attribute of FLARE's one
registered ``TensorDecomposer`` instance (FLARE 2.9 offers no other way to choose a
download's consumer); ``uninstall`` removes it when the last user is done.
"""

from __future__ import annotations

import gc
import json
import logging
import mmap
import struct
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch
from nvflare.app_opt.pt.tensor_downloader import TensorDownloadable
from nvflare.fuel.f3.streaming.cacheable import ItemConsumer
from nvflare.fuel.f3.streaming.download_service import download_object
from nvflare.fuel.utils import fobs
from nvflare.fuel.utils.fobs import dots
from nvflare.fuel.utils.fobs.datum import TEN_MEGA
from safetensors.torch import load as load_tensors

from rankexec._rankexec import SharedBuffer, trim_heap

__all__ = [
    "LeanTensorDownloadable",
    "MemoryFileConsumer",
    "install",
    "installed",
    "remember_result",
    "sealed_slice",
    "uninstall",
]

_PAGE = mmap.PAGESIZE
#: The least size of a part (its memory file).
PART_LEAST = 64 << 20
#: A new part holds at least this fraction of what came before: a model of N bytes
#: arrives in about 8 + 6.5 ln(N / 512 MiB) parts (1 GiB: 14, 14 GB: 30, 100 GB: 42;
#: a frame passes at most 64 descriptors), the largest a seventh of the model (what
#: rank 0's copy, which lets go of one part at a time, holds twice at worst).
_GROWTH = 6
#: Bytes let go between two trims of the C heap (items under glibc's mmap threshold).
_TRIM_EVERY = 64 << 20
_COLLECT_EVERY = 128 << 20
#: The least tensor served from its memory file (a smaller one is built with a copy: the
#: mapping would cost more than the copy saves).
_VIEW_FROM = 1 << 20
#: FLARE sends a buffer of this size and up as a datum of its own, by reference; it
#: packs a smaller one into its message's body: a copy, which it keeps until a
#: collection as it keeps the message.
_DATUM_FROM = TEN_MEGA
#: The least upload after which ``release`` collects (a small one leaves little).
_COLLECT_AFTER = 64 << 20
_log = logging.getLogger(__name__)

# safetensors' dtype names (what FLARE's items carry) and torch's.
_DTYPES: dict[str, Any] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


def _round_up(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


# ---- where a downloaded tensor's bytes are --------------------------------------------

# data_ptr -> (a weak reference to the tensor made there, the sealed slice under it).
# An entry counts only while that tensor lives: its mapping, and so the address, is
# still this file's.
_ORIGIN: dict[int, tuple[weakref.ref, Any]] = {}
_ORIGIN_LOCK = threading.Lock()


def _remember(t: torch.Tensor, sealed: Any) -> None:
    ptr = t.data_ptr()
    entry = (weakref.ref(t), sealed)
    with _ORIGIN_LOCK:
        _ORIGIN[ptr] = entry

    def forget() -> None:
        with _ORIGIN_LOCK:
            if _ORIGIN.get(ptr) is entry:
                del _ORIGIN[ptr]

    weakref.finalize(t, forget)


def _written(address: int, nbytes: int) -> bool:
    """Whether any page of ``[address, address + nbytes)`` of a copy-on-write mapping
    was written (it is then a private, anonymous page, or swapped out) or cannot be
    told (no page map): the kernel's page map, 8 bytes a page."""
    if nbytes == 0:
        return False
    first, last = address // _PAGE, (address + nbytes - 1) // _PAGE
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            f.seek(first * 8)
            raw = f.read((last - first + 1) * 8)
    except OSError:
        return True
    if len(raw) != (last - first + 1) * 8:
        return True
    entries = np.frombuffer(raw, dtype=np.uint64)
    present = (entries >> np.uint64(63)) & np.uint64(1)
    swapped = (entries >> np.uint64(62)) & np.uint64(1)
    file_page = (entries >> np.uint64(61)) & np.uint64(1)
    return bool(np.any(swapped) or np.any(present & (file_page ^ np.uint64(1))))


def remember_result(params: Any, blobs: Any) -> int:
    """Marks each tensor of ``params`` made from the blob of the same name (a
    ``HostBlob`` of the ranks' result, in a memory file, the tensor its copy-on-write
    mapping): ``sealed_slice`` finds the blob under it and the upload serves it
    without a copy. Returns how many were marked."""
    if not isinstance(params, dict):
        return 0
    marked = 0
    for name, value in params.items():
        blob = blobs.get(name)
        if (
            isinstance(value, torch.Tensor)
            and value.device.type == "cpu"
            and value.is_contiguous()
            and getattr(blob, "fileno", None) is not None
            and hasattr(blob, "prefixed")
            and value.numel() * value.element_size() == len(blob)
        ):
            _remember(value, blob)
            marked += 1
    return marked


def sealed_slice(value: Any) -> Any | None:
    """The sealed memory file's slice (a ``rankexec.Blob``, or the ``HostBlob`` of a
    result) that ``value`` shows unchanged, when ``value`` is a CPU tensor this module
    downloaded or ``remember_result`` marked (or a contiguous view of all of one) and
    no page of it was written since; else None."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return None
    if not value.is_contiguous():
        return None
    ptr = value.data_ptr()
    with _ORIGIN_LOCK:
        entry = _ORIGIN.get(ptr)
    if entry is None:
        return None
    ref, sealed = entry
    original = ref()
    if original is None or original.data_ptr() != ptr:
        return None
    nbytes = value.numel() * value.element_size()
    if nbytes != len(sealed) or _written(ptr, nbytes):
        return None
    return sealed


# ---- the consumer -------------------------------------------------------------------------


class _Part:
    """One memory file being filled: its buffer, capacity, and what it holds."""

    def __init__(self, capacity: int) -> None:
        self.buf = SharedBuffer(capacity)
        self.capacity = capacity
        self.filled = 0
        # (key, offset, nbytes, dtype, shape)
        self.items: list[tuple[str, int, int, Any, list[int]]] = []


def _header(item: Any) -> tuple[dict[str, Any], int]:
    """A safetensors item's header and where its data starts."""
    view = memoryview(item)
    if view.nbytes < 8:
        raise ValueError("a tensor item of fewer than 8 bytes")
    (n,) = struct.unpack("<Q", view[:8])
    if n == 0 or 8 + n > view.nbytes:
        raise ValueError(f"a tensor item whose header of {n} bytes overruns its {view.nbytes}")
    header = json.loads(bytes(view[8 : 8 + n]))
    if not isinstance(header, dict):
        raise TypeError("a tensor item whose header is not a JSON object")
    return header, 8 + n


class MemoryFileConsumer(ItemConsumer):
    """FLARE's ``TensorConsumer`` in memory files: each item's tensors are written to
    a part (see the module docs) as they arrive; ``download_completed`` seals the
    parts and makes ``result`` a dict of copy-on-write tensors over them."""

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[_Part] = []
        self._written = 0
        self._heap: dict[str, Any] = {}  # items of a dtype not known here
        self._since_trim = 0
        self.in_files = 0  # bytes written to memory files

    def _place(self, nbytes: int) -> tuple[_Part, int]:
        part = self._parts[-1] if self._parts else None
        if part is None or _round_up(part.filled) + nbytes > part.capacity:
            capacity = _round_up(max(PART_LEAST, self._written // _GROWTH, nbytes))
            part = _Part(capacity)
            self._parts.append(part)
        at = _round_up(part.filled)
        part.filled = at + nbytes
        self._written += nbytes
        return part, at

    def consume_items(self, items: list[Any], result: Any) -> Any:
        if not isinstance(items, list):
            raise TypeError(f"items must be list but got {type(items)}")
        for item in items:
            header, start = _header(item)
            specs = {k: v for k, v in header.items() if k != "__metadata__"}
            if any(_DTYPES.get(spec.get("dtype")) is None for spec in specs.values()):
                # A dtype not known here: safetensors decodes it into the heap, as
                # FLARE's own consumer does; it is staged as before.
                self._heap.update(load_tensors(bytes(item)))
                continue
            with memoryview(item) as view:
                for key, spec in specs.items():
                    dtype = _DTYPES[spec["dtype"]]
                    shape = [int(d) for d in spec.get("shape") or []]
                    begin, end = (int(x) for x in spec["data_offsets"])
                    nbytes = end - begin
                    size = torch.empty((), dtype=dtype).element_size()
                    if not 0 <= begin <= end <= view.nbytes - start or nbytes != (
                        int(np.prod(shape, dtype=np.int64)) * size
                    ):
                        raise ValueError(
                            f"tensor {key!r}: data offsets {begin}..{end} do not hold its "
                            f"shape {shape} of {spec['dtype']} within its item"
                        )
                    part, at = self._place(nbytes)
                    if nbytes:
                        part.buf.write_at(at, view[start + begin : start + end])
                    part.items.append((key, at, nbytes, dtype, shape))
                    self.in_files += nbytes
                self._since_trim += view.nbytes
        items.clear()  # the items' bytes go now, not with the next request
        if self._since_trim >= _TRIM_EVERY:
            trim_heap()
            self._since_trim = 0
        return result

    def download_completed(self, ref_id: str) -> None:
        super().download_completed(ref_id)
        out: dict[str, Any] = {}
        for part in self._parts:
            sealed = part.buf.seal()
            cow = sealed.copy_on_write()
            for key, at, nbytes, dtype, shape in part.items:
                if nbytes == 0:
                    out[key] = torch.empty(shape, dtype=dtype)
                    continue
                numel = nbytes // torch.empty((), dtype=dtype).element_size()
                t = torch.frombuffer(cow, dtype=dtype, count=numel, offset=at).view(shape)
                # torch.frombuffer keeps ``cow`` (the mapping) alive with the tensor.
                _remember(t, sealed.slice(at, nbytes))
                out[key] = t
        out.update(self._heap)
        self._parts, self._heap = [], {}
        trim_heap()
        self.result = out

    def download_failed(self, ref_id: str, reason: str) -> None:
        # What was written goes with the buffers.
        self._parts, self._heap = [], {}
        super().download_failed(ref_id, reason)


# ---- the producer of a result --------------------------------------------------------------

_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _item_header(key: str, t: torch.Tensor) -> bytes:
    """What comes before ``t``'s bytes in a safetensors item of one tensor, as
    ``safetensors.torch.save({key: t})`` makes it: the header's length, the header."""
    nbytes = t.numel() * t.element_size()
    spec = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [0, nbytes]}
    header = json.dumps({key: spec}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def _item_of(key: str, t: torch.Tensor) -> bytes:
    """``t`` as a safetensors item of one tensor, built with one copy of its bytes."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    head = _item_header(key, t)
    if t.numel() == 0:
        return head
    return b"".join((head, t.reshape(-1).view(torch.uint8).numpy().data))


def _item_in_place(key: str, t: torch.Tensor) -> memoryview | None:
    """``t`` as a safetensors item without a copy: its header, then the pages of the
    result's memory file under it (``HostBlob.prefixed``), when ``t`` is a tensor of at
    least ``_VIEW_FROM`` bytes that ``remember_result`` marked and no page of it was
    written; else None."""
    if t.numel() * t.element_size() < _VIEW_FROM:
        return None
    blob = sealed_slice(t)
    prefixed = getattr(blob, "prefixed", None)
    if prefixed is None:
        return None
    try:
        return memoryview(prefixed(_item_header(key, t)))
    except (ValueError, OSError) as e:  # a header over a page, a file not sealed
        _log.debug("item %s is copied: %s", key, e)
        return None


class LeanTensorDownloadable(TensorDownloadable):
    """FLARE's ``TensorDownloadable`` (what the server downloads a result from): a
    tensor of the ranks' result is served from its memory file (``_item_in_place``),
    any other built with one copy (``_item_of``; safetensors' ``save`` makes two), none
    ahead of its request (FLARE's prefetch holds one more item while the one before is
    sent). The items are the same bytes FLARE's would be, so the server decodes them
    with its own consumer."""

    def __init__(self, tensors: dict[str, Any], max_chunk_size: int) -> None:
        super().__init__(tensors, max_chunk_size)
        self._served = 0  # bytes copied since the last collection
        # Items, and their bytes, served from memory files and built with a copy.
        self.in_place = self.in_place_bytes = self.copied = self.copied_bytes = 0

    def release(self) -> None:
        # The upload is over: what FLARE kept of the items (reference cycles holding
        # them, or the memory files' views) goes now, not at some later collection.
        # Called on one of FLARE's threads, with none of its locks held.
        super().release()
        collected = ""
        if self.in_place_bytes + self.copied_bytes >= _COLLECT_AFTER:
            t0 = time.perf_counter()
            gc.collect()
            trim_heap()
            collected = f"; collected in {(time.perf_counter() - t0) * 1e3:.0f} ms"
        _log.info(
            "result served: %d items (%.1f MiB) from memory files, %d (%.1f MiB) copied%s",
            self.in_place,
            self.in_place_bytes / (1 << 20),
            self.copied,
            self.copied_bytes / (1 << 20),
            collected,
        )

    def produce_item(self, index: int) -> bytes:
        key = self.keys[index]
        base_obj = self.base_obj
        if base_obj is None:
            raise RuntimeError(f"item {index} requested after tensors were released")
        # FLARE keeps each sent message (a copy of its item) in reference cycles that
        # only a full collection frees, and its 1 MiB frames stay in glibc's per-thread
        # heaps once freed: both given back every _COLLECT_EVERY bytes served (a full
        # collection took 140-190 ms in a job process with torch loaded).
        if self._served >= _COLLECT_EVERY:
            t0 = time.perf_counter()
            gc.collect()
            trim_heap()
            self._served = 0
            _log.debug("collected in %.0f ms", (time.perf_counter() - t0) * 1e3)
        tensor = base_obj[key]
        if isinstance(tensor, torch.Tensor) and tensor.dtype in _NAMES:
            view = _item_in_place(key, tensor)
            if view is not None:
                self.in_place += 1
                self.in_place_bytes += view.nbytes
                if view.nbytes < _DATUM_FROM:
                    self._served += view.nbytes  # FLARE's message holds a copy of it
                return view  # type: ignore[return-value]  # FLARE sends any buffer
            item = _item_of(key, tensor)
        else:
            item = super().produce_item(index)
        self.copied += 1
        self.copied_bytes += len(item)
        self._served += len(item)
        return item

    def prefetch_item(self, index: int) -> None:
        return None


# ---- FLARE's tensor decomposer, downloading into memory files ----------------------------

_LOCK = threading.Lock()
_USERS = 0


def _into_files(original: Any) -> Any:
    def download(cell: Any, fobs_ctx: dict | None = None, **transfer: Any) -> tuple[Any, Any]:
        # ``transfer``: from_fqcn, ref_id, per_request_timeout, secure, optional,
        # abort_signal, progress_cb, as FLARE passes them (by keyword).
        ctx = fobs_ctx or {}
        cell_ctx = cell.get_fobs_context() if hasattr(cell, "get_fobs_context") else {}
        offload = fobs.FOBSContextKey.TENSOR_DISK_OFFLOAD
        if ctx.get(offload, cell_ctx.get(offload, False)):
            # The site chose FLARE's disk offload: FLARE's own consumer.
            return original(cell=cell, fobs_ctx=fobs_ctx, **transfer)
        consumer = MemoryFileConsumer()
        download_object(cell=cell, consumer=consumer, **transfer)
        return consumer.error, consumer.result

    download.rankexec_original = original  # type: ignore[attr-defined]
    return download


def _lean(items: dict, max_chunk_size: int, fobs_ctx: dict) -> Any:
    return LeanTensorDownloadable(items, max_chunk_size)


def _handler() -> Any:
    from nvflare.app_opt.pt.decomposers import TensorDecomposer

    fobs.register(TensorDecomposer)
    handler = fobs.get_dot_handler(dots.TENSOR_DOWNLOAD)
    return handler if isinstance(handler, TensorDecomposer) else None


def install() -> bool:
    """Has FLARE's tensor decomposer in this process download into memory files (see
    the module docs); counted, so that each ``install`` is matched by an
    ``uninstall``. False when FLARE's registered handler is not its own
    ``TensorDecomposer`` (someone replaced it): nothing is changed then."""
    global _USERS
    with _LOCK:
        handler = _handler()
        if handler is None:
            return False
        if "download" not in vars(handler):
            handler.download = _into_files(handler.download)
            handler.to_downloadable = _lean
        _USERS += 1
        return True


def uninstall() -> None:
    """Undoes one ``install``; the last one gives FLARE its own download back."""
    global _USERS
    with _LOCK:
        if _USERS == 0:
            return
        _USERS -= 1
        if _USERS:
            return
        handler = _handler()
        if handler is not None and "download" in vars(handler):
            del handler.download
            vars(handler).pop("to_downloadable", None)


def installed() -> bool:
    """Whether FLARE's tensor decomposer downloads into memory files now."""
    with _LOCK:
        handler = _handler()
        return handler is not None and "download" in vars(handler)
