"""The model, the records and the tokenizer shared by the ClientApp and the ServerApp.

The model is a tiny GPT-2 built from a config (no download: nothing here reads the
Hugging Face Hub). The records are the short sentences of ``records.jsonl`` beside this
file, which ships in the FAB (Flower packs ``*.jsonl``): a fixed eighth is held out for
the ServerApp's evaluation, the rest is split across the nodes by their ``partition-id``
/ ``num-partitions`` node config, and each node keeps every seventh of its share for its
own evaluation. Within a node, ``Trainer`` splits the records across the ranks itself
(a ``DistributedSampler``).

The tokenizer is bytes: each record's UTF-8 bytes, then an end-of-text id, padded to
``BLOCK`` (padding is masked out of the loss). A real app would use a tokenizer of its
own, loaded from a local folder.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from torch.utils.data import Dataset

SEED = 2026
BLOCK = 64
EOT = 256  # byte values are 0-255; the end of a record and the padding
VOCAB = 257


def make_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)  # every node and the server start from the same weights
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=BLOCK,
        n_embd=48,
        n_layer=2,
        n_head=2,
        bos_token_id=EOT,
        eos_token_id=EOT,
        pad_token_id=EOT,
    )
    return GPT2LMHeadModel(config)


def records() -> list[str]:
    path = Path(__file__).with_name("records.jsonl")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def held_out() -> list[str]:
    return [t for i, t in enumerate(records()) if i % 8 == 0]


def partition(partition_id: int, num_partitions: int) -> tuple[list[str], list[str]]:
    """The node's (train, eval) records."""
    rest = [t for i, t in enumerate(records()) if i % 8 != 0]
    mine = rest[partition_id::num_partitions]
    train = [t for i, t in enumerate(mine) if i % 7 != 6]
    test = [t for i, t in enumerate(mine) if i % 7 == 6]
    return train, test


class Records(Dataset):
    """Byte-tokenized records, each a dict of ``input_ids``, ``attention_mask`` and
    ``labels`` of length ``BLOCK`` (what ``Trainer``'s default collator stacks)."""

    def __init__(self, texts: list[str]) -> None:
        self.items = [encode(t) for t in texts]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def encode(text: str) -> dict[str, torch.Tensor]:
    ids = list(text.encode("utf-8"))[: BLOCK - 1] + [EOT]
    n = len(ids)
    ids += [EOT] * (BLOCK - n)
    labels = ids[:n] + [-100] * (BLOCK - n)
    mask = [1] * n + [0] * (BLOCK - n)
    return {
        "input_ids": torch.tensor(ids),
        "attention_mask": torch.tensor(mask),
        "labels": torch.tensor(labels),
    }


def evaluate(model, texts: list[str]) -> tuple[float, float]:
    """Mean loss per predicted token and its perplexity, in one process."""
    model.eval()
    batch = Records(texts).items
    with torch.no_grad():
        out = model(
            input_ids=torch.stack([b["input_ids"] for b in batch]),
            attention_mask=torch.stack([b["attention_mask"] for b in batch]),
            labels=torch.stack([b["labels"] for b in batch]),
        )
    loss = float(out.loss)
    return loss, math.exp(loss)


def digest(named_arrays) -> int:
    """A 60-bit hash of ``(name, array)`` pairs' bytes, in order (an int: Flower's
    ``MetricRecord`` holds numbers): the same weights give the same digest on a rank
    (tensors) and in the ServerApp (NumPy arrays)."""
    h = hashlib.sha256()
    for name, a in named_arrays:
        if isinstance(a, torch.Tensor):
            a = a.detach().cpu().contiguous().numpy()
        h.update(name.encode())
        h.update(a.tobytes())
    return int(h.hexdigest()[:15], 16)
