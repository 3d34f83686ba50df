"""``ndarrays`` and ``shared_array_record``: a record's arrays read and written in
shared memory, without the copies Flower's own conversions make; ``take_owned``: rank
0's own writable copy of a message's arrays (``ClientApp(arrays_to="rank0")``).

Why: on a rank, a message's ``ArrayRecord`` payloads sit in the shared memory the host
filled; Flower's ``to_numpy_ndarrays()`` copies every array, ``ndarrays`` reads the
``.npy`` header and views the bytes in place. On the way back, Flower's
``ArrayRecord(state_dict)`` serializes every tensor into new ``bytes``, which rank 0
then copies into a memory file for the node's ``ClientApp``; ``shared_array_record``
writes each tensor's ``.npy`` bytes straight into one memory file instead, which leaves
rank 0 as it is (no second copy, and nothing for the C heap to keep).

With ``arrays_to="rank0"`` rank 0 alone receives the arrays: ``take_owned`` copies the
message's memory files into files of rank 0's own, one part at a time, letting go of
each part of the input as it goes (no other process holds it then), so the node holds
the model about once. ``ndarrays(record, writable=True)`` views those files writable;
a handler that updates them in place and replies ``shared_array_record`` of the same
arrays sends the files themselves, sealed: no copy on the way out either. After that
seal rank 0's views stay valid and its later writes stay private (copy-on-write).

Caveats: views of the shared input are read-only (the memory is shared by every rank,
and a sealed file cannot change); ``writable=True`` on such an array gives a copy. An
array that is not a plain ``numpy.ndarray`` record falls back to Flower's own
``numpy()`` (a copy). ``shared_array_record`` takes what Flower's ``ArrayRecord`` takes
(a ``state_dict`` of tensors, or a list of NumPy arrays); torch's bfloat16 has no NumPy
dtype, in Flower as here, and is refused naming the key. An array of rank 0's own files
goes out without a copy only where it is still a whole array of the message (same
place, dtype and shape, C order); any other is copied as before.
"""

from __future__ import annotations

import ast
import bisect
import io
import mmap
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from rankexec._rankexec import SharedBuffer
from rankexec._staging import page_offsets, parts_of

__all__ = ["ndarrays", "release_owned", "shared_array_record", "take_owned"]

_PAGE = mmap.PAGESIZE
#: Below this many bytes in all, rank 0's own copy is private memory, not files.
OWN_FILES_FROM = 1 << 20


@dataclass
class _Own:
    """One of rank 0's own files: its buffer, its address here, and where each
    message array's ``.npy`` bytes start in it (sorted) and how long they are."""

    buf: SharedBuffer
    base: int
    starts: list[int]
    sizes: dict[int, int]


#: Rank 0's own files for the message it is handling.
_owned: list[_Own] = []


def take_owned(blobs: dict[str, Any], names: Sequence[str]) -> None:
    """Replaces each of ``blobs``' ``names`` (the message's arrays, as the host passed
    them: read-only memory files) by a writable copy of its bytes in memory files of
    this process's own, one group of ``parts_of`` at a time (each at a page boundary,
    written with ``pwrite``), dropping each input buffer as soon as it is copied: once
    the other holders have let go, the input's pages go part by part and the rank never
    holds the input and its copy in full at once. On a failure nothing is kept."""
    sizes = {n: len(memoryview(blobs[n]).cast("B")) for n in names if n in blobs}
    if sum(sizes.values()) < OWN_FILES_FROM:
        for name in sizes:
            blobs[name] = bytearray(memoryview(blobs[name]).cast("B"))
        return
    made: list[_Own] = []
    try:
        for group in parts_of(sizes):
            offsets, total = page_offsets({n: sizes[n] for n in group})
            buf = SharedBuffer(max(total, 1))
            whole = memoryview(buf)
            for name in group:
                at, size = offsets[name], sizes[name]
                buf.write_at(at, blobs[name])
                # The input's buffer goes now; its file with the last one of it.
                blobs[name] = whole[at : at + size]
            starts = sorted(offsets[n] for n in group)
            made.append(_Own(buf, buf.address, starts, {offsets[n]: sizes[n] for n in group}))
    except BaseException:
        made.clear()
        raise
    _owned.extend(made)


def release_owned() -> None:
    """Forgets this message's own files (the handler's arrays keep what they view)."""
    _owned.clear()


def _npy_layout(view: memoryview) -> tuple[np.dtype, tuple[int, ...], bool, int] | None:
    """The dtype, shape, Fortran order and data offset of the ``.npy`` bytes ``view``
    (a 1-D byte view); None where they are not ``.npy`` bytes."""
    if bytes(view[:6]) != b"\x93NUMPY" or len(view) < 10:
        return None
    if view[6] == 1:
        hlen, start = int.from_bytes(view[8:10], "little"), 10
    else:
        hlen, start = int.from_bytes(view[8:12], "little"), 12
    header = ast.literal_eval(bytes(view[start : start + hlen]).decode("latin1"))
    return (
        np.dtype(header["descr"]),
        tuple(header["shape"]),
        bool(header["fortran_order"]),
        start + hlen,
    )


def _owned_slice(a: np.ndarray, sealed: dict[int, Any]) -> Any:
    """The ``.npy`` bytes of ``a`` as a slice of the sealed own file it lives in, where
    ``a`` is a whole array of the message there (the data of one array's ``.npy``
    bytes, its header saying the same dtype and shape, C order); else None."""
    if not _owned or not a.flags.c_contiguous or a.nbytes == 0:
        return None
    address = a.ctypes.data
    for i, own in enumerate(_owned):
        at = address - own.base
        k = bisect.bisect_right(own.starts, at) - 1
        if at < 0 or k < 0:
            continue
        start = own.starts[k]
        size = own.sizes[start]
        if at >= start + size:
            continue
        view = memoryview(own.buf).cast("B")[start : start + size]
        layout = _npy_layout(view)
        view.release()
        if layout is None:
            return None
        dtype, shape, fortran, data = layout
        if (start + data, dtype, shape, fortran) != (at, a.dtype, a.shape, False):
            return None
        if data + a.nbytes != size:
            return None
        if i not in sealed:
            sealed[i] = own.buf.seal()
        return sealed[i].slice(start, size)
    return None


def ndarrays(record: ArrayRecord, writable: bool = False) -> list[np.ndarray]:
    """The record's arrays as read-only NumPy views of their bytes (shared memory on a
    rank), without the copy ``to_numpy_ndarrays()`` makes. With ``writable``, arrays
    the handler may change: views of rank 0's own files where it has them
    (``ClientApp(arrays_to="rank0")``: written in place), else copies."""
    out = []
    for arr in record.values():
        view = memoryview(arr.data).cast("B")
        layout = _npy_layout(view) if arr.stype == "numpy.ndarray" else None
        if layout is None:
            out.append(arr.numpy())
            continue
        dtype, shape, fortran, data = layout
        count = int(np.prod(shape)) if shape else 1
        a = np.frombuffer(view, dtype=dtype, count=count, offset=data)
        a = a.reshape(shape, order="F" if fortran else "C")
        if not writable:
            a.flags.writeable = False
        elif not a.flags.writeable:
            a = a.copy(order="K")
        out.append(a)
    return out


def _as_numpy(key: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError(f"array {key!r} holds Python objects, which .npy bytes cannot")
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            raise TypeError(
                f"array {key!r} is torch.bfloat16, which NumPy (and so Flower's Array) "
                "cannot hold: cast it first (e.g. .to(torch.float16))"
            )
        return value.detach().cpu().numpy()
    raise TypeError(f"array {key!r} is a {type(value).__name__}, not a tensor or an ndarray")


def _npy_header(a: np.ndarray) -> bytes:
    """The ``.npy`` header ``np.save`` writes for ``a`` in C order."""
    fields = {
        "descr": np.lib.format.dtype_to_descr(a.dtype),
        "fortran_order": False,
        "shape": a.shape,
    }
    out = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(out, fields)
    except ValueError:  # a header over 64 KiB (a very long shape)
        out = io.BytesIO()
        np.lib.format.write_array_header_2_0(out, fields)
    return out.getvalue()


def shared_array_record(arrays: Mapping[str, Any] | Sequence[np.ndarray]) -> ArrayRecord:
    """An ``ArrayRecord`` of ``arrays`` (a ``state_dict`` or a list of NumPy arrays, keyed
    as Flower's ``ArrayRecord`` keys them) whose every ``Array`` holds its ``.npy``
    bytes in a sealed memory file: each tensor is copied once, straight into one new
    file, and rank 0's reply leaves the rank as that file (see the module docs); an
    array that is one of rank 0's own (``arrays_to="rank0"``, updated in place) is not
    copied at all: its file is sealed and sent as it is. The record reads like any
    other (``to_torch_state_dict()``, ``ndarrays``) and holds the same bytes Flower's
    own conversion would, in C order."""
    if isinstance(arrays, Mapping):
        items = [(str(k), _as_numpy(str(k), v)) for k, v in arrays.items()]
    else:
        items = [(str(i), _as_numpy(str(i), v)) for i, v in enumerate(arrays)]
    headers = {key: _npy_header(a) for key, a in items}
    sealed: dict[int, Any] = {}
    kept = {key: _owned_slice(a, sealed) for key, a in items}
    copied = [(key, a) for key, a in items if kept[key] is None]
    offsets, total = page_offsets({key: len(headers[key]) + a.nbytes for key, a in copied})
    slices: dict[str, Any] = {k: v for k, v in kept.items() if v is not None}
    if copied or not items:
        buf = SharedBuffer(max(total, 1))
        with memoryview(buf) as whole:
            dst = whole.cast("B")
            for key, a in copied:
                at, header = offsets[key], headers[key]
                dst[at : at + len(header)] = header
                target = np.frombuffer(dst, dtype=a.dtype, count=a.size, offset=at + len(header))
                np.copyto(target.reshape(a.shape), a, casting="no")
                del target
            dst.release()
        into = buf.seal()
        for key, a in copied:
            slices[key] = into.slice(offsets[key], len(headers[key]) + a.nbytes)
    record = ArrayRecord()
    for key, a in items:
        arr = Array(dtype=str(a.dtype), shape=tuple(a.shape), stype="numpy.ndarray", data=b"")
        # Flower's constructor insists on `bytes`; every reader takes any buffer. The
        # Blob itself, not a view of it (codec's `_array`): staging passes Blobs on as
        # they are.
        arr.data = slices[key]  # type: ignore[assignment]
        record[key] = arr
    return record
