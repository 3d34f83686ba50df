"""Flower ``Message`` / ``Context`` to rankexec's (meta, blobs) and back.

Why: a message travels ClientApp process -> per-node host -> every rank, and rank 0's
reply travels back. The array payloads (each ``Array``'s ``data``, NumPy's ``.npy``
bytes as Flower stores them) travel as blobs: the host copies them once into shared
memory that every rank maps, and on a rank each ``Array.data`` is a read-only
``memoryview`` of that mapping (no per-rank copy). The rest (metadata, ``ConfigRecord``
and ``MetricRecord`` values, which are plain scalars, lists and bytes) is plain data:
JSON values, ``bytes`` as ``{"b64": ...}``, each field of Flower's ``Metadata``,
``Error`` and ``Context`` named explicitly, so the values arrive exactly as they were
and nothing that travels is code (``pack``/``unpack`` are JSON, never pickle).

Caveats: Flower's own readers (``Array.numpy()``, ``ArrayRecord.to_numpy_ndarrays()``,
``to_torch_state_dict()``) copy as they parse ``.npy`` bytes; ``rankexec.flower.ndarrays``
gives read-only NumPy views instead. A record type other than ``ArrayRecord``,
``MetricRecord`` and ``ConfigRecord`` is refused (``TypeError``, naming it).
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Callable
from typing import Any

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.app.message.message import make_message  # Message from its metadata

__all__ = [
    "SPEC_BLOB",
    "array_blobs",
    "decode_context",
    "decode_message",
    "decode_records",
    "encode_context",
    "encode_message",
    "encode_records",
    "own_arrays",
    "releaser",
    "split_shared",
    "without_arrays",
]

SPEC_BLOB = "__flower_spec__"


def _value(v: Any) -> Any:
    """A record's or a config's value as JSON: scalars as they are, ``bytes`` as
    ``{"b64": ...}``, lists item by item."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"b64": base64.b64encode(bytes(v)).decode("ascii")}
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    raise TypeError(f"a value of type {type(v).__name__} cannot travel to the ranks")


def _unvalue(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) != {"b64"} or not isinstance(v["b64"], str):
            raise ValueError(f"a malformed value {sorted(v)}")
        return base64.b64decode(v["b64"], validate=True)
    if isinstance(v, list):
        return [_unvalue(x) for x in v]
    return v


def _values(d: Any) -> list[list[Any]]:
    return [[str(k), _value(v)] for k, v in dict(d).items()]


def _unvalues(pairs: Any) -> dict[str, Any]:
    return {str(k): _unvalue(v) for k, v in pairs}


def encode_records(rd: RecordDict, prefix: str, blobs: dict[str, Any]) -> list[Any]:
    """The structure of ``rd`` (JSON values), its arrays' bytes added to ``blobs``, once
    per buffer: arrays that share one ``data`` object (Flower gives every array of the
    same content the same object when it receives a message, e.g. zero-initialised LoRA
    matrices) share one blob, so they travel and sit in shared memory once."""
    out: list[Any] = []
    by_buffer = {id(value): name for name, value in blobs.items()}
    for name, rec in rd.items():
        if isinstance(rec, ArrayRecord):
            arrays = []
            for i, (key, arr) in enumerate(rec.items()):
                blob = by_buffer.get(id(arr.data))
                if blob is None:
                    blob = f"{prefix}.{len(out)}.{i}"
                    blobs[blob] = arr.data
                    by_buffer[id(arr.data)] = blob
                arrays.append([key, arr.dtype, list(arr.shape), arr.stype, blob])
            out.append([name, "arrays", arrays])
        elif isinstance(rec, MetricRecord):
            out.append([name, "metrics", _values(rec)])
        elif isinstance(rec, ConfigRecord):
            out.append([name, "config", _values(rec)])
        else:
            raise TypeError(f"a record of type {type(rec).__name__} cannot travel to the ranks")
    return out


def _array(dtype: str, shape: tuple[int, ...], stype: str, data: Any) -> Array:
    arr = Array(dtype=dtype, shape=tuple(shape), stype=stype, data=b"")
    # Flower's constructor insists on `bytes`; every reader takes any buffer.
    arr.data = data if isinstance(data, bytes) else memoryview(data)  # type: ignore[assignment]
    return arr


def decode_records(spec: list[Any], blobs: dict[str, Any]) -> RecordDict:
    rd = RecordDict()
    for name, kind, body in spec:
        if kind == "arrays":
            rec = ArrayRecord()
            for key, dtype, shape, stype, blob in body:
                rec[str(key)] = _array(str(dtype), tuple(shape), str(stype), blobs[blob])
            rd[name] = rec
        elif kind == "metrics":
            rd[name] = MetricRecord(_unvalues(body))
        elif kind == "config":
            rd[name] = ConfigRecord(_unvalues(body))
        else:
            raise ValueError(f"record {name!r} is of an unknown kind {kind!r}")
    return rd


def array_blobs(spec: dict[str, Any]) -> list[str]:
    """The blob names of a message spec's arrays (``encode_message``'s), in order, each
    once; none for an error message."""
    names: dict[str, None] = {}
    for _name, kind, body in spec.get("content") or []:
        if kind == "arrays":
            for *_, blob in body:
                names[str(blob)] = None
    return list(names)


def split_shared(spec: dict[str, Any], blobs: dict[str, Any], reserved: set[str]) -> list[str]:
    """Gives every array of a message spec a blob name of its own (the same buffer in
    ``blobs`` under a new name where the name is another array's, or ``reserved``),
    rewriting the spec in place; returns the names, in order."""
    names: list[str] = []
    seen = set(reserved)
    for _name, kind, body in spec.get("content") or []:
        if kind != "arrays":
            continue
        for entry in body:
            blob = str(entry[-1])
            if blob in seen:
                fresh = f"{blob}#{len(names)}"
                blobs[fresh] = blobs[blob]
                entry[-1] = blob = fresh
            seen.add(blob)
            names.append(blob)
    return names


def without_arrays(spec: dict[str, Any]) -> dict[str, Any]:
    """A message spec whose ``ArrayRecord``s are empty (their names and order kept)."""
    if "content" not in spec:
        return spec
    content = [[n, k, [] if k == "arrays" else body] for n, k, body in spec["content"]]
    return {**spec, "content": content}


def own_arrays(rd: RecordDict) -> RecordDict:
    """``rd`` with every array's ``data`` as ``bytes`` (copied where it is a mapping or
    another buffer): what a ``Context``'s state must hold, since Flower serializes it
    into a protobuf ``bytes`` field (``context_to_proto``) that takes nothing else. A
    state holding a memory file's view would make Flower drop the node's context."""
    for rec in rd.values():
        if isinstance(rec, ArrayRecord):
            for arr in rec.values():
                if not isinstance(arr.data, bytes):
                    arr.data = bytes(memoryview(arr.data))
    return rd


#: The fields of Flower's ``Metadata`` that travel, each by name.
_METADATA = (
    "run_id",
    "message_id",
    "src_node_id",
    "dst_node_id",
    "reply_to_message_id",
    "group_id",
    "created_at",
    "ttl",
    "message_type",
    "src_task_id",
    "dst_task_id",
)


def encode_metadata(md: Metadata) -> dict[str, Any]:
    out = {k: getattr(md, k, None) for k in _METADATA}
    out["delivered_at"] = md.__dict__.get("_delivered_at", "")
    return out


def decode_metadata(spec: Any) -> Metadata:
    if isinstance(spec, Metadata):
        return spec
    md = Metadata(**{k: spec[k] for k in _METADATA if k in spec})
    md.delivered_at = str(spec.get("delivered_at") or "")
    return md


def encode_message(msg: Message, blobs: dict[str, Any], prefix: str = "m") -> dict[str, Any]:
    spec: dict[str, Any] = {"metadata": encode_metadata(msg.metadata)}
    if msg.has_error():
        spec["error"] = [int(msg.error.code), str(msg.error.reason)]
    else:
        spec["content"] = encode_records(msg.content, prefix, blobs)
    return spec


def decode_message(spec: dict[str, Any], blobs: dict[str, Any]) -> Message:
    metadata = decode_metadata(spec["metadata"])
    if "error" in spec:
        code, reason = spec["error"]
        return make_message(metadata, error=Error(code=int(code), reason=str(reason)))
    return make_message(metadata, content=decode_records(spec["content"], blobs))


def encode_context(ctx: Context, blobs: dict[str, Any], prefix: str = "s") -> dict[str, Any]:
    return {
        "run_id": ctx.run_id,
        "node_id": ctx.node_id,
        "node_config": _values(ctx.node_config),
        "run_config": _values(ctx.run_config),
        "series_id": getattr(ctx, "series_id", 0),
        "state": encode_records(ctx.state, prefix, blobs),
    }


def decode_context(spec: dict[str, Any], blobs: dict[str, Any]) -> Context:
    return Context(
        run_id=spec["run_id"],
        node_id=spec["node_id"],
        node_config=_unvalues(spec["node_config"]),
        state=decode_records(spec["state"], blobs),
        run_config=_unvalues(spec["run_config"]),
        series_id=spec.get("series_id", 0),
    )


def pack(spec: Any) -> bytes:
    """A spec as the ranks and the ClientApp read it: JSON (never pickle)."""
    return json.dumps(spec, separators=(",", ":")).encode()


def unpack(data: Any) -> Any:
    """A spec written by ``pack``; anything that is not JSON raises ``ValueError``."""
    with memoryview(data) as view:
        text = view.tobytes().decode("utf-8")
    return json.loads(text)


def releaser(held: list[Any]) -> Callable[[str, Any], None]:
    """A ``stage_releasing`` / ``stage_in_parts`` callback that removes an array's bytes from the records that
    hold them (by identity: ``Array.data`` is the object the codec put in ``blobs``)."""
    holders: dict[int, list[tuple[ArrayRecord, str]]] = {}
    for records in held:
        for rec in records.values():
            if isinstance(rec, ArrayRecord):
                for key, arr in rec.items():
                    holders.setdefault(id(arr.data), []).append((rec, key))

    def release(_name: str, source: Any) -> None:
        for rec, key in holders.pop(id(source), []):
            with contextlib.suppress(KeyError):
                del rec[key]

    return release
