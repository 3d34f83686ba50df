"""The model the server's PTFileModelPersistor keeps: the DDP trainer's MLP
(examples/python/ddp_digits/trainer.py), with the same parameter names."""

from torch import nn


class DigitsMLP(nn.Sequential):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
