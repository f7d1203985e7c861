"""``inferscale serve``: vLLM's OpenAI server with per-user memory in front of it (docs/server.md).

The front (this process) answers the public port and reaches memory through :mod:`inferscale.api`
only, never storage, encode or compose internals (tests/test_layering.py); the engine is vLLM's own
server, a child on loopback (or replicas behind a router). ``serve.py`` is the command (engine
child, front here, start and stop), ``app.py`` the FastAPI app (routes, the API key), ``state.py``
what the routes share, ``metrics.py`` the front's own counters; what every route uses:
``errors.py`` (OpenAI-shaped refusals), ``bodies.py`` (JSON read strictly), ``limits.py`` (body
caps per route). ``engine_guard.py`` is the engine port's lock, loaded into vLLM's server by this
import path (``--middleware inferscale.server.engine_guard.EngineGuard``). The folders, one per side
of the front: ``chat/`` (``POST /v1/chat/completions``: routes.py, request.py (whose memory, what
goes to vLLM), answers.py (completions reshaped as chat)); ``memory/`` (``/v1/memories``:
routes.py, schemas.py, write_queue.py (writes take turns)); ``engine/`` (the engine process and
what reaches it: launch.py, log.py, gpu.py (one GPU shared with the encoder), forward.py (HTTP to
the engine), routes.py (health, metrics, passthrough), allowed_routes.py (the allow-list of
engine routes a client may reach)); ``cluster/`` (replicas behind a router: replica.py
(``inferscale engine``), remote.py (an engine this front does not start), failover.py (a request
sent again through a replica's death)).
"""
