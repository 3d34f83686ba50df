"""numpy arrays as named blobs: how a DXO's data travels to the ranks and back.

Each array is one blob (its raw C-order bytes, no copy when already contiguous); its
dtype and shape travel in the task's meta under ``ARRAYS_KEY``:
``{"dxo_arrays": {"weights": {"dtype": "<f4", "shape": [3, 3]}}}``. Rank code reads an
input array with ``from_blobs`` (or ``numpy.frombuffer(blob, dtype).reshape(shape)``) and
may return arrays the same way; an output blob without an entry takes the input's
dtype and shape for the same name, else it is returned as bytes (``uint8``).

Arrays built from result blobs are read-only views of the rank's memory (no copy);
``numpy.array(a)`` makes a writable copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

ARRAYS_KEY = "dxo_arrays"


def to_blobs(data: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any], dict]:
    """Splits a DXO's data into ``(blobs, specs, values)``: arrays as contiguous arrays
    with their ``{"dtype", "shape"}`` specs, and the other (JSON-like) values apart."""
    blobs: dict[str, np.ndarray] = {}
    specs: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for name, v in data.items():
        if isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v)
            if a.dtype.hasobject:
                raise TypeError(f"array `{name}` holds Python objects; it cannot travel as bytes")
            blobs[name] = a
            specs[name] = {"dtype": a.dtype.str, "shape": list(a.shape)}
        else:
            values[name] = v
    return blobs, specs, values


def from_blobs(
    blobs: Mapping[str, Any],
    specs: Mapping[str, Any] | None,
    fallback: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Rebuilds arrays from blobs (any buffer) and their specs, without copying."""
    out: dict[str, np.ndarray] = {}
    for name, blob in blobs.items():
        spec = (specs or {}).get(name) or (fallback or {}).get(name)
        if spec is None:
            out[name] = np.frombuffer(blob, dtype=np.uint8)
            continue
        dtype = np.dtype(spec["dtype"])
        shape = tuple(int(d) for d in spec["shape"])
        a = np.frombuffer(blob, dtype=dtype)
        if a.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(
                f"blob `{name}` holds {a.size} items of {dtype}, its shape {list(shape)} needs "
                f"{int(np.prod(shape, dtype=np.int64))}"
            )
        out[name] = a.reshape(shape)
    return out
