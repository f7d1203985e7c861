"""``inferscale engine``: one replica for a router — vLLM's OpenAI server with the connector,
on an address of its choosing, and no front (``inferscale serve --engine-url`` is the front).

The replica reads memory from the store of record the config names (``store``: a Redis server
or a shared filesystem, which every replica and front shares) into its own memory tier
(``kv_store``: pinned or hbm), and checks each request's salt with the server secret, which
must be the fronts' (``secret_file``). It answers only requests with the engine key derived
from that secret (:mod:`inferscale.server.engine_guard`), which the fronts send through the
router; ``/health`` and ``/metrics`` stay open for the router and monitoring. This process becomes vLLM's server (exec), so a signal
sent to it reaches vLLM itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from inferscale import host_memory
from inferscale.api import Context
from inferscale.config import Config
from inferscale.errors import ConfigError
from inferscale.server.engine import launch

logger = logging.getLogger(__name__)


def replica_command(config: Config, served_name: str | None, host: str, port: int,
                    vllm_args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The replica's command line and environment."""
    from inferscale.connector import compat
    from inferscale.connector.engine import max_positions
    from inferscale.server.serve import model_name

    if any(a.split("=", 1)[0] == "--kv-transfer-config" for a in vllm_args):
        raise ConfigError(f"--kv-transfer-config is not passed to vLLM: {launch.RESERVED_ARGS['--kv-transfer-config']}")
    compat.check_release()
    context = Context(config)
    device_type = compat.platform_device_type()
    compat.set_engine_environment(device_type)
    args = list(vllm_args)
    served = launch.arg_value(args, "--served-model-name") or model_name(served_name or str(context.model_dir))
    max_len = None if launch.arg_value(args, "--max-model-len") else \
        launch.context_length(config, max_positions(str(context.model_dir)))
    cmd = launch.engine_command(context.model_dir, served, config, port, max_len, args, device_type, host)
    return cmd, launch.locked_environment(config, host_memory.engine_environment(dict(os.environ), device_type))


def run_replica(config: Config, served_name: str | None, host: str, port: int, vllm_args: Sequence[str]) -> int:
    cmd, env = replica_command(config, served_name, host, port, vllm_args)
    logger.info("replica on http://%s:%d: %s ...", host, port, " ".join(cmd[:4]))
    os.execvpe(cmd[0], cmd, env)
    return 1  # not reached
