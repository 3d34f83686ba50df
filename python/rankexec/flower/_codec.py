"""Flower ``Message`` / ``Context`` to rankexec's (meta, blobs) and back.

Why: a message travels ClientApp process -> per-node host -> every rank, and rank 0's
reply travels back. The array payloads (each ``Array``'s ``data``, NumPy's ``.npy``
bytes as Flower stores them) travel as blobs: the host copies them once into shared
memory that every rank maps, and on a rank each ``Array.data`` is a read-only
``memoryview`` of that mapping (no per-rank copy). The rest (metadata, ``ConfigRecord``
and ``MetricRecord`` values, which are plain scalars, lists and bytes) is pickled into
one small blob, so the values arrive exactly as they were.

Caveats: Flower's own readers (``Array.numpy()``, ``ArrayRecord.to_numpy_ndarrays()``,
``to_torch_state_dict()``) copy as they parse ``.npy`` bytes; ``rankexec.flower.ndarrays``
gives read-only NumPy views instead. Pickle is only ever read from a peer that passed
the channel's authentication (same uid, per-launch secret) or from the host itself.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable
from typing import Any

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.app.message.message import make_message  # Message from its metadata

__all__ = [
    "SPEC_BLOB",
    "decode_context",
    "decode_message",
    "decode_records",
    "encode_context",
    "encode_message",
    "encode_records",
    "releaser",
]

SPEC_BLOB = "__flower_spec__"


def encode_records(rd: RecordDict, prefix: str, blobs: dict[str, Any]) -> list[Any]:
    """The structure of ``rd`` (picklable), its arrays' bytes added to ``blobs``, once
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
                arrays.append((key, arr.dtype, tuple(arr.shape), arr.stype, blob))
            out.append((name, "arrays", arrays))
        elif isinstance(rec, MetricRecord):
            out.append((name, "metrics", dict(rec)))
        elif isinstance(rec, ConfigRecord):
            out.append((name, "config", dict(rec)))
        else:  # a future record type: let pickle carry it
            out.append((name, "other", rec))
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
                rec[key] = _array(dtype, shape, stype, blobs[blob])
            rd[name] = rec
        elif kind == "metrics":
            rd[name] = MetricRecord(body)
        elif kind == "config":
            rd[name] = ConfigRecord(body)
        else:
            rd[name] = body
    return rd


def encode_message(msg: Message, blobs: dict[str, Any], prefix: str = "m") -> dict[str, Any]:
    spec: dict[str, Any] = {"metadata": msg.metadata}
    if msg.has_error():
        spec["error"] = (msg.error.code, msg.error.reason)
    else:
        spec["content"] = encode_records(msg.content, prefix, blobs)
    return spec


def decode_message(spec: dict[str, Any], blobs: dict[str, Any]) -> Message:
    if "error" in spec:
        code, reason = spec["error"]
        return make_message(spec["metadata"], error=Error(code=code, reason=reason))
    return make_message(spec["metadata"], content=decode_records(spec["content"], blobs))


def encode_context(ctx: Context, blobs: dict[str, Any], prefix: str = "s") -> dict[str, Any]:
    return {
        "run_id": ctx.run_id,
        "node_id": ctx.node_id,
        "node_config": dict(ctx.node_config),
        "run_config": dict(ctx.run_config),
        "series_id": getattr(ctx, "series_id", 0),
        "state": encode_records(ctx.state, prefix, blobs),
    }


def decode_context(spec: dict[str, Any], blobs: dict[str, Any]) -> Context:
    return Context(
        run_id=spec["run_id"],
        node_id=spec["node_id"],
        node_config=spec["node_config"],
        state=decode_records(spec["state"], blobs),
        run_config=spec["run_config"],
        series_id=spec.get("series_id", 0),
    )


def pack(spec: Any) -> bytes:
    return pickle.dumps(spec, protocol=5)


def unpack(data: Any) -> Any:
    return pickle.loads(data)


def releaser(held: list[Any]) -> Callable[[str, Any], None]:
    """A ``stage_releasing`` callback that removes an array's bytes from the records that
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
