"""Client API model params as blobs: numpy arrays and torch tensors, never pickled.

``pack(params)`` splits an ``FLModel.params`` dict into ``(blobs, specs, values)``:
every numpy array and every torch tensor becomes one blob of its raw bytes (a CPU
tensor or a contiguous array is not copied here; the group copies it once into shared
memory when it is large), its kind (``numpy``/``torch``), dtype and shape go into
``specs``, and plain values (numbers, strings, None, lists and dicts of them) into
``values``. Anything else raises ``TypeError`` naming the param: nothing is dropped.

``unpack(blobs, specs, values, writable=)`` rebuilds the dict. In a rank
(``writable=True``) each array or tensor is a copy-on-write mapping of the blob's
shared memory: no copy, writes stay in the rank. On the host (``writable=False``) numpy
arrays are read-only views of the rank's memory and torch tensors are copies (torch
has no read-only tensors).

This is the Client API executor's own helper; ``rankexec.flare.arrays`` carries DXO
arrays for ``MultiProcessExecutor`` the same way (without torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

import numpy as np

__all__ = ["pack", "plain", "unpack"]

_SKIP = object()


def plain(value: Any, what: str) -> Any:
    """``value`` as metadata (None, bool, int, float, str, lists and str-keyed dicts of
    them; numpy scalars become Python numbers); raises ``TypeError`` naming ``what``."""
    out = _plain(value)
    if out is _SKIP:
        raise TypeError(
            f"{what} holds a {type(value).__name__} that cannot travel as metadata "
            "(numbers, strings, None, lists and dicts of them can)"
        )
    return out


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, np.generic) or (
        type(v).__module__.startswith("torch") and getattr(v, "ndim", 1) == 0
    ):
        return v.item()
    if isinstance(v, Enum):
        return _plain(v.value)
    if isinstance(v, list | tuple):
        items = [_plain(x) for x in v]
        return _SKIP if any(x is _SKIP for x in items) else items
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            px = _plain(x)
            if not isinstance(k, str) or px is _SKIP:
                return _SKIP
            out[k] = px
        return out
    return _SKIP


def _is_torch_tensor(v: Any) -> bool:
    return type(v).__module__.startswith("torch") and hasattr(v, "detach")


def pack(params: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any], dict]:
    """Splits params into blobs (raw bytes), their specs, and plain values."""
    blobs: dict[str, Any] = {}
    specs: dict[str, Any] = {}
    values: dict[str, Any] = {}
    if params is None:
        return blobs, specs, values
    if not isinstance(params, Mapping):
        raise TypeError(
            f"model params must be a dict of arrays or tensors, not a {type(params).__name__}"
        )
    for name, v in params.items():
        if not isinstance(name, str):
            raise TypeError(f"param names must be strings, not {name!r}")
        if isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v)
            if a.dtype.hasobject:
                raise TypeError(f"param `{name}` holds Python objects; it cannot travel as bytes")
            blobs[name] = a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)
            specs[name] = {"kind": "numpy", "dtype": a.dtype.str, "shape": list(a.shape)}
        elif _is_torch_tensor(v):
            import torch

            t = v.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
            blobs[name] = raw
            specs[name] = {
                "kind": "torch",
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
            }
        else:
            values[name] = plain(v, f"param `{name}`")
    return blobs, specs, values


def unpack(
    blobs: Mapping[str, Any],
    specs: Mapping[str, Any] | None,
    values: Mapping[str, Any] | None = None,
    *,
    writable: bool,
) -> dict[str, Any]:
    """Rebuilds params from blobs and their specs (see the module docs for copies)."""
    out: dict[str, Any] = {}
    for name, spec in (specs or {}).items():
        blob = blobs.get(name)
        if blob is None:
            raise ValueError(f"param `{name}` has a spec but no blob")
        shape = tuple(int(d) for d in spec["shape"])
        src: Any = blob
        if writable and hasattr(blob, "copy_on_write"):
            src = blob.copy_on_write()
        if spec.get("kind") == "torch":
            out[name] = _tensor(src, spec["dtype"], shape, copy=not writable)
        else:
            dtype = np.dtype(spec["dtype"])
            count = int(np.prod(shape, dtype=np.int64))
            if len(memoryview(src).cast("B")) != count * dtype.itemsize:
                raise ValueError(f"param `{name}`: blob size does not match {dtype} {list(shape)}")
            a = np.frombuffer(src, dtype=dtype, count=count) if count else np.zeros(0, dtype)
            out[name] = a.reshape(shape)
    out.update(values or {})
    return out


def _tensor(src: Any, dtype: str, shape: tuple[int, ...], copy: bool) -> Any:
    import torch

    tdt = getattr(torch, dtype, None)
    if not isinstance(tdt, torch.dtype):
        raise TypeError(f"unknown torch dtype {dtype!r}")
    nbytes = len(memoryview(src).cast("B"))
    if nbytes == 0:
        return torch.empty(shape, dtype=tdt)
    if copy:
        src = bytearray(src)
    flat = torch.frombuffer(src, dtype=torch.uint8)
    return flat.view(tdt).reshape(shape)
