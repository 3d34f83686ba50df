"""rankexec: rank groups for federated learning, with rank code in Python."""

from rankexec import _rankexec

__all__ = ["_rankexec"]
