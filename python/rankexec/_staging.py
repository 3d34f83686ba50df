"""Moving a large input into shared memory one tensor at a time, letting go of each
source as soon as it is copied: the process never holds the model twice.

``RankGroup.execute`` copies every buffer it is given into one memory file and only then
lets go of them (``consume=True``): for the time of the copy the input exists twice.
``stage_releasing`` does the copy before ``execute`` instead: it allocates one memory
file (``SharedBuffer``: its pages are allocated as they are written), copies each large
buffer to its page-aligned offset with ``SharedBuffer.write_at`` (``pwrite``: no page
fault per 4 KiB page, about half the time of a copy through a fresh mapping here), replaces the buffer in the caller's dict at once
(the dict held the only reference to a decoded tensor: it is freed there and then),
trims the C heap as it goes (``trim_heap``: freed tensors under glibc's mmap threshold
stay resident otherwise), seals the file and leaves a ``Blob`` slice of it in the dict
for each name, which ``execute`` passes to the ranks as it is (no second copy).

Caveats: a buffer that someone else still references (the caller kept the tensor) is
copied all the same and freed only when they let go; blobs under ``threshold`` are
left as they are (``execute`` copies them inline).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any

from rankexec._rankexec import SharedBuffer, trim_heap

__all__ = ["STAGE_FROM", "page_offsets", "stage_releasing"]

#: Buffers of this size and up go to the memory file.
STAGE_FROM = 1 << 20
_PAGE = mmap.PAGESIZE
#: Bytes released between two trims of the C heap.
_TRIM_EVERY = 64 << 20


def page_offsets(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Where each buffer of ``sizes`` starts in one memory file (each at a page
    boundary, so a rank can map it on its own) and the file's size."""
    offsets: dict[str, int] = {}
    total = 0
    for name, size in sizes.items():
        total = -(-total // _PAGE) * _PAGE
        offsets[name] = total
        total += size
    return offsets, total


def stage_releasing(
    blobs: dict[str, Any],
    threshold: int = STAGE_FROM,
    release: Callable[[str, Any], None] | None = None,
) -> int:
    """Replaces each buffer of ``threshold`` bytes and up in ``blobs`` by a read-only
    ``rankexec.Blob`` of one sealed memory file, copying and letting go of them one at a
    time (see the module docs). ``release(name, buffer)``, when given, is called once
    each buffer is copied, to drop the caller's other references to it (a Flower
    ``ArrayRecord`` that holds the same bytes). Returns the memory file's size (0 when
    nothing was large enough)."""
    sizes = {}
    for name, value in blobs.items():
        if type(value).__name__ in ("Blob", "HostBlob"):
            continue  # already in a sealed memory file: execute passes it on as it is
        try:
            view = memoryview(value)
        except TypeError:
            continue
        with view:
            if view.nbytes >= threshold and view.c_contiguous:
                sizes[name] = view.nbytes
    if not sizes:
        return 0
    offsets, total = page_offsets(sizes)
    buf = SharedBuffer(total)
    released = 0
    for name, size in sizes.items():
        source = blobs[name]
        # pwrite, not a copy through the mapping: no page fault per 4 KiB page
        # (SharedBuffer.write_at).
        buf.write_at(offsets[name], source)
        blobs[name] = None  # the only reference to the source, usually: freed now
        if release is not None:
            release(name, source)
        del source
        released += size
        if released >= _TRIM_EVERY:
            trim_heap()
            released = 0
    trim_heap()
    sealed = buf.seal()
    for name, size in sizes.items():
        blobs[name] = sealed.slice(offsets[name], size)
    return total
