"""The ``inferscale`` command line: one module per group of commands (:mod:`.demo`,
:mod:`.serve`, :mod:`.memory`, :mod:`.convert`); this one parses and dispatches."""

from __future__ import annotations

import argparse
import logging
import sys

from inferscale.cli import convert, demo, memory, serve

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def build_parser() -> argparse.ArgumentParser:
    from inferscale import __version__

    parser = argparse.ArgumentParser(prog="inferscale", description="InferScale's command line.")
    parser.add_argument("--version", action="version", version=f"inferscale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--config", help="TOML config file (default: INFERSCALE_* environment)")
        p.add_argument("--model", help="model directory or known name, e.g. qwen2.5-coder-0.5b-instruct")
        p.add_argument("--data-dir", help="where memory is stored")
        return p

    demo.add_parsers(sub, common)
    serve.add_parsers(sub)
    memory.add_parsers(sub)
    convert.add_parsers(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and argv[0] in ("serve", "engine") and not argv[1].startswith("-"):
        argv[1:2] = ["--model", argv[1]]  # MODEL comes first, so vLLM's own values are never taken for it
    args, rest = parser.parse_known_args(argv)
    takes_vllm_args = args.func in (serve.cmd_serve, serve.cmd_engine)
    if rest and not takes_vllm_args:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if takes_vllm_args:
        args.vllm_args = rest
    setup_logging()
    from inferscale.client import ServerError
    from inferscale.errors import InferScaleError

    try:
        return args.func(args)
    except (InferScaleError, ServerError, OSError, ValueError) as exc:  # a file, a value: said, not traced
        print(f"inferscale: error: {_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:  # "Permission denied: /srv/memory/kv"
        return f"{exc.strerror or exc}: {exc.filename}"
    return str(exc)


def setup_logging(level: int = logging.INFO) -> None:
    """The library's progress and warnings (logger ``inferscale``) on stderr."""
    logger = logging.getLogger("inferscale")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%m-%d %H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
