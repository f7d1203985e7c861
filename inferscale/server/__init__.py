"""``inferscale serve``: vLLM's OpenAI server with per-user memory (see docs/server.md).

serve.py      the command: engine child, front in this process, start and stop
launch.py     the engine's command line and process (vLLM on 127.0.0.1)
engine_log.py the engine's output, relayed (without vLLM's spurious report of a stop)
app.py        the FastAPI app: routes, errors, the API key
routes_chat.py / chat.py / convert.py   chat with memory, as completions on the engine
routes_memory.py / schemas.py           the memory endpoints over MemoryAPI
routes_engine.py / forward.py           health, metrics, passthrough; HTTP to the engine
state.py, metrics.py, errors.py, gpu.py

It reaches memory through :mod:`inferscale.api` only, never storage, encode or compose
internals (tests/test_layering.py).
"""
