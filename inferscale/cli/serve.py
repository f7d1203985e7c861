"""``inferscale serve`` (vLLM's OpenAI server with per-user memory) and ``serve-config``
(the connector's ``--kv-transfer-config`` for a ``vllm serve`` of your own)."""

from __future__ import annotations

import argparse
import json
import os

from inferscale.cli.common import config_of


def cmd_serve_config(args) -> int:
    """Print the --kv-transfer-config JSON for `vllm serve`."""
    from inferscale.config import Config
    from inferscale.connector.engine import kv_transfer_config

    config = Config.from_toml(args.config) if args.config else Config.from_env()
    print(json.dumps(kv_transfer_config(config)))
    return 0


def cmd_serve(args) -> int:
    """vLLM's OpenAI server with per-user memory: chat with `user=`, memory endpoints, one command."""
    from inferscale.server.serve import ServeOptions, serve

    config = config_of(args)
    options = ServeOptions(config, host=args.host, port=args.port, engine_port=args.engine_port,
                           served_name=args.model or config.model.path,
                           api_key=args.api_key or os.environ.get("INFERSCALE_API_KEY") or None,
                           encoder_device=args.encoder_device, engine_timeout_s=args.engine_timeout,
                           forget_resets_prefix_cache=args.forget_resets_prefix_cache,
                           vllm_args=tuple(args.vllm_args), engine_url=args.engine_url,
                           engine_retry_s=args.engine_retry)
    return serve(options)


def cmd_engine(args) -> int:
    """One replica for a router: vLLM's OpenAI server with the connector, no front (docs/cluster.md)."""
    from inferscale.server.cluster.replica import run_replica

    config = config_of(args)
    return run_replica(config, args.model or config.model.path, args.host, args.port, tuple(args.vllm_args))


def add_parsers(sub) -> None:
    serve = sub.add_parser("serve", help=cmd_serve.__doc__, allow_abbrev=False,
                           usage="inferscale serve [MODEL] [options] [vLLM's own arguments]",
                           description="MODEL (first, a model directory or known name; default: the "
                                       "config's) is served by vLLM with the connector, behind a front "
                                       "that adds per-user memory.",
                           epilog="Arguments not listed here go to `vllm serve` (e.g. --gpu-memory-utilization "
                                  "0.8, --tensor-parallel-size 2); the engine listens on 127.0.0.1 only.")
    serve.add_argument("--model", help=argparse.SUPPRESS)  # MODEL, right after `serve` (see main)
    serve.add_argument("--config", help="TOML config file (default: INFERSCALE_* environment)")
    serve.add_argument("--data-dir", help="where memory is stored")
    serve.add_argument("--host", default="127.0.0.1", help="the front's address (default 127.0.0.1; "
                                                          "0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000, help="the front's port (default 8000)")
    serve.add_argument("--engine-port", type=int, help="the engine's port on 127.0.0.1 (default: a free one)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $INFERSCALE_API_KEY)")
    serve.add_argument("--encoder-device", default="cpu",
                       help="where the fact encoder runs: cpu (default) or cuda[:N], which lowers the engine's "
                            "--gpu-memory-utilization to leave it room")
    serve.add_argument("--engine-timeout", type=float, default=1200.0,
                       help="seconds to wait for the engine to start (default 1200)")
    serve.add_argument("--forget-resets-prefix-cache", action="store_true",
                       help="forgetting a user, deleting or changing a fact also empties vLLM's prefix cache, so the "
                            "blocks go too (every user's cached prefixes go; the engine port's lock already keeps "
                            "them from being read: docs/server.md)")
    serve.add_argument("--engine-url", help="an engine not started here: a router in front of `inferscale engine` "
                                            "replicas, e.g. http://127.0.0.1:30000 (docs/cluster.md)")
    serve.add_argument("--engine-retry", type=float, default=30.0,
                       help="with --engine-url: seconds a chat is sent again while no replica answers (default 30)")
    serve.set_defaults(func=cmd_serve, vllm_args=[])

    engine = sub.add_parser("engine", help=cmd_engine.__doc__, allow_abbrev=False,
                            usage="inferscale engine [MODEL] [options] [vLLM's own arguments]",
                            description="A replica behind a router: vLLM with the connector, reading memory "
                                        "from the config's store (e.g. redis), on --host:--port.")
    engine.add_argument("--model", help=argparse.SUPPRESS)
    engine.add_argument("--config", help="TOML config file (default: INFERSCALE_* environment)")
    engine.add_argument("--data-dir", help="where memory is stored (with the disk store)")
    engine.add_argument("--host", default="127.0.0.1", help="the replica's address (default 127.0.0.1)")
    engine.add_argument("--port", type=int, default=8100, help="the replica's port (default 8100)")
    engine.set_defaults(func=cmd_engine, vllm_args=[])

    config_cmd = sub.add_parser("serve-config", help=cmd_serve_config.__doc__)
    config_cmd.add_argument("--config", help="TOML config file (default: INFERSCALE_* environment)")
    config_cmd.set_defaults(func=cmd_serve_config)
