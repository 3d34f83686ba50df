"""``ndarrays``: a record's arrays as NumPy views of their bytes, without a copy.

Why: on a rank, a message's ``ArrayRecord`` payloads sit in the shared memory the host
filled; Flower's ``to_numpy_ndarrays()`` copies every array, this reads the ``.npy``
header and views the bytes in place.

Caveats: the views are read-only (the memory is shared by every rank); an array that is
not a plain ``numpy.ndarray`` record falls back to Flower's own ``numpy()`` (a copy).
"""

from __future__ import annotations

import ast

import numpy as np
from flwr.app import ArrayRecord

__all__ = ["ndarrays"]


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
