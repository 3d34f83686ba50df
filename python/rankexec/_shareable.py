"""`Shareable`: a task's input or output (metadata plus named blobs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["Shareable", "byte_view"]


class Shareable:
    """Metadata (`meta`: plain values) and named binary blobs (`blobs`).

    In an input, every blob is a read-only `rankexec.Blob` over shared memory. In an
    output, a blob may be a `Blob` (forwarded without a copy), a `SharedBuffer`
    (filled in place, sent without a copy), a numpy array, a torch tensor, or any
    contiguous buffer (copied once).
    """

    __slots__ = ("blobs", "meta")

    def __init__(
        self, meta: Mapping[str, Any] | None = None, blobs: Mapping[str, Any] | None = None
    ) -> None:
        self.meta: dict[str, Any] = dict(meta or {})
        self.blobs: dict[str, Any] = dict(blobs or {})

    def __repr__(self) -> str:
        return f"Shareable(meta={self.meta!r}, blobs={sorted(self.blobs)!r})"


def byte_view(obj: Any, name: str) -> memoryview:
    """A one-dimensional byte view of `obj` (numpy array, torch tensor, buffer)."""
    mod = type(obj).__module__
    if mod.startswith("torch"):
        import torch

        # As bytes, whatever the dtype: numpy has no bfloat16 or float8, and a raw blob
        # is bytes anyway (its dtype travels in the metadata, if at all).
        t = obj.detach().cpu().contiguous().reshape(-1)
        if t.dtype.is_complex:
            t = t.view(t.real.dtype)  # view() to uint8 refuses complex; its parts first
        obj = t.view(torch.uint8).numpy()
    try:
        view = memoryview(obj)
    except TypeError as e:
        raise TypeError(
            f"blob {name!r}: a {type(obj).__name__} is not a buffer "
            "(use bytes, a numpy array, a torch tensor or a SharedBuffer)"
        ) from e
    if not view.c_contiguous:
        import numpy as np

        view = memoryview(np.ascontiguousarray(obj))  # type: ignore[arg-type]
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view
