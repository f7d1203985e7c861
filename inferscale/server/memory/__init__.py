"""The memory endpoints (``/v1/memories``, ``/v1/users``) over :class:`~inferscale.api.MemoryAPI`:
``routes.py`` the endpoints, ``schemas.py`` their request bodies and answers (pydantic),
``write_queue.py`` how writes take turns on the one encoder (in arrival order, a large add in chunks)."""
