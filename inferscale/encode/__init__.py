"""Fact encoding: facts → pre-RoPE K/V, behind related facts, the facts before them or their conversation.

``FactEncoder`` (which runs a model) is imported lazily on first access.
"""

from inferscale.encode.policies import FactsWindow, NeighboursWindow, NoWindow, TokensWindow, TurnsWindow
from inferscale.encode.window import Turn, WindowPolicy

__all__ = ["FactEncoder", "FactsWindow", "NeighboursWindow", "NoWindow", "TokensWindow", "Turn", "TurnsWindow", "WindowPolicy"]


def __getattr__(name: str):
    if name == "FactEncoder":
        from inferscale.encode.encoder import FactEncoder

        return FactEncoder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
