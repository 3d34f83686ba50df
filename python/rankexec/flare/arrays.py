"""A DXO's data as task meta and named blobs: how it travels to the ranks and back.

Every numpy array and every torch tensor is one blob (its raw C-order bytes; no copy
when it is already a contiguous CPU array or tensor); its dtype and shape travel in
the task's meta under ``ARRAYS_KEY``::

    {"dxo_arrays": {"weights": {"dtype": "<f4", "shape": [3, 3]},
                    "fc.bias": {"dtype": "bfloat16", "shape": [10], "framework": "torch"}}}

Other values (None, bool, int, float, str, bytes, lists and dicts of them; numpy
scalars as Python numbers) travel under ``VALUES_KEY``. The members of a
``DataKind.COLLECTION`` DXO (values that are DXOs) travel under ``MEMBERS_KEY``, each
as ``{"dxo_kind", "dxo_meta", "dxo_arrays", "dxo_values", "dxo_members"}``, their
arrays' specs naming their blob (``"blob": "member/key"``). Anything else is refused
with ``Unsendable``, which names the key: nothing is dropped.

Rank code reads its input with ``unpack_data(input.meta, input.blobs)`` (arrays as
read-only views of the blobs, tensors as copy-on-write views, members as ``Member``)
and builds its result with ``pack_data(data, kind=..., meta=...)``; ``from_blobs`` and
``to_blobs`` are the flat forms for data without members, and ``pack_flat`` and
``unpack_flat`` carry a FLARE Client API model's params (``rankexec.flare.ScriptExecutor``)
the same way. An output blob without a
spec takes the input's spec for the same name, else it is returned as bytes
(``uint8``).

This module imports neither nvflare nor torch (torch only when a tensor is met).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, NamedTuple

import numpy as np

from rankexec._staging import parts_of

__all__ = [
    "ARRAYS_KEY",
    "MEMBERS_KEY",
    "VALUES_KEY",
    "Member",
    "Unsendable",
    "from_blobs",
    "pack_data",
    "pack_flat",
    "parts_of",
    "plain",
    "to_blobs",
    "unpack_data",
    "unpack_flat",
]

ARRAYS_KEY = "dxo_arrays"
VALUES_KEY = "dxo_values"
MEMBERS_KEY = "dxo_members"
KIND_KEY = "dxo_kind"
META_KEY = "dxo_meta"

_INT64 = (-(1 << 63), 1 << 63)


class Unsendable(TypeError):
    """A value that cannot travel to or from the ranks; ``key`` is where it is
    (``model.fc.weight``, ``meta.history[2]``)."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"`{key}`: {why}")
        self.key = key
        self.why = why


class Member(NamedTuple):
    """A member of a collection (a DXO's kind, data and meta), as rank code sees it."""

    data_kind: str
    data: dict[str, Any]
    meta: dict[str, Any]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "torch" and hasattr(x, "dtype")


def _is_member(x: Any) -> bool:
    return hasattr(x, "data_kind") and hasattr(x, "data") and hasattr(x, "meta")


def plain(v: Any, key: str) -> Any:
    """``v`` as a metadata value, or ``Unsendable`` naming ``key``."""
    if v is None or isinstance(v, bool | str | bytes | float):
        return v
    if isinstance(v, int):
        if not _INT64[0] <= v < _INT64[1]:
            raise Unsendable(key, f"the int {v} does not fit in 64 bits")
        return v
    if isinstance(v, np.generic) and not isinstance(v, np.void | np.object_):
        return plain(v.item(), key)
    if isinstance(v, Enum):
        return plain(v.value, key)
    if _is_torch(v) and getattr(v, "ndim", None) == 0 and hasattr(v, "item"):
        return plain(v.item(), key)
    if isinstance(v, list | tuple):
        return [plain(x, f"{key}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise Unsendable(
                    f"{key}[{k!r}]", f"a dict key must be a str, not {type(k).__name__}"
                )
            out[k] = plain(x, f"{key}.{k}")
        return out
    raise Unsendable(
        key,
        f"a {type(v).__module__}.{type(v).__qualname__} cannot travel to or from the ranks "
        "(send numpy arrays, torch tensors, DXOs in a collection, or None, bool, int, float, "
        "str, bytes, lists and dicts of them)",
    )


def _array_blob(v: Any, key: str) -> tuple[Any, dict[str, Any]]:
    """(a C-contiguous buffer of ``v``'s bytes, its spec)."""
    if isinstance(v, np.ndarray):
        if v.dtype.hasobject or v.dtype.fields is not None or v.dtype.subdtype is not None:
            raise Unsendable(key, f"an array of dtype {v.dtype} cannot travel as raw bytes")
        a = np.ascontiguousarray(v)
        return a, {"dtype": a.dtype.str, "shape": list(a.shape)}
    import torch

    t = v.detach()
    if t.layout != torch.strided or t.is_quantized:
        raise Unsendable(key, f"a {t.layout} tensor cannot travel as raw bytes")
    t = t.cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    try:
        raw = t.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError) as e:
        raise Unsendable(key, f"a tensor of dtype {name} cannot travel as raw bytes: {e}") from None
    return raw, {"dtype": name, "shape": list(t.shape), "framework": "torch"}


def pack_data(
    data: Mapping[str, Any],
    *,
    kind: str | None = None,
    meta: Mapping[str, Any] | None = None,
    where: str = "data",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(task meta, blobs)`` for a DXO's data (and its kind and meta, when given).

    Arrays and tensors become blobs named by their key (members' by ``member/key``),
    values go to ``VALUES_KEY``, members (DXOs, or ``Member``) to ``MEMBERS_KEY``.
    Raises ``Unsendable`` naming the first key that cannot travel."""
    blobs: dict[str, Any] = {}
    out = _pack(data, (), blobs, where)
    if kind is not None:
        out[KIND_KEY] = str(getattr(kind, "value", kind))
    if meta is not None:
        out[META_KEY] = plain(dict(meta), "meta")
    return out, blobs


def _pack(
    data: Mapping[str, Any], path: tuple[str, ...], blobs: dict[str, Any], where: str
) -> dict[str, Any]:
    specs: dict[str, Any] = {}
    values: dict[str, Any] = {}
    members: dict[str, Any] = {}
    for name, v in data.items():
        key = f"{where}.{name}"
        if not isinstance(name, str):
            raise Unsendable(f"{where}[{name!r}]", "a key must be a str")
        if isinstance(v, np.ndarray) or _is_torch(v):
            buf, spec = _array_blob(v, key)
            blob = "/".join((*path, name))
            while blob in blobs:
                blob += "'"
            if blob != name:
                spec["blob"] = blob
            blobs[blob] = buf
            specs[name] = spec
        elif _is_member(v):
            if not isinstance(v.data, Mapping):
                raise Unsendable(key, f"the member's data is a {type(v.data).__name__}, not a dict")
            m = _pack(v.data, (*path, name), blobs, key)
            m[KIND_KEY] = str(getattr(v.data_kind, "value", v.data_kind))
            m[META_KEY] = plain(dict(v.meta or {}), f"{key}.meta")
            members[name] = m
        else:
            values[name] = plain(v, key)
    out: dict[str, Any] = {ARRAYS_KEY: specs}
    if values:
        out[VALUES_KEY] = values
    if members:
        out[MEMBERS_KEY] = members
    return out


def _parse_spec(spec: Mapping[str, Any], name: str, nbytes: int) -> tuple[tuple[int, ...], Any]:
    """``(shape, dtype)`` of a blob's spec (a torch dtype when ``framework`` is torch, else
    a numpy dtype), checked against the blob's ``nbytes``; ``Unsendable`` naming the blob
    otherwise."""
    try:
        shape = tuple(int(d) for d in spec["shape"])
        dtype_name = spec["dtype"]
    except (KeyError, TypeError, ValueError):
        raise Unsendable(
            name, f"the blob's spec {dict(spec)!r} has no valid dtype and shape"
        ) from None
    count = int(np.prod(shape, dtype=np.int64))
    dtype: Any
    if spec.get("framework") == "torch":
        import torch

        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise Unsendable(name, f"unknown torch dtype {dtype_name!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        shown = dtype_name
    else:
        try:
            dtype = np.dtype(dtype_name)
        except TypeError:
            raise Unsendable(name, f"unknown numpy dtype {dtype_name!r}") from None
        itemsize = dtype.itemsize
        shown = dtype
    if nbytes != count * itemsize:
        raise Unsendable(
            name,
            f"the blob holds {nbytes} bytes, {shown} of shape {list(shape)} needs "
            f"{count * itemsize}",
        )
    return shape, dtype


def _from_spec(
    blob: Any, spec: Mapping[str, Any], name: str, copy: bool, writable: bool = False
) -> Any:
    raw = np.frombuffer(blob, dtype=np.uint8)
    shape, dtype = _parse_spec(spec, name, raw.size)
    cow = getattr(blob, "copy_on_write", None)
    if not isinstance(dtype, np.dtype):
        import torch

        if raw.size == 0:
            return torch.empty(shape, dtype=dtype)
        if cow is not None and not copy:
            # A rank's input: a private copy-on-write mapping, no copy until written.
            flat = torch.frombuffer(cow(), dtype=torch.uint8)
        else:
            # Read-only memory (torch has no read-only tensors): one copy.
            flat = torch.from_numpy(raw.copy())
        return flat.view(dtype).reshape(shape)
    a = raw
    if writable and not copy and cow is not None and a.size:
        # A rank's input: a private copy-on-write mapping, writable, no copy until written.
        a = np.frombuffer(cow(), dtype=np.uint8)
    elif writable and not a.flags.writeable:
        copy = True
    out = a.view(dtype).reshape(shape)
    return out.copy() if copy else out


def _view_of(region: np.ndarray, spec: Mapping[str, Any], name: str) -> Any:
    """An array or tensor of ``spec`` viewing ``region`` (writable bytes), no copy."""
    shape, dtype = _parse_spec(spec, name, region.size)
    if isinstance(dtype, np.dtype):
        return region.view(dtype).reshape(shape)
    import torch

    if region.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(region).view(dtype).reshape(shape)


def unpack_data(
    meta: Mapping[str, Any],
    blobs: Mapping[str, Any],
    fallback: Mapping[str, Any] | None = None,
    *,
    member: Callable[[str, dict[str, Any], dict[str, Any]], Any] = Member,
    copy: bool = False,
) -> dict[str, Any]:
    """The data ``pack_data`` packed: arrays (read-only views of the blobs, or copies
    with ``copy``), torch tensors, values and members (built by ``member(kind, data,
    meta)``). A blob no spec names is returned under its own name, shaped by
    ``fallback``'s spec for that name, else as ``uint8`` bytes."""
    used: set[str] = set()
    data = _unpack(meta, blobs, (), used, member, copy)
    for name, blob in blobs.items():
        if name in used:
            continue
        spec = (fallback or {}).get(name)
        if spec is None:
            spec = {"dtype": "|u1", "shape": [len(memoryview(blob).cast("B"))]}
        data[name] = _from_spec(blob, spec, name, copy)
    return data


def _unpack(meta, blobs, path, used, member, copy) -> dict[str, Any]:
    data: dict[str, Any] = dict(meta.get(VALUES_KEY) or {})
    for name, spec in (meta.get(ARRAYS_KEY) or {}).items():
        blob_name = spec.get("blob", "/".join((*path, name))) if isinstance(spec, Mapping) else name
        if blob_name not in blobs:
            continue  # the rank did not return it; only what was returned is data
        if not isinstance(spec, Mapping):
            raise Unsendable(blob_name, f"its spec {spec!r} is not a dict")
        data[name] = _from_spec(blobs[blob_name], spec, blob_name, copy)
        used.add(blob_name)
    for name, m in (meta.get(MEMBERS_KEY) or {}).items():
        if not isinstance(m, Mapping):
            raise Unsendable(name, f"the member's description {m!r} is not a dict")
        inner = _unpack(m, blobs, (*path, name), used, member, copy)
        data[name] = member(str(m.get(KIND_KEY, "")), inner, dict(m.get(META_KEY) or {}))
    return data


def pack_flat(
    data: Mapping[str, Any] | None, where: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(blobs, specs, values)`` for flat data (a Client API model's params): arrays
    and tensors as blobs with their specs, every other value as metadata; raises
    ``Unsendable`` naming the first key that cannot travel."""
    if data is None:
        return {}, {}, {}
    if not isinstance(data, Mapping):
        raise Unsendable(where, f"a {type(data).__name__}, not a dict of arrays or tensors")
    blobs: dict[str, Any] = {}
    specs: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for name, v in data.items():
        if not isinstance(name, str):
            raise Unsendable(f"{where}[{name!r}]", "a key must be a str")
        key = f"{where}.{name}"
        if isinstance(v, np.ndarray) or _is_torch(v):
            blobs[name], specs[name] = _array_blob(v, key)
        else:
            values[name] = plain(v, key)
    return blobs, specs, values


def unpack_flat(
    blobs: Mapping[str, Any],
    specs: Mapping[str, Any] | None,
    values: Mapping[str, Any] | None = None,
    *,
    writable: bool,
    copy: bool = False,
    own: bool = False,
) -> dict[str, Any]:
    """The data ``pack_flat`` packed. In a rank (``writable``) arrays and tensors are
    copy-on-write mappings of the blobs' shared memory (no copy; writes stay in the
    rank), or, with ``copy``, the rank's own copies (so that the shared memory can be
    let go at once); on the host arrays are read-only views and tensors copy-on-write
    mappings where the blob offers one, else copies. With ``own`` the blobs are writable
    buffers the caller owns (numpy arrays): arrays and tensors are views of them."""
    out: dict[str, Any] = {}
    for name, spec in (specs or {}).items():
        blob = blobs.get(name)
        if blob is None:
            raise Unsendable(name, "it has a spec but no blob")
        if not isinstance(spec, Mapping):
            raise Unsendable(name, f"its spec {spec!r} is not a dict")
        out[name] = (
            _view_of(blob, spec, name) if own else _from_spec(blob, spec, name, copy, writable)
        )
    out.update(values or {})
    return out


def to_blobs(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict]:
    """Splits flat data into ``(blobs, specs, values)``: arrays and tensors as
    contiguous byte buffers with their specs, and the other values apart (as given)."""
    blobs: dict[str, Any] = {}
    specs: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for name, v in data.items():
        if isinstance(v, np.ndarray) or _is_torch(v):
            blobs[name], specs[name] = _array_blob(v, name)
        else:
            values[name] = v
    return blobs, specs, values


def from_blobs(
    blobs: Mapping[str, Any],
    specs: Mapping[str, Any] | None,
    fallback: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Rebuilds arrays (and torch tensors) from blobs (any buffer) and their specs,
    without copying; a blob without a spec is ``uint8`` bytes."""
    out: dict[str, Any] = {}
    for name, blob in blobs.items():
        spec = (specs or {}).get(name) or (fallback or {}).get(name)
        if spec is None:
            out[name] = np.frombuffer(blob, dtype=np.uint8)
        else:
            out[name] = _from_spec(blob, spec, name, False)
    return out
