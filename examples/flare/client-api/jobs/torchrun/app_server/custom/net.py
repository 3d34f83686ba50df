"""The model: a small MLP for scikit-learn's 8x8 digits."""

from torch import nn


class Net(nn.Module):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(nn.functional.relu(self.fc1(x)))
