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

``stage_in_parts`` does the same in parts (``parts_of``: at most 16 files of at least
64 MiB), up to four parts at once, each written by a thread of its own: a memory file
takes one write at a time (the kernel locks it for each ``pwrite``), several files do
not (BENCHMARKS.md, "Several files at once"), and a model in several files is let go
of one part at a time. FLARE's ``ScriptExecutor`` and Flower's ``ClientApp`` and rank 0
stage this way.

Caveats: a buffer that someone else still references (the caller kept the tensor) is
copied all the same and freed only when they let go; blobs under ``threshold`` are
left as they are (``execute`` copies them inline). ``stage_in_parts`` calls
``release`` from its threads, one call at a time.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rankexec._rankexec import SharedBuffer, trim_heap

__all__ = [
    "MAX_PARTS",
    "PART_MIN",
    "STAGE_FROM",
    "page_offsets",
    "parts_of",
    "stage_in_parts",
    "stage_releasing",
]

#: Buffers of this size and up go to the memory file.
STAGE_FROM = 1 << 20
_PAGE = mmap.PAGESIZE
#: Bytes released between two trims of the C heap.
_TRIM_EVERY = 64 << 20
#: A model is staged in at most this many memory files (``parts_of``), far under the
#: 64 descriptors a frame may pass.
MAX_PARTS = 16
#: ... each of at least this many bytes (the last may be smaller).
PART_MIN = 64 << 20
#: Parts staged at once (``stage_in_parts``).
_STAGE_THREADS = 4


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


def _large(blobs: dict[str, Any], threshold: int) -> dict[str, int]:
    """The sizes of ``blobs``' C-contiguous buffers of ``threshold`` bytes and up, in
    order (a ``Blob`` or ``HostBlob`` is in a sealed memory file already: ``execute``
    passes it on as it is)."""
    sizes: dict[str, int] = {}
    for name, value in blobs.items():
        if type(value).__name__ in ("Blob", "HostBlob"):
            continue
        try:
            view = memoryview(value)
        except TypeError:
            continue
        with view:
            if view.nbytes >= threshold and view.c_contiguous:
                sizes[name] = view.nbytes
    return sizes


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
    sizes = _large(blobs, threshold)
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


def parts_of(
    sizes: Mapping[str, int], max_parts: int = MAX_PARTS, least: int = PART_MIN
) -> list[list[str]]:
    """``sizes``' names (in order) in consecutive groups of at least ``max(least,
    total / max_parts)`` bytes each (the last may be smaller): at most ``max_parts``
    groups, each of which gets a memory file of its own. A model in several files can
    be let go of one part at a time (a sealed file's pages go only with the whole
    file), and a tensor the script keeps after ``send()`` keeps its part alive, not
    the whole model."""
    total = sum(sizes.values())
    each = max(least, -(-total // max(1, max_parts)))
    groups: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, size in sizes.items():
        current.append(name)
        filled += size
        if filled >= each:
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    return groups


def stage_in_parts(
    blobs: dict[str, Any],
    threshold: int = STAGE_FROM,
    release: Callable[[str, Any], None] | None = None,
) -> None:
    """``stage_releasing`` in parts (see the module docs): ``blobs``' buffers of
    ``threshold`` bytes and up go to sealed memory files, one per group of
    ``parts_of``, up to four written at once; each buffer is let go of as soon as it is
    copied (``release(name, buffer)`` as in ``stage_releasing``, one call at a time).
    ``blobs`` keeps its order. A failure in any part raises once every part is done."""
    sizes = _large(blobs, threshold)
    if not sizes:
        return
    order = list(blobs)
    lock = threading.Lock()

    def released(name: str, source: Any) -> None:
        if release is not None:
            with lock:
                release(name, source)

    def stage(part: dict[str, Any]) -> None:
        stage_releasing(part, threshold, released)

    # The only references now (the caller's dict lets go of them here).
    parts = [{name: blobs.pop(name) for name in group} for group in parts_of(sizes)]
    try:
        if len(parts) > 1:
            with ThreadPoolExecutor(min(_STAGE_THREADS, len(parts)), "rx-stage") as pool:
                for _ in pool.map(stage, parts):
                    pass
        else:
            stage(parts[0])
    finally:
        # Staged or not, every buffer goes back under its name, in the caller's order.
        for part in parts:
            blobs.update(part)
        staged = {name: blobs[name] for name in order}
        blobs.clear()
        blobs.update(staged)
