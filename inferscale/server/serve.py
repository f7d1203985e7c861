"""``inferscale serve``: the engine as a child, the front in this process, one command.

Order: check the front's port, start the engine (it takes longest), load the
front's pieces meanwhile (tokenizer, embedder, index, fact encoder), wait for
the engine, then serve. The front exits when the engine dies, and stops the
engine when it exits.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inferscale.api import Context
from inferscale.config import Config
from inferscale.errors import ConfigError
from inferscale import host_memory
from inferscale.server.engine import gpu, launch
from inferscale.server.state import ServerState

logger = logging.getLogger(__name__)

ENGINE_START_TIMEOUT_S = 1200.0


@dataclass(frozen=True)
class ServeOptions:
    config: Config
    host: str = "127.0.0.1"
    port: int = 8000
    engine_port: int | None = None  # None: a free port on 127.0.0.1
    served_name: str | None = None  # None: the model as named on the command line
    api_key: str | None = None
    encoder_device: str = "cpu"
    engine_timeout_s: float = ENGINE_START_TIMEOUT_S
    #: forgetting a user or deleting a fact also empties vLLM's prefix cache (engine_guard's own route)
    forget_resets_prefix_cache: bool = False
    vllm_args: Sequence[str] = field(default_factory=tuple)
    #: an engine not started here: a router in front of ``inferscale engine`` replicas (docs/cluster.md)
    engine_url: str | None = None
    #: seconds a chat is sent again while no replica answers (with ``engine_url``)
    engine_retry_s: float = 30.0


def serve(options: ServeOptions) -> int:
    """Run until interrupted (0) or until the engine dies (1)."""
    applied = host_memory.configure_front()  # first: before the front's threads and arenas exist
    from inferscale.connector import compat

    compat.check_release()
    if applied:
        logger.info("host memory: %s (inferscale/host_memory.py)", ", ".join(f"{k}={v}" for k, v in applied.items()))
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # so the engine is stopped and memory closed on the way out
    launch.check_vllm_args(options.vllm_args)
    launch.check_port_free(options.host, options.port)
    context = Context(options.config)
    device_type = compat.platform_device_type()
    if options.encoder_device != "cpu" and device_type == "cpu":
        raise ConfigError(f"--encoder-device {options.encoder_device}: this machine has no CUDA device")
    compat.set_engine_environment(device_type)
    engine, served_name = _engine(options, context, device_type)
    state = None
    try:
        engine.start()
        state = ServerState.build(context, engine.url, served_name, options.api_key)
        state.model_aliases = frozenset(n for n in (options.served_name, str(context.model_dir)) if n)
        state.forget_resets_prefix_cache = options.forget_resets_prefix_cache
        state.engine_retry_s = options.engine_retry_s if options.engine_url else 0.0
        state.warm_up(encoder=True)
        _place_encoder(state, options.encoder_device)
        logger.info("engine ready in %.0f s", engine.wait_ready(options.engine_timeout_s))
        return _run_front(state, engine, options)
    finally:
        engine.stop()
        if state is not None:
            state.close()


def _stop_on_sigterm(signum, frame) -> None:
    logger.info("SIGTERM: shutting down")
    raise SystemExit(0)


def _engine(options: ServeOptions, context: Context, device_type: str) -> tuple[launch.EngineProcess, str]:
    from inferscale.connector.engine import max_positions

    args = list(options.vllm_args)
    served = launch.arg_value(args, "--served-model-name") or model_name(options.served_name or str(context.model_dir))
    if options.engine_url:
        return _remote(options, served), served
    if options.encoder_device.startswith("cuda") and launch.arg_value(args, "--gpu-memory-utilization") is None:
        args += ["--gpu-memory-utilization", str(_shared_gpu_utilization(context, options.encoder_device))]
    max_len = None if launch.arg_value(args, "--max-model-len") else \
        launch.context_length(options.config, max_positions(str(context.model_dir)))
    port = options.engine_port or launch.free_port()
    cmd = launch.engine_command(context.model_dir, served, options.config, port, max_len, args, device_type)
    environment = launch.locked_environment(options.config, _engine_environment(device_type))
    return launch.EngineProcess(cmd, port, environment), served


def _remote(options: ServeOptions, served: str):
    from inferscale.server.cluster.remote import RemoteEngine

    if options.forget_resets_prefix_cache or options.vllm_args:
        raise ConfigError("with --engine-url the replicas are started on their own (inferscale engine): vLLM's "
                          "arguments and --forget-resets-prefix-cache go to them, not to this front")
    return RemoteEngine(options.engine_url)


def model_name(model: str) -> str:
    """The name the engine serves a model under: a model given as a directory is served under the
    directory's name, so that no path shows in answers or in ``/metrics`` labels."""
    return Path(model).name if ("/" in model or os.sep in model) else model


def _engine_environment(device_type: str) -> dict[str, str]:
    """The front's environment with the host-memory settings (:mod:`host_memory`) where it sets
    none. The engine on loopback takes no API key (the front checks --api-key); a VLLM_API_KEY
    left in the environment would lock the front out of its own engine."""
    if "VLLM_API_KEY" in os.environ:
        logger.warning("VLLM_API_KEY is not passed to the engine; use --api-key to protect the front")
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    return host_memory.engine_environment(environ, device_type)


def _shared_gpu_utilization(context: Context, device: str) -> float:
    import torch

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    nbytes = gpu.encoder_bytes(context.model_dir, context.config.model.encode_dtype)
    utilization = gpu.engine_utilization(nbytes, total)
    logger.info("the encoder shares %s: the engine gets --gpu-memory-utilization %.2f", device, utilization)
    return utilization


def _place_encoder(state: ServerState, device: str) -> None:
    if device != "cpu":
        state.memory.encoder.model.to(device)
        logger.info("fact encoder moved to %s", device)


def _run_front(state: ServerState, engine: launch.EngineProcess, options: ServeOptions) -> int:
    import uvicorn

    from inferscale.server.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(state), host=options.host, port=options.port,
                                           log_level="info", timeout_graceful_shutdown=10))
    died = threading.Event()
    threading.Thread(target=_watch, args=(engine, server, died), daemon=True, name="engine-watch").start()
    _announce(state, options)
    server.run()
    return 1 if died.is_set() else 0


def _watch(engine: launch.EngineProcess, server, died: threading.Event) -> None:
    while not server.should_exit:
        if engine.exit_code() is not None:
            logger.error("the engine exited with code %s; stopping", engine.exit_code())
            died.set()
            server.should_exit = True
            return
        time.sleep(1.0)


def _announce(state: ServerState, options: ServeOptions) -> None:
    url = f"http://{options.host}:{options.port}"
    logger.info("serving %s at %s/v1 (chat with memory: POST /v1/chat/completions with \"user\"; "
                "memory: /v1/memories); the engine listens on %s only", state.served_model, url, state.engine_url)
    if not options.api_key and not _loopback(options.host):
        logger.warning("%s is reachable from other machines and no --api-key is set: anyone who reaches it "
                       "can read and change every user's memory", url)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
