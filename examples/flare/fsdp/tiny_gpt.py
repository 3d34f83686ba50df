"""A small GPT-like transformer, built from a config: no model hub, no tokenizer, no data.

``TinyGPT(vocab, width, layers, heads, positions, seed)`` is a decoder-only transformer
(token and position embeddings, ``layers`` pre-norm blocks of causal self-attention and an
MLP, a final norm, an untied output head). Its parameters and nothing else are its state
(no buffers), so a model built on the meta device is complete once every parameter is
given. The weights are drawn from a ``torch.Generator`` seeded with ``seed``: the server's
persistor and a test that builds the model again get the same initial model.

``config_for(size_bytes)`` picks a width (a multiple of 64, one head per 64 channels) and a
number of layers for a float32 model of about that size; ``script_args(cfg)`` is the
config as ``client.py``'s arguments; ``synthetic_batch`` makes the tokens a rank trains
on (random, seeded by round, rank and step: the run is reproducible).

    python tiny_gpt.py 512MiB      # prints the config and the size it gives
"""

from __future__ import annotations

import argparse
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
_UNITS.update({"g": 1 << 30, "gib": 1 << 30})


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"1GiB"``, ``"300000"`` in bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 8MiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """The model (see the module docs). Its ``__init__`` arguments are attributes of the
    same names, which FLARE's Job API exports for the server's persistor."""

    def __init__(
        self,
        vocab: int = 256,
        width: int = 64,
        layers: int = 2,
        heads: int = 2,
        positions: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.vocab, self.width, self.layers = vocab, width, layers
        self.heads, self.positions, self.seed = heads, positions, seed
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if not self.tok.weight.is_meta:
            self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() == 1:  # a norm's scale
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=g)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def config(vocab: int, width: int, layers: int, heads: int, positions: int, seed: int = 0) -> dict:
    return {
        "vocab": vocab,
        "width": width,
        "layers": layers,
        "heads": heads,
        "positions": positions,
        "seed": seed,
    }


def num_params(cfg: dict) -> int:
    w, v, p, n = cfg["width"], cfg["vocab"], cfg["positions"], cfg["layers"]
    block = 2 * w + (3 * w * w + 3 * w) + (w * w + w) + 2 * w + (4 * w * w + 4 * w) + 4 * w * w + w
    return v * w + p * w + n * block + 2 * w + w * v


def config_for(size_bytes: int, vocab: int = 4096, positions: int = 128) -> dict:
    """A float32 ``TinyGPT`` config of about `size_bytes` (at least one layer of width 64)."""
    target = size_bytes // 4
    width = max(64, 64 * round(math.sqrt(target / 12 / 10) / 64))  # about 10 layers
    fixed = num_params(config(vocab, width, 0, 1, positions))
    per_layer = num_params(config(vocab, width, 1, 1, positions)) - fixed
    layers = max(1, (target - fixed) // per_layer)
    return config(vocab, width, int(layers), width // 64, positions)


def script_args(cfg: dict) -> str:
    """The config as ``client.py``'s arguments."""
    return " ".join(f"--{k} {cfg[k]}" for k in ("vocab", "width", "layers", "heads", "positions"))


def synthetic_batch(
    cfg: dict, batch: int, seq: int, seed: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """`batch` random sequences of `seq` + 1 tokens (inputs and next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg["vocab"], (batch, seq + 1), generator=g)
    return tokens.to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("size", type=parse_size, help="target size in float32, e.g. 8MiB, 512MiB")
    args = p.parse_args()
    cfg = config_for(args.size)
    n = num_params(cfg)
    print(f"{cfg} -> {n} parameters, {4 * n} bytes in float32 ({4 * n / (1 << 20):.1f} MiB)")


if __name__ == "__main__":
    main()
