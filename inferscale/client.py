"""A small client for the memory endpoints of ``inferscale serve``.

Chat goes through any OpenAI client (``user=`` names whose memory to use);
this covers the rest::

    from inferscale.client import MemoryClient

    memory = MemoryClient("http://127.0.0.1:8000")
    memory.add("maya@example.com", facts=["Maya has a grey cat called Pixel."])
    memory.add("maya@example.com", messages=[{"role": "user", "content": "I moved to Porto."}])  # Mem0 extracts
    memory.search("maya@example.com", "pets", k=3)
    memory.forget("maya@example.com")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from inferscale.errors import InferScaleError


class ServerError(InferScaleError):
    """The server refused a request; ``status`` is the HTTP status, the message its explanation."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}")


class MemoryClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout_s: float = 600.0):
        """``base_url`` with or without ``/v1``; ``timeout_s`` covers a conversation's extraction."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        root = base_url.rstrip("/").removesuffix("/v1")
        self._http = httpx.Client(base_url=f"{root}/v1", headers=headers, timeout=timeout_s)

    def add(self, user_id: str, facts: Sequence[str | dict] | None = None,
            messages: Sequence[dict] | None = None) -> list[dict]:
        """Store ``facts`` (text, or ``{"text", "source_turn"}``) as given, or let Mem0
        extract them from ``messages`` (``{"role": "user"|"assistant", "content"}``) with
        the served model; returns the facts stored."""
        body: dict[str, Any] = {"user_id": user_id}
        if facts is not None:
            body["facts"] = list(facts)
        if messages is not None:
            body["messages"] = list(messages)
        return self._call("POST", "/memories", json=body)["results"]

    def list(self, user_id: str) -> list[dict]:
        return self._call("GET", "/memories", params={"user_id": user_id})["results"]

    def get(self, user_id: str, fact_id: str) -> dict:
        return self._call("GET", f"/memories/{fact_id}", params={"user_id": user_id})["result"]

    def search(self, user_id: str, query: str, k: int | None = None) -> list[dict]:
        """The user's facts most relevant to ``query``, best first, each with its ``score``."""
        body = {"user_id": user_id, "query": query, **({"k": k} if k is not None else {})}
        return self._call("POST", "/memories/search", json=body)["results"]

    def update(self, user_id: str, fact_id: str, text: str) -> dict:
        """Change a fact's text; the fact is encoded again under a new id (returned)."""
        return self._call("PUT", f"/memories/{fact_id}", json={"user_id": user_id, "text": text})["result"]

    def delete(self, user_id: str, fact_id: str) -> dict:
        """Delete one fact; the server's answer (``{"user_id", "deleted"}``)."""
        return self._call("DELETE", f"/memories/{fact_id}", params={"user_id": user_id})

    def forget(self, user_id: str) -> dict:
        """Delete everything about a user: facts, K/V, embeddings, Mem0's memories and history."""
        return self._call("DELETE", "/memories", params={"user_id": user_id})

    def users(self) -> list[str]:
        return self._call("GET", "/users")["users"]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MemoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> dict:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise ServerError(response.status_code, _message(response))
        return response.json()


def _message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:500]
