"""Tensors in blobs, without copies on the way in.

- `pack(tensors, metadata)`: a dict of numpy arrays or torch tensors (a `state_dict`)
  into one `SharedBuffer` in safetensors layout (the model persistor's format: an
  8-byte little-endian header length, a JSON header, the raw tensors). Each tensor is
  copied once, straight into shared memory.
- `unpack(blob, framework)`: the tensors back as views of the blob's memory (no copy).
  numpy views are read-only unless `writable=True`; torch views are copy-on-write by
  default (torch has no read-only tensors, and a write into a read-only mapping would
  crash the rank).
- `to_blobs(state_dict)` / `from_blobs(blobs, like)`: one float32 blob per tensor, the
  form FedAvg averages (the server averages every blob as float32).
- `to_device(tensors, device)`: torch tensors to a CUDA device, the memory they live in
  (a received memory file's mapping, usually) registered as pinned memory for the copy
  (`cudaHostRegister`, read-only) so it runs at the card's host-to-device bandwidth
  rather than through the driver's pageable staging; `pin=False` or
  `RANKEXEC_PIN_HOST=0` opts out, and where registration is refused (no CUDA, a driver
  without read-only registration, memory already registered) the copy is the plain
  pageable one. `PinError` (with `pin=True`) says why it was refused.

Caveat of `to_device`: registering pins every page of the ranges (and faults them in):
about 0.15-0.23 s for 4 GiB, so ranges (one per tensor) are registered on a thread of
their own while the first ones' copies run; it is undone as soon as the copies are
done, so nothing stays pinned (`rankexec._pin` says how).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from rankexec import _pin
from rankexec._pin import PinError
from rankexec._rankexec import Blob, SharedBuffer

#: Threads that register host memory in `to_device` while the copies run. One: on the
#: H100 host measured, 4 threads pinned a 4 GiB state dict slower than one (the kernel's
#: pinning does not scale there; BENCHMARKS.md, "Host to device").
_PIN_THREADS = 1

__all__ = ["PinError", "from_blobs", "metadata", "pack", "to_blobs", "to_device", "unpack"]

_NP = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_NP_NAME = {np.dtype(v): k for k, v in _NP.items()}
_TORCH_NAME = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _raw(x: Any) -> tuple[str, list[int], np.ndarray]:
    """(dtype name, shape, a flat uint8 view of the tensor's bytes)."""
    if _is_torch(x):
        t = x.detach().cpu().contiguous()
        name = _TORCH_NAME.get(str(t.dtype).removeprefix("torch."))
        if name is None:
            raise TypeError(f"unsupported torch dtype {t.dtype}")
        import torch

        return name, list(t.shape), t.reshape(-1).view(torch.uint8).numpy()
    a = np.ascontiguousarray(x)
    name = _NP_NAME.get(a.dtype.newbyteorder("=") if a.dtype.byteorder == ">" else a.dtype)
    if name is None:
        raise TypeError(f"unsupported numpy dtype {a.dtype}")
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return name, list(a.shape), a.reshape(-1).view(np.uint8)


def pack(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> SharedBuffer:
    """Packs `tensors` into one shared buffer in safetensors layout."""
    raws = {name: _raw(t) for name, t in sorted(tensors.items())}
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, (dtype, shape, data) in raws.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + data.size],
        }
        offset += data.size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    base = 8 + len(text)
    buf = SharedBuffer(base + offset)
    buf.write_at(0, len(text).to_bytes(8, "little") + text)
    for name, (_, _, data) in raws.items():
        # pwrite, not a copy through the mapping: no page fault per 4 KiB page.
        buf.write_at(base + header[name]["data_offsets"][0], data)
    return buf


def _header(blob: Any) -> tuple[dict[str, Any], int]:
    view = memoryview(blob)
    if view.nbytes < 8:
        raise ValueError("not a safetensors blob: shorter than its header length")
    n = int.from_bytes(view[:8], "little")
    if 8 + n > view.nbytes:
        raise ValueError(f"not a safetensors blob: header of {n} bytes in {view.nbytes}")
    return json.loads(bytes(view[8 : 8 + n])), 8 + n


def metadata(blob: Blob | SharedBuffer | bytes) -> dict[str, str]:
    """The `__metadata__` of a packed blob."""
    return dict(_header(blob)[0].get("__metadata__", {}))


def unpack(
    blob: Blob | SharedBuffer | bytes, framework: str = "numpy", *, writable: bool | None = None
) -> dict[str, Any]:
    """The tensors of a packed blob, as views of its memory (no copy).

    `framework` is `"numpy"` or `"torch"`. `writable` (default: False for numpy, True
    for torch) makes the views copy-on-write: writes stay in this process.
    """
    if framework not in ("numpy", "torch"):
        raise ValueError(f"framework must be 'numpy' or 'torch', not {framework!r}")
    if writable is None:
        writable = framework == "torch"
    header, base = _header(blob)
    src: Any = blob
    if writable:
        src = blob.copy_on_write() if isinstance(blob, Blob) else bytearray(blob)
    out: dict[str, Any] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        dtype = info["dtype"]
        if framework == "numpy":
            if dtype not in _NP:
                raise TypeError(f"{name}: dtype {dtype} has no numpy equivalent")
            dt = np.dtype(_NP[dtype])
            count = (end - begin) // dt.itemsize
            out[name] = np.frombuffer(src, dtype=dt, count=count, offset=base + begin).reshape(
                shape
            )
        else:
            out[name] = _torch_view(src, dtype, shape, base + begin, end - begin)
    return out


def _torch_view(src: Any, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int) -> Any:
    import torch

    tdt = getattr(torch, {v: k for k, v in _TORCH_NAME.items()}[dtype])
    if nbytes == 0:
        return torch.empty(shape, dtype=tdt)
    with warnings.catch_warnings():
        # Read-only sources are only used when the caller asked for writable=False.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(src, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(tdt).reshape(shape)


def to_blobs(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """One float32 little-endian blob per tensor (what FedAvg averages); large ones are
    written straight into shared memory."""
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        a = t.detach().cpu().float().numpy() if _is_torch(t) else np.asarray(t, np.float32)
        a = np.ascontiguousarray(a, dtype="<f4").reshape(-1)
        if a.nbytes >= 64 << 10:
            buf = SharedBuffer(a.nbytes)
            buf.write_at(0, a)  # pwrite: no page fault per 4 KiB page
            out[name] = buf
        else:
            out[name] = a
    return out


def from_blobs(blobs: Mapping[str, Any], like: Mapping[str, Any]) -> dict[str, Any]:
    """Tensors shaped (and typed) like `like` from float32 blobs, e.g. to pass to
    `model.load_state_dict`. Missing names are left out."""
    out: dict[str, Any] = {}
    for name, ref in like.items():
        if name not in blobs:
            continue
        a = np.frombuffer(blobs[name], dtype="<f4")
        if _is_torch(ref):
            import torch

            out[name] = torch.from_numpy(a.reshape(tuple(ref.shape)).copy()).to(ref.dtype)
        else:
            out[name] = a.reshape(np.shape(ref)).astype(np.asarray(ref).dtype)
    return out


def pinned_ranges(tensors: Mapping[str, Any]) -> list[tuple[int, int]]:
    """The page-aligned `(address, length)` ranges `to_device` registers for the CPU
    tensors' bytes, in address order: one per tensor, those sharing a page merged (CUDA
    refuses to register a page twice)."""
    return [(a, n) for a, n, _ in _pin.groups(tensors)]


def to_device(
    tensors: Mapping[str, Any],
    device: Any,
    *,
    pin: bool | None = None,
) -> dict[str, Any]:
    """`tensors` (torch) on `device`. For a CUDA device their host memory is registered
    as pinned for the copies (see the module docs): `pin=None` (the default) pins unless
    `RANKEXEC_PIN_HOST=0` and falls back to pageable copies when registration is
    refused; `pin=True` raises `PinError` instead; `pin=False` never pins. Tensors
    already on the device are returned as they are."""
    import torch

    dev = torch.device(device)
    if pin is None and os.environ.get("RANKEXEC_PIN_HOST", "1") == "0":
        pin = False
    if dev.type != "cuda" or pin is False:
        return {k: t.to(dev) for k, t in tensors.items()}
    try:
        cudart = torch.cuda.cudart()
    except (AssertionError, RuntimeError) as e:  # torch without CUDA, or no driver
        if pin:
            raise PinError(f"no CUDA runtime to register host memory with: {e}") from e
        return {k: t.to(dev) for k, t in tensors.items()}
    api = _pin.loaded_cudart(cudart)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _pin.copy_pinned(
        tensors,
        api,
        lambda t: t.to(dev, non_blocking=True),
        lambda: torch.cuda.synchronize(dev),
        bind=lambda: torch.cuda.set_device(index),  # no context made on another GPU
        strict=bool(pin),
        threads=min(_PIN_THREADS, os.cpu_count() or 1),
    )
