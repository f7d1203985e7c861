"""``inferscale serve``: vLLM's OpenAI server with per-user memory (see docs/server.md).

serve.py      the command: engine child, front in this process, start and stop
launch.py     the engine's command line and process (vLLM on 127.0.0.1)
app.py        the FastAPI app: routes, errors, the API key
routes_chat.py / chat.py / convert.py   chat with memory, as completions on the engine
routes_memory.py / schemas.py           the memory endpoints over MemoryAPI
routes_engine.py / forward.py           health, metrics, passthrough; HTTP to the engine
state.py, metrics.py, errors.py, gpu.py
"""
