"""The engine (vLLM's own OpenAI server, a child on loopback) and what reaches it: ``launch.py``
its command line and process, ``log.py`` its output relayed, ``gpu.py`` the share of one GPU it
leaves the fact encoder, ``forward.py`` the front's HTTP to it, ``routes.py`` health, metrics and
the passthrough of the rest of vLLM's API, ``allowed_routes.py`` the allow-list of engine routes
a client may reach (paths normalized first; vLLM's admin routes never pass). The lock on the
engine's own port is :mod:`inferscale.server.engine_guard` (loaded into vLLM by that path)."""
