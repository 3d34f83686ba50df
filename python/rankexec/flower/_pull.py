"""A message pulled from the SuperNode with its large arrays written straight into
memory files, chunk by chunk, instead of inflated in Python's heap.

Why: Flower's ``flwr-clientapp`` pulls every object of a message into a ``dict`` of
``bytes`` (one copy of the model), confirms, then inflates each ``Array`` by joining its
chunks into a ``bytearray`` and that into ``bytes`` (one more, and the chunks stay
until the whole message is inflated); rankexec's ``ClientApp`` then copies each array
into a memory file for the ranks. With the SuperNode's own copy (held until the
confirmation) a node held about four models on arrival (BENCHMARKS.md). Here each
chunk's body is written with ``pwrite`` into its array's place in a memory file the
moment it arrives and the chunk is let go of: the ``ClientApp`` process holds the model
once, in the memory files the ranks map, and the ``Array``'s ``data`` is a ``Blob`` of
them (rankexec's channel passes it by descriptor, nothing is copied again).

How: the message's objects above the chunks (the message, its records, each
``Array``'s metadata) are pulled level by level; the first chunk of the first
multi-chunk array gives the sender's chunk size (Flower cuts every array in chunks of
that size but the last), each multi-chunk array gets ``chunks x size`` bytes at a page
boundary of a memory file (the unwritten tail of the last chunk takes no memory), and
every chunk is pulled through Flower's own ``pull_objects`` (its concurrency, retries
and back-off) with a pull function that writes the body and returns ``b""``.
Single-chunk arrays (at most one chunk, 5 MB by default) and everything else are
inflated by Flower as usual.

Caveats: used by ``rankexec-flwr-clientapp`` (``rankexec.flower.superexec``), which a
site runs in place of Flower's ``flwr-clientapp``; the arrays' ``data`` is then a
read-only buffer, not ``bytes`` (every reader of Flower's takes it; code that needs
``bytes`` calls ``bytes(arr.data)``). A chunk whose size does not fit the layout (a
sender whose arrays were cut otherwise) makes the whole message be pulled again
Flower's way, before anything is confirmed: nothing is lost, only time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Array, ArrayRecord, Message
from flwr.app.message.arraychunk import ArrayChunk
from flwr.supercore.constant import HEAD_BODY_DIVIDER
from flwr.supercore.inflatable.inflatable_object import (
    get_object_head_values_from_object_content,
)
from flwr.supercore.inflatable.inflatable_utils import (
    inflate_object_from_contents,
    pull_and_inflate_object_from_tree,
    pull_objects,
)

from rankexec._rankexec import SharedBuffer, trim_heap
from rankexec._staging import page_offsets, parts_of

__all__ = ["LayoutMismatch", "pull_message"]

_ARRAY = Array.__qualname__
_CHUNK = ArrayChunk.__qualname__
_RECORD_HEAD = ArrayRecord.__qualname__.encode() + b" "


class LayoutMismatch(Exception):
    """A chunk did not fit the layout its first chunk promised."""


@dataclass
class _Array:
    object_id: str
    dtype: str
    shape: tuple[int, ...]
    stype: str
    chunks: list[str]  # chunk ids in order (one id may repeat)
    capacity: int = 0
    part: int = 0
    offset: int = 0
    last: int = -1  # the last chunk's size, once written


@dataclass
class _Layout:
    size: int  # the sender's chunk size
    arrays: list[_Array]
    buffers: list[SharedBuffer] = field(default_factory=list)
    # chunk id -> every (array, position) it fills
    dest: dict[str, list[tuple[_Array, int]]] = field(default_factory=dict)


def _body(content: bytes) -> memoryview:
    return memoryview(content)[content.find(HEAD_BODY_DIVIDER) + len(HEAD_BODY_DIVIDER) :]


def _structure(tree: Any, pull_fn: Any) -> tuple[dict[str, bytes], list[_Array]]:
    """Every object above the multi-chunk arrays' chunks, pulled level by level
    (Flower's ``pull_objects``), each once: their contents, and those arrays' metadata
    (a single-chunk array and its chunk are pulled here, as Flower would)."""
    contents: dict[str, bytes] = {}
    arrays: list[_Array] = []
    seen: set[str] = set()
    level = [tree]
    while level:
        ids = list(dict.fromkeys(t.object_id for t in level if t.object_id not in seen))
        seen.update(ids)
        got = pull_objects(ids, pull_fn)
        below: list[Any] = []
        for oid in ids:
            content = got.pop(oid)
            kind, children, _ = get_object_head_values_from_object_content(content)
            if kind == _ARRAY:
                meta = json.loads(bytes(_body(content)).decode("utf-8"))
                chunks = [children[i] for i in meta["arraychunk_ids"]]
                if len(chunks) > 1:
                    shape = tuple(int(d) for d in meta["shape"])
                    arrays.append(
                        _Array(oid, str(meta["dtype"]), shape, str(meta["stype"]), chunks)
                    )
                    continue  # its chunks go to a memory file
            contents[oid] = content
        for t in level:
            if t.object_id in contents:
                below.extend(c for c in t.children if c.object_id not in seen)
        level = below
    return contents, arrays


def _layout(arrays: list[_Array], size: int) -> _Layout:
    """Each array at a page boundary of one of at most 16 memory files, room for all its
    chunks at ``size`` bytes each."""
    lay = _Layout(size, arrays)
    for a in arrays:
        a.capacity = len(a.chunks) * size
    by_id = {a.object_id + f"#{i}": a for i, a in enumerate(arrays)}
    sizes = {k: a.capacity for k, a in by_id.items()}
    for part, names in enumerate(parts_of(sizes)):
        offsets, total = page_offsets({n: sizes[n] for n in names})
        lay.buffers.append(SharedBuffer(total))
        for n in names:
            by_id[n].part, by_id[n].offset = part, offsets[n]
    for a in arrays:
        for i, chunk in enumerate(a.chunks):
            lay.dest.setdefault(chunk, []).append((a, i))
    return lay


def _write(lay: _Layout, chunk_id: str, content: bytes) -> None:
    kind, _, _ = get_object_head_values_from_object_content(content)
    if kind != _CHUNK:
        raise LayoutMismatch(f"object {chunk_id} is a {kind}, not an array chunk")
    body = _body(content)
    n = len(body)
    for a, i in lay.dest[chunk_id]:
        last = i == len(a.chunks) - 1
        if n > lay.size or (not last and n != lay.size):
            raise LayoutMismatch(f"chunk {i} of an array is {n} bytes, not {lay.size}")
        lay.buffers[a.part].write_at(a.offset + i * lay.size, body)
        if last:
            a.last = n


def _arrays_of(lay: _Layout) -> dict[str, Array]:
    sealed = [b.seal() for b in lay.buffers]
    out: dict[str, Array] = {}
    for a in lay.arrays:
        nbytes = (len(a.chunks) - 1) * lay.size + a.last
        arr = Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=b"")
        # A read-only Blob of the memory file: every reader of Flower's takes a buffer,
        # and rankexec's channel passes it on by descriptor.
        arr.data = sealed[a.part].slice(a.offset, nbytes)  # type: ignore[assignment]
        out[a.object_id] = arr
    return out


def _lean(tree: Any, pull_fn: Any) -> tuple[dict[str, Array] | None, dict[str, bytes]]:
    contents, arrays = _structure(tree, pull_fn)
    if not arrays:
        return None, contents
    first = arrays[0].chunks[0]
    head = pull_objects([first], pull_fn)[first]
    lay = _layout(arrays, len(_body(head)))
    _write(lay, first, head)
    del head

    def pull_into_files(object_id: str) -> bytes:
        content = pull_fn(object_id)
        _write(lay, object_id, content)
        return b""  # what Flower's pull_objects keeps of it

    # A chunk pulled already (it is also a single-chunk array's) is written from there.
    for chunk in [c for c in lay.dest if c != first and c in contents]:
        _write(lay, chunk, contents[chunk])
    pull_objects([c for c in lay.dest if c != first and c not in contents], pull_into_files)
    trim_heap()  # the chunks' bytes, freed, are not kept by the C heap
    return _arrays_of(lay), contents


def pull_message(tree: Any, pull_fn: Any, confirm_fn: Any) -> tuple[Message, int]:
    """The message of ``tree``, its multi-chunk arrays in memory files (see the module
    docs), and the number of such arrays; Flower's own pull where the layout does not
    fit."""
    mismatch = None
    try:
        arrays, contents = _lean(tree, pull_fn)
    except LayoutMismatch as e:
        mismatch = str(e)  # the memory files go with the traceback, before Flower's pull
    if mismatch is not None:
        from logging import WARNING

        from flwr.supercore import log

        log(WARNING, "rankexec: %s; the message is pulled again Flower's way", mismatch)
        message = pull_and_inflate_object_from_tree(tree, pull_fn, confirm_fn, return_type=Message)
        return message, 0
    confirm_fn(tree.object_id)
    # Flower's inflation of the rest; each array in memory files is taken as it is.
    objects: dict[str, Any] = dict(arrays or {})
    if objects:
        _records_of(contents, objects)
    inflated = inflate_object_from_contents(tree.object_id, contents, objects=objects)
    return _checked(inflated), len(arrays or {})


def _records_of(contents: dict[str, bytes], objects: dict[str, Any]) -> None:
    """Each ``ArrayRecord`` that holds an array in memory files, built here and added to
    ``objects``: Flower's ``ArrayRecord.inflate`` rebuilds every ``Array`` through a
    constructor that takes ``bytes`` only. Its other arrays are inflated by Flower."""
    for oid in [o for o, c in contents.items() if c.startswith(_RECORD_HEAD)]:
        _, children, _ = get_object_head_values_from_object_content(contents[oid])
        if not any(c in objects for c in children):
            continue
        refs = json.loads(bytes(_body(contents.pop(oid))).decode("utf-8"))
        rec = ArrayRecord()
        for name, aid in refs.items():
            arr: Any = objects.get(aid)
            if arr is None:
                arr = inflate_object_from_contents(aid, contents, objects=objects)
            # One Array per key, sharing the data, as Flower's own inflation gives.
            each = Array(dtype=arr.dtype, shape=tuple(arr.shape), stype=arr.stype, data=b"")
            each.data = arr.data
            rec[str(name)] = each
        objects[oid] = rec


def _checked(obj: Any) -> Message:
    if not isinstance(obj, Message):
        raise TypeError(f"expected a Message, got a {type(obj).__name__}")
    return obj
