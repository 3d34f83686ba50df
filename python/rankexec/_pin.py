"""Host memory registered as pinned for the copies to a GPU: the machinery behind
`rankexec.tensors.to_device`.

Why: a copy from pageable memory goes through the driver's staging buffers (about
7 GB/s on an H100 host); from registered memory it is one DMA at the link's speed
(about 54 GB/s there; BENCHMARKS.md, "Host to device"). Registering is not free: the
kernel pins every page (0.15-0.23 s for 4 GiB), so the ranges are registered on
another thread and each tensor's copy is queued as soon as its own range is registered:
the pinning of the next ranges overlaps the DMA of the first. More registering threads
were slower on the H100 host measured (the pinning does not scale there).

Caveats:
- Ranges are cut at tensor boundaries only (pages two tensors share go in one range):
  a copy never spans two registrations, and one large tensor is pinned before any of
  its bytes are copied.
- The calls go through the process's own `libcudart` (found among its mappings, so it
  is the instance torch uses) with `ctypes`, which lets go of the GIL while it pins;
  torch's bindings hold it. Where that library is not found, torch's bindings are used
  (then the copies wait for the pinning).
- Registration is undone once the copies are done: nothing stays pinned.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

#: cudaHostRegisterPortable | cudaHostRegisterReadOnly: pinned for every context, and
#: without asking for write access (a received memory file is mapped read-only).
REGISTER_FLAGS = 1 | 8


class PinError(RuntimeError):
    """`to_device(..., pin=True)` could not register the tensors' memory as pinned."""


class Cudart(Protocol):
    """The two CUDA runtime calls used here (torch's `torch.cuda.cudart()` has them)."""

    def cudaHostRegister(self, addr: int, length: int, flags: int) -> Any: ...

    def cudaHostUnregister(self, addr: int) -> Any: ...


class _LibCudart:
    """`cudaHostRegister`/`cudaHostUnregister` of an already loaded `libcudart`."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)  # the loaded one: dlopen of its own path
        self._register = lib.cudaHostRegister
        self._register.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
        self._register.restype = ctypes.c_int
        self._unregister = lib.cudaHostUnregister
        self._unregister.argtypes = (ctypes.c_void_p,)
        self._unregister.restype = ctypes.c_int

    def cudaHostRegister(self, addr: int, length: int, flags: int) -> int:
        return int(self._register(addr, length, flags))

    def cudaHostUnregister(self, addr: int) -> int:
        return int(self._unregister(addr))


def loaded_cudart(fallback: Cudart) -> Cudart:
    """The process's loaded `libcudart` through ctypes, else `fallback`."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "libcudart.so" in line}
    except OSError:
        return fallback
    for path in sorted(paths):
        if os.path.isabs(path):
            try:
                return _LibCudart(path)
            except (OSError, AttributeError):
                continue
    return fallback


def code_of(err: Any) -> int:
    """A CUDA error as an int (torch's bindings return an enum)."""
    return int(getattr(err, "value", err))


def _is_torch(t: Any) -> bool:
    return type(t).__module__.startswith("torch")


def _span(t: Any) -> tuple[int, int]:
    """The bytes `t` reads: its own for a contiguous tensor, its storage's otherwise."""
    if t.is_contiguous():
        start = t.data_ptr()
        return start, start + t.numel() * t.element_size()
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def groups(tensors: Mapping[str, Any]) -> list[tuple[int, int, list[str]]]:
    """The page-aligned `(address, length, names)` ranges holding the CPU tensors'
    bytes, in address order. Ranges that would share a page are merged (CUDA refuses to
    register a page twice); others stay apart, so each can be registered on its own."""
    spans = []
    for name, t in tensors.items():
        if not _is_torch(t) or t.device.type != "cpu" or t.numel() == 0:
            continue
        start, end = _span(t)
        page = mmap.PAGESIZE
        spans.append((start - start % page, -(-end // page) * page, name))
    merged: list[tuple[int, int, list[str]]] = []
    for start, end, name in sorted(spans):
        if merged and start < merged[-1][1]:
            a, b, names = merged[-1]
            merged[-1] = (a, max(b, end), [*names, name])
        else:
            merged.append((start, end, [name]))
    return [(a, b - a, names) for a, b, names in merged]


def refusal(addr: int, length: int, code: int) -> str:
    return f"cudaHostRegister of {length} bytes at {addr:#x} failed with CUDA error {code}"


def copy_pinned(
    tensors: Mapping[str, Any],
    api: Cudart,
    copy: Callable[[Any], Any],
    finish: Callable[[], None],
    *,
    strict: bool,
    threads: int,
    bind: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Each tensor through `copy` (a non-blocking copy to the device) once its range is
    registered, the ranges registered by `threads` threads in address order; `finish`
    waits for the copies, then every registration is undone. A refused range: with
    `strict`, `PinError` (after undoing the others); else its tensors are copied from
    pageable memory. Tensors not in host memory are copied as they are. `bind` runs
    first on each thread (makes the copies' device current there)."""
    ranges = groups(tensors)
    out: dict[str, Any] = {}
    refused: list[str] = []
    with ThreadPoolExecutor(max(1, min(threads, len(ranges))), initializer=bind) as pool:
        futures: list[Future[Any]] = [
            pool.submit(api.cudaHostRegister, a, n, REGISTER_FLAGS) for a, n, _ in ranges
        ]
        try:
            for (addr, length, names), fut in zip(ranges, futures, strict=True):
                code = code_of(fut.result())
                if code != 0:
                    refused.append(refusal(addr, length, code))
                if refused and strict:
                    continue  # no more copies: the call fails once all are undone
                for name in names:
                    out[name] = copy(tensors[name])
            if not (refused and strict):
                for name, t in tensors.items():
                    if name not in out:
                        out[name] = copy(t)
        finally:
            try:
                finish()  # the copies read the pages until here
            finally:
                _undo(ranges, futures, api)
    if refused and strict:
        raise PinError(refused[0])
    return {name: out[name] for name in tensors}


def _undo(
    ranges: list[tuple[int, int, list[str]]], futures: list[Future[Any]], api: Cudart
) -> None:
    """Unregisters every range whose registration succeeded (waiting for those still
    under way, so that none is left pinned)."""
    for (addr, _, _), fut in zip(ranges, futures, strict=True):
        try:
            ok = code_of(fut.result()) == 0
        except Exception:  # noqa: BLE001 - a registration that raised registered nothing
            ok = False
        if ok:
            api.cudaHostUnregister(addr)
