"""Fact encoding: facts → pre-RoPE K/V, behind the facts before them or a window of their conversation.

``FactEncoder`` (which runs a model) is imported lazily on first access.
"""

from inferscale.encode.policies import FactsWindow, NoWindow, TokensWindow, TurnsWindow
from inferscale.encode.window import Turn, WindowPolicy

__all__ = ["FactEncoder", "FactsWindow", "NoWindow", "TokensWindow", "Turn", "TurnsWindow", "WindowPolicy"]


def __getattr__(name: str):
    if name == "FactEncoder":
        from inferscale.encode.encoder import FactEncoder

        return FactEncoder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
