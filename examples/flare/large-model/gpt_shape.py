"""A GPT-2-shaped model of any size, generated: no download, no tokenizer, no data.

Large-model jobs are measured and tested with a state dict that has the names, shapes
and dtypes of a real transformer (GPT-2's: ``wte``, ``wpe``, ``h.N.ln_1``,
``h.N.attn.c_attn``, ``h.N.attn.c_proj``, ``h.N.ln_2``, ``h.N.mlp.c_fc``,
``h.N.mlp.c_proj``, ``ln_f``; weights in GPT-2's ``Conv1D`` layout, ``[in, out]``)
without fetching one. ``config_for(size, dtype)`` picks the width (a multiple of 64,
about 40 per layer as in GPT-2 medium to XL) and the number of layers for a target size;
the vocabulary rows absorb the remainder, so any size from about 1 MiB up is reached to
within one row (``width`` elements).

Every tensor ``i`` (in state-dict order) is filled with ``1 + i % 4``: exact in
bfloat16, float16 and float32, so a job's arithmetic (``initial + rounds * delta``) can be
checked exactly, and distinct enough that a tensor delivered under the wrong name shows.

``GPTShape`` is the ``nn.Module`` FLARE's persistor builds on the server (its ``__init__``
arguments are attributes of the same names, which FLARE's Job API exports); ``state_dict``
gives the same tensors without a module. Caveat: there is no forward pass; this is a
state dict with a transformer's layout, not a transformer.

    python gpt_shape.py 4.5GiB --dtype bfloat16    # prints the config and the layout
"""

from __future__ import annotations

import argparse
import math
import re

import torch
from torch import nn

#: GPT-2's vocabulary and context length, used as long as the model is big enough.
VOCAB = 50257
POSITIONS = 1024
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
_UNITS.update({"g": 1 << 30, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9})


def parse_size(text: str) -> int:
    """``"256MiB"``, ``"4.5GiB"``, ``"8m"``, ``"1000000"`` in bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 256MiB, 4.5GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def layer_params(width: int) -> int:
    """Elements of one block: ln_1, c_attn, c_proj, ln_2, c_fc, mlp.c_proj."""
    return 12 * width * width + 13 * width


def config_for(size_bytes: int, dtype: str = "bfloat16") -> dict:
    """The ``GPTShape`` arguments for a model of about `size_bytes` in `dtype`."""
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    total = size_bytes // elem
    # GPT-2 medium..XL have about 35-45 channels per layer: width ~ (40 * params / 12)^(1/3).
    width = max(64, 64 * round((40 * total / 12) ** (1 / 3) / 64))
    while True:
        positions = min(POSITIONS, max(16, total // (16 * width)))
        vocab = max(16, min(VOCAB, total // (4 * width) - positions))
        fixed = (vocab + positions) * width + 2 * width
        layers = (total - fixed) // layer_params(width)
        if layers >= 1 or width == 64:
            break
        width -= 64
    layers = max(1, layers)
    rest = total - layers * layer_params(width) - positions * width - 2 * width
    vocab = max(16, rest // width)
    return {
        "width": width,
        "layers": int(layers),
        "vocab": int(vocab),
        "positions": int(positions),
        "dtype": dtype,
    }


def layout(width: int, layers: int, vocab: int, positions: int) -> list[tuple[str, tuple]]:
    """(name, shape) of every tensor, in state-dict order."""
    d = width
    out: list[tuple[str, tuple]] = [("wte.weight", (vocab, d)), ("wpe.weight", (positions, d))]
    for i in range(layers):
        p = f"h.{i}."
        out += [
            (p + "ln_1.weight", (d,)),
            (p + "ln_1.bias", (d,)),
            (p + "attn.c_attn.weight", (d, 3 * d)),
            (p + "attn.c_attn.bias", (3 * d,)),
            (p + "attn.c_proj.weight", (d, d)),
            (p + "attn.c_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)),
            (p + "ln_2.bias", (d,)),
            (p + "mlp.c_fc.weight", (d, 4 * d)),
            (p + "mlp.c_fc.bias", (4 * d,)),
            (p + "mlp.c_proj.weight", (4 * d, d)),
            (p + "mlp.c_proj.bias", (d,)),
        ]
    return out + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def initial_value(index: int) -> float:
    """The value every element of tensor `index` starts with (exact in bf16)."""
    return float(1 + index % 4)


def state_dict(
    width: int, layers: int, vocab: int, positions: int, dtype: str = "bfloat16"
) -> dict[str, torch.Tensor]:
    """The initial tensors, filled as the module docs say."""
    dt = DTYPES[dtype]
    return {
        name: torch.full(shape, initial_value(i), dtype=dt)
        for i, (name, shape) in enumerate(layout(width, layers, vocab, positions))
    }


def nbytes(width: int, layers: int, vocab: int, positions: int, dtype: str = "bfloat16") -> int:
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    return elem * sum(math.prod(s) for _, s in layout(width, layers, vocab, positions))


def _register(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        owner: nn.Module = module
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, nn.Parameter(t, requires_grad=False))


class GPTShape(nn.Module):
    """The tensors of ``state_dict`` as parameters, under the same names."""

    def __init__(
        self, width: int, layers: int, vocab: int, positions: int, dtype: str = "bfloat16"
    ) -> None:
        super().__init__()
        self.width, self.layers, self.vocab = width, layers, vocab
        self.positions, self.dtype = positions, dtype
        _register(self, state_dict(width, layers, vocab, positions, dtype))


def flat_config(size_bytes: int, dtype: str = "float32", tensors: int = 8) -> dict:
    """``FlatShape`` arguments: `tensors` equal 1-D tensors of `size_bytes` in all (the
    issue's first measurement: 1 GiB float32 as 8 tensors of 128 MiB)."""
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    return {"tensors": tensors, "elements": size_bytes // elem // tensors, "dtype": dtype}


class FlatShape(nn.Module):
    """``tensors`` 1-D tensors ``p.0`` ... of ``elements`` each, filled as ``state_dict``'s."""

    def __init__(self, tensors: int, elements: int, dtype: str = "float32") -> None:
        super().__init__()
        self.tensors, self.elements, self.dtype = tensors, elements, dtype
        dt = DTYPES[dtype]
        _register(
            self,
            {f"p.{i}": torch.full((elements,), initial_value(i), dtype=dt) for i in range(tensors)},
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("size", type=parse_size, help="target size, e.g. 8MiB, 1GiB, 4.5GiB")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--layout", action="store_true", help="print every tensor")
    args = p.parse_args()
    cfg = config_for(args.size, args.dtype)
    size = nbytes(**cfg)
    tensors = layout(cfg["width"], cfg["layers"], cfg["vocab"], cfg["positions"])
    print(f"{cfg} -> {len(tensors)} tensors, {size} bytes ({size / (1 << 30):.3f} GiB)")
    if args.layout:
        for name, shape in tensors:
            print(f"  {name} {list(shape)}")


if __name__ == "__main__":
    main()
