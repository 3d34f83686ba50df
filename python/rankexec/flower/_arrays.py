"""``ndarrays`` and ``shared_array_record``: a record's arrays read and written in
shared memory, without the copies Flower's own conversions make.

Why: on a rank, a message's ``ArrayRecord`` payloads sit in the shared memory the host
filled; Flower's ``to_numpy_ndarrays()`` copies every array, ``ndarrays`` reads the
``.npy`` header and views the bytes in place. On the way back, Flower's
``ArrayRecord(state_dict)`` serializes every tensor into new ``bytes``, which rank 0
then copies into a memory file for the node's ``ClientApp``; ``shared_array_record``
writes each tensor's ``.npy`` bytes straight into one memory file instead, which leaves
rank 0 as it is (no second copy, and nothing for the C heap to keep).

Caveats: the views are read-only (the memory is shared by every rank, and a sealed file
cannot change); an array that is not a plain ``numpy.ndarray`` record falls back to
Flower's own ``numpy()`` (a copy). ``shared_array_record`` takes what Flower's
``ArrayRecord`` takes (a ``state_dict`` of tensors, or a list of NumPy arrays); torch's
bfloat16 has no NumPy dtype, in Flower as here, and is refused naming the key.
"""

from __future__ import annotations

import ast
import io
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from rankexec._rankexec import SharedBuffer
from rankexec._staging import page_offsets

__all__ = ["ndarrays", "shared_array_record"]


def ndarrays(record: ArrayRecord) -> list[np.ndarray]:
    """The record's arrays as read-only NumPy views of their bytes (shared memory on a
    rank), without the copy ``to_numpy_ndarrays()`` makes."""
    out = []
    for arr in record.values():
        view = memoryview(arr.data).cast("B")
        if arr.stype != "numpy.ndarray" or bytes(view[:6]) != b"\x93NUMPY":
            out.append(arr.numpy())
            continue
        major = view[6]
        if major == 1:
            hlen, start = int.from_bytes(view[8:10], "little"), 10
        else:
            hlen, start = int.from_bytes(view[8:12], "little"), 12
        header = ast.literal_eval(bytes(view[start : start + hlen]).decode("latin1"))
        dtype = np.dtype(header["descr"])
        shape = tuple(header["shape"])
        count = int(np.prod(shape)) if shape else 1
        a = np.frombuffer(view, dtype=dtype, count=count, offset=start + hlen)
        a = a.reshape(shape, order="F" if header["fortran_order"] else "C")
        a.flags.writeable = False
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
    bytes in one sealed memory file: each tensor is copied once, straight into it, and
    rank 0's reply leaves the rank as that file (see the module docs). The record reads
    like any other (``to_torch_state_dict()``, ``ndarrays``) and holds the same bytes
    Flower's own conversion would, in C order."""
    if isinstance(arrays, Mapping):
        items = [(str(k), _as_numpy(str(k), v)) for k, v in arrays.items()]
    else:
        items = [(str(i), _as_numpy(str(i), v)) for i, v in enumerate(arrays)]
    headers = {key: _npy_header(a) for key, a in items}
    offsets, total = page_offsets({key: len(headers[key]) + a.nbytes for key, a in items})
    buf = SharedBuffer(max(total, 1))
    with memoryview(buf) as whole:
        dst = whole.cast("B")
        for key, a in items:
            at, header = offsets[key], headers[key]
            dst[at : at + len(header)] = header
            target = np.frombuffer(dst, dtype=a.dtype, count=a.size, offset=at + len(header))
            np.copyto(target.reshape(a.shape), a, casting="no")
            del target
        dst.release()
    sealed = buf.seal()
    record = ArrayRecord()
    for key, a in items:
        size = len(headers[key]) + a.nbytes
        arr = Array(dtype=str(a.dtype), shape=tuple(a.shape), stype="numpy.ndarray", data=b"")
        # Flower's constructor insists on `bytes`; every reader takes any buffer. The
        # Blob itself, not a view of it (codec's `_array`): staging passes Blobs on as
        # they are.
        arr.data = sealed.slice(offsets[key], size)  # type: ignore[assignment]
        record[key] = arr
    return record
