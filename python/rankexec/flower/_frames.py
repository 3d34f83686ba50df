"""The frames of the local channel between Flower's ClientApp processes and the node's
host (``_channel``): how an object travels, and the limits a received frame is held to.

Why a module of its own: a frame is where a peer's bytes turn into the host's objects,
so what it may carry and what it may cost are one concern, apart from the folders and
the handshake (``_channel``, which re-exports ``send``, ``recv``, the limits and the
errors). The errors live here, the lowest of the two modules.

Frames carry plain data, never code: a JSON header (dicts, lists, strings, numbers,
booleans, null) whose buffers travel apart, named in it by index (``{"$buf": i}``; a
``bytes`` value is ``{"$bytes": i}``, a map with keys that are not strings
``{"$map": [[k, v], ...]}``). Nothing received is unpickled: a header that is not this
JSON is refused (``FrameRefused``, naming the format), and a value that is not JSON or a
buffer cannot be sent. A buffer of at least ``SHARE_FROM`` bytes travels as a sealed
memory file passed with ``SCM_RIGHTS`` (the ClientApp copies its message's arrays once
into one file, which the host hands to the ranks as it is; rank 0's result file comes
back to the ClientApp the same way, mapped, not copied), a smaller one as raw bytes
after the header.

Frame layout: ``<QQQ`` (header length, buffer count, descriptor count), then a
``<QqQ`` per buffer (length, descriptor index or -1 for raw bytes, offset in the
file), the header, then the raw buffers in order; the descriptors come with the first
bytes.

Limits (a frame over one is refused with ``FrameRefused``, naming it): the header is at
most ``MAX_HEAD`` bytes (it holds a request's structure, the arrays travel as buffers)
and nests at most ``_MAX_DEPTH`` levels when sent, a raw buffer is under ``SHARE_FROM``
bytes (larger ones must travel as memory files), and a frame has at most
``MAX_BUFFERS`` buffers. What a
frame declares is never allocated ahead of its bytes: the receiver grows each part by
``_CHUNK`` as the bytes arrive, so a peer that declares much and sends little costs
what it sent. ``recv`` (and ``_channel.accept_auth``) take a deadline for the whole exchange.

Caveats: ``send`` copies a large buffer that is not in a memory file yet into one
(``rankexec._rankexec.share``) before it travels; a frame passes at most ``MAX_FDS``
memory files. Linux only (sealed memory files passed with ``SCM_RIGHTS``).
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import time
from typing import Any

__all__ = [
    "MAX_BUFFERS",
    "MAX_FDS",
    "MAX_HEAD",
    "SHARE_FROM",
    "ChannelError",
    "FrameRefused",
    "PeerRefused",
    "recv",
    "recv_exact",
    "send",
    "set_deadline",
]


class ChannelError(ConnectionError):
    """The host cannot be reached, refused us, or broke the protocol."""


class FrameRefused(ChannelError):
    """A frame declares more than the channel's limits allow (the limit is named)."""


class PeerRefused(ChannelError):
    """The peer's credentials (``SO_PEERCRED``: pid, uid, gid) are not allowed; the
    message names them."""


#: What a frame's parts grow by as their bytes arrive (never allocated ahead of them).
_CHUNK = 1 << 20


def set_deadline(sock: socket.socket, deadline: float | None, what: str) -> None:
    """Gives the next socket call the time left before ``deadline`` (none: leaves the
    socket's timeout as it is)."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise ChannelError(f"{what} did not arrive within its deadline")
    sock.settimeout(left)


def recv_exact(
    sock: socket.socket, n: int, deadline: float | None = None, what: str = "a frame"
) -> bytearray:
    """Exactly ``n`` bytes, by ``deadline`` (``time.monotonic()``) when one is given. The
    buffer grows by ``_CHUNK`` as bytes arrive: ``n`` is what the peer declared, not
    what it sent."""
    buf = bytearray(min(n, _CHUNK))
    got = 0
    while got < n:
        if got == len(buf):
            buf.extend(bytes(min(n - got, _CHUNK)))
        set_deadline(sock, deadline, what)
        try:
            k = sock.recv_into(memoryview(buf)[got:], len(buf) - got)
        except TimeoutError as e:
            raise ChannelError(f"{what} did not arrive within its deadline") from e
        if k == 0:
            raise ChannelError("the peer closed the channel")
        got += k
    return buf


#: Buffers at least this large travel as memory files.
SHARE_FROM = 64 << 10
#: The most descriptors one frame passes (the kernel's SCM_MAX_FD is 253).
MAX_FDS = 64
#: The largest JSON header a frame may carry. A request's header holds its structure
#: (op, run id, the app's name, its requests, the message's metadata and records but
#: not their arrays): a few KiB; the arrays travel as buffers.
MAX_HEAD = 16 << 20
#: The deepest a frame's values nest.
_MAX_DEPTH = 64
#: The most buffers one frame may carry.
MAX_BUFFERS = 1 << 20
_FIXED = struct.Struct("<QQQ")
_DESC = struct.Struct("<QqQ")


def _owner(view: memoryview) -> Any:
    """The object exporting ``view``'s memory (through nested memoryviews)."""
    obj: Any = view
    while isinstance(obj, memoryview):
        obj = obj.obj
    return obj


def _memfd(obj: Any) -> tuple[int, int] | None:
    """(descriptor, offset) of a rankexec blob backed by a memory file, else None."""
    fd = getattr(obj, "fileno", None)
    if isinstance(fd, int) and type(obj).__module__.startswith("rankexec"):
        return fd, int(obj.offset)
    return None


def _flatten(obj: Any, bufs: list[Any], depth: int = 0) -> Any:
    """``obj`` as JSON values, its buffers appended to ``bufs`` and named by index:
    ``{"$buf": i}`` (a buffer: ``PickleBuffer``, ``memoryview``, ``bytearray``, a rankexec
    blob), ``{"$bytes": i}`` (a ``bytes`` value, received as ``bytes``), ``{"$map":
    [[key, value], ...]}`` (a dict whose keys are not all strings, or one of which starts
    with ``$``). Anything else that is not a JSON value is refused: no object travels."""
    if depth > _MAX_DEPTH:
        raise ChannelError(f"a frame nests deeper than {_MAX_DEPTH} levels")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, bytes):
        bufs.append(pickle.PickleBuffer(obj))
        return {"$bytes": len(bufs) - 1}
    if isinstance(obj, (pickle.PickleBuffer, memoryview, bytearray)) or (
        type(obj).__module__.startswith("rankexec") and hasattr(obj, "fileno")
    ):
        bufs.append(obj if isinstance(obj, pickle.PickleBuffer) else pickle.PickleBuffer(obj))
        return {"$buf": len(bufs) - 1}
    if isinstance(obj, (list, tuple)):
        return [_flatten(x, bufs, depth + 1) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _flatten(v, bufs, depth + 1) for k, v in obj.items()}
        return {
            "$map": [
                [_flatten(k, bufs, depth + 1), _flatten(v, bufs, depth + 1)] for k, v in obj.items()
            ]
        }
    raise ChannelError(
        f"a {type(obj).__name__} cannot travel on the channel (JSON values and buffers only)"
    )


def send(sock: socket.socket, obj: Any) -> None:
    """Sends ``obj``: JSON values (dicts, lists, strings, numbers, booleans, None) whose
    buffers and ``bytes`` travel apart (see the module docs)."""
    from rankexec._rankexec import share

    buffers: list[pickle.PickleBuffer] = []
    head = json.dumps(_flatten(obj, buffers), separators=(",", ":")).encode()
    if len(head) > MAX_HEAD:
        raise FrameRefused(
            f"a frame's header of {len(head)} bytes is over the limit of {MAX_HEAD} bytes"
            f" ({_mib(MAX_HEAD)}, rankexec.flower._channel.MAX_HEAD)"
        )
    raws = [b.raw() for b in buffers]
    owners = [_owner(r) for r in raws]
    # Large buffers that are not in a memory file yet go into one, together.
    copy = [i for i, r in enumerate(raws) if r.nbytes >= SHARE_FROM and _memfd(owners[i]) is None]
    if copy:
        for i, blob in zip(copy, share([raws[i] for i in copy]), strict=True):
            owners[i] = blob
    fds: list[int] = []
    descs: list[tuple[int, int, int]] = []
    for r, owner in zip(raws, owners, strict=True):
        where = _memfd(owner) if r.nbytes >= SHARE_FROM or _memfd(owner) else None
        if where is None:
            descs.append((r.nbytes, -1, 0))
            continue
        fd, offset = where
        if fd not in fds:
            fds.append(fd)
        descs.append((r.nbytes, fds.index(fd), offset))
    if len(fds) > MAX_FDS:
        raise ChannelError(f"{len(fds)} memory files in one frame, more than {MAX_FDS}")
    header = (
        _FIXED.pack(len(head), len(raws), len(fds)) + b"".join(_DESC.pack(*d) for d in descs) + head
    )
    view = memoryview(header)
    if fds:
        # The descriptors ride on the first bytes; the rest follows as a stream.
        sent = socket.send_fds(sock, [view], fds)
        view = view[sent:]
    if view.nbytes:
        sock.sendall(view)
    for r, (_, index, _) in zip(raws, descs, strict=True):
        if index < 0:
            sock.sendall(r)
    del owners  # the memory files stay open until they were sent


def _recv_fixed(sock: socket.socket, deadline: float | None) -> tuple[bytes, list[int]]:
    """The fixed part of a frame and the descriptors that came with it."""
    set_deadline(sock, deadline, "a frame")
    try:
        msg, fds, flags, _ = socket.recv_fds(
            sock, _FIXED.size, MAX_FDS + 1, getattr(socket, "MSG_CMSG_CLOEXEC", 0)
        )
    except TimeoutError as e:
        raise ChannelError("a frame did not arrive within its deadline") from e
    if flags & getattr(socket, "MSG_CTRUNC", 0):
        for fd in fds:
            os.close(fd)
        raise ChannelError("more memory files than a frame may pass")
    if not msg:
        for fd in fds:
            os.close(fd)
        raise ChannelError("the peer closed the channel")
    if len(msg) < _FIXED.size:
        try:
            msg += bytes(recv_exact(sock, _FIXED.size - len(msg), deadline))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
    return msg, list(fds)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


def recv(sock: socket.socket, deadline: float | None = None) -> Any:
    """One frame's object. ``deadline`` (``time.monotonic()``) bounds the whole frame;
    a frame over the channel's limits raises ``FrameRefused`` before anything of it is
    allocated."""
    from rankexec._rankexec import Blob

    fixed, fds = _recv_fixed(sock, deadline)
    try:
        n_head, n_bufs, n_fds = _FIXED.unpack(fixed)
        if n_fds != len(fds):
            raise ChannelError(
                f"malformed frame ({n_bufs} buffers, {n_fds} memory files declared, "
                f"{len(fds)} passed)"
            )
        if n_head > MAX_HEAD:
            raise FrameRefused(
                f"a frame declares a header of {n_head} bytes; the limit is {MAX_HEAD}"
                f" bytes ({_mib(MAX_HEAD)}, rankexec.flower._channel.MAX_HEAD)"
            )
        if n_bufs > MAX_BUFFERS:
            raise FrameRefused(
                f"a frame declares {n_bufs} buffers; the limit is {MAX_BUFFERS}"
                " (rankexec.flower._channel.MAX_BUFFERS)"
            )
        descs: list[tuple[int, int, int]] = []
        for _ in range(n_bufs):
            size, index, offset = _DESC.unpack(recv_exact(sock, _DESC.size, deadline))
            if index < 0 and size >= SHARE_FROM:
                raise FrameRefused(
                    f"a frame declares a raw buffer of {size} bytes; raw buffers are under"
                    f" {SHARE_FROM} bytes ({_mib(SHARE_FROM)},"
                    " rankexec.flower._channel.SHARE_FROM): larger ones travel as memory files"
                )
            descs.append((size, index, offset))
        head = recv_exact(sock, n_head, deadline)
        # Each file is mapped once, its buffers are slices of that mapping.
        parts: dict[int, list[tuple[int, int]]] = {}
        for size, index, offset in descs:
            if index >= len(fds):
                raise ChannelError(f"a buffer names memory file {index} of {len(fds)}")
            if index >= 0:
                parts.setdefault(index, []).append((offset, size))
        if len(parts) != len(fds):
            raise ChannelError(f"{len(fds) - len(parts)} memory files arrived that no buffer uses")
        mapped: dict[int, list[Any]] = {}
        for index, wanted in parts.items():
            try:
                mapped[index] = Blob.from_fd_parts(fds[index], wanted)
            except OSError as e:
                raise ChannelError(f"a memory file was refused: {e}") from e
        bufs: list[Any] = []
        for size, index, _ in descs:
            bufs.append(recv_exact(sock, size, deadline) if index < 0 else mapped[index].pop(0))
    finally:
        for fd in fds:  # the blobs hold their own duplicates
            os.close(fd)
    return _decode(head, bufs)


def _decode(head: bytearray, bufs: list[Any]) -> Any:
    """A frame's header read as JSON, its buffer references replaced by the buffers
    (see ``_flatten``); never anything else: a header that is not this channel's JSON
    is refused (``FrameRefused``, naming the format)."""
    used: set[int] = set()

    def buffer(i: Any) -> Any:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(bufs) or i in used:
            raise FrameRefused(f"the frame's header names buffer {i!r} of {len(bufs)}")
        used.add(i)
        return bufs[i]

    def hook(d: dict[str, Any]) -> Any:
        special = [k for k in d if k.startswith("$")]
        if not special:
            return d
        if len(d) != 1:
            raise FrameRefused(f"the frame's header holds a malformed object (keys {special})")
        if "$buf" in d:
            return buffer(d["$buf"])
        if "$bytes" in d:
            return bytes(buffer(d["$bytes"]))
        pairs = d.get("$map")
        if isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 for p in pairs):
            try:
                return dict(pairs)
            except TypeError as e:
                raise FrameRefused(f"the frame's header holds a malformed map: {e}") from e
        raise FrameRefused(f"the frame's header holds an unknown tag {special[0]!r}")

    try:
        text = bytes(head).decode("utf-8")
        obj = json.loads(text, object_hook=hook)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FrameRefused(
            "the frame's header is not JSON: this channel carries a JSON header and"
            f" buffers, never a pickle or any other code ({type(e).__name__}: {e})"
        ) from None
    if len(used) != len(bufs):
        raise FrameRefused(f"{len(bufs) - len(used)} buffers arrived that the header does not name")
    return obj
