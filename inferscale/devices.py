"""Device names → torch devices, one way for every backend."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def check_device(name: str | None) -> None:
    """Options hook: ValueError (→ ConfigError) unless ``name`` is None or a device torch parses."""
    if name is None:
        return
    try:
        torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be e.g. 'cpu', 'cuda' or 'cuda:1', got {name!r}") from exc


def resolve_device(device: torch.device | str | None, default: torch.device) -> torch.device:
    """``device`` (or ``default``) with a CUDA index filled in, so devices compare equal."""
    if type(device) is torch.device and (device.index is not None or device.type != "cuda"):
        return device  # already resolved (the connector's per-request calls)
    out = default if device is None else torch.device(device)
    if out.type == "cuda" and out.index is None and torch.cuda.is_available():
        out = torch.device("cuda", torch.cuda.current_device())
    return out


def auto_device(name: torch.device | str | None) -> torch.device:
    """``name``, or the current CUDA device when there is one, else the CPU."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(name, torch.device("cpu"))


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a model's weights are (its first parameter's device; the CPU for one without any)."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def runtime_device(runtime: Mapping[str, object]) -> str | None:
    """The ``device`` a worker passed to :func:`inferscale.config.build`, as a string."""
    device = runtime.get("device")
    return None if device is None else str(device)
