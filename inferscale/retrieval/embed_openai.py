"""Embeddings from any OpenAI-compatible ``/v1/embeddings`` endpoint (OpenAI, vLLM, TEI, ...)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from inferscale.retrieval.base import Embedder
from inferscale.retrieval.checks import check_positive, check_texts, unit_rows


class OpenAIEmbedder(Embedder):
    """Text → unit vectors through the ``openai`` client, in batches of ``batch_size``.

    ``api_key``: ``None`` → ``$OPENAI_API_KEY``, or ``"EMPTY"`` (what local
    servers accept). ``dim``: the expected width, checked on every response;
    ``None`` → learnt from the first response. With ``send_dimensions=True`` the
    request asks the server for ``dim`` wide vectors (OpenAI's ``dimensions``).
    """

    name: ClassVar[str] = "openai"

    @dataclass(frozen=True)
    class Options:
        model: str
        base_url: str | None = None  # None: the client's default (api.openai.com or $OPENAI_BASE_URL)
        api_key: str | None = None
        dim: int | None = None
        batch_size: int = 256
        send_dimensions: bool = False
        timeout: float = 60.0

        def __post_init__(self):
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"model must be a non-empty string, got {self.model!r}")
            check_positive(self.batch_size, "batch_size")
            if self.dim is not None:
                check_positive(self.dim, "dim")
            if self.send_dimensions and self.dim is None:
                raise ValueError("send_dimensions=True needs dim")

    def __init__(self, options: Options, **runtime: Any):
        """``runtime`` objects are accepted and ignored."""
        self.options = options
        self._dim = options.dim
        self._client = None
        self._lock = threading.Lock()

    @property
    def dim(self) -> int:
        if self._dim is None:
            self.embed(["dimension probe"])
        return self._dim

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        texts = check_texts(texts)
        if not texts:
            return torch.empty(0, self.dim, dtype=torch.float32)
        size = self.options.batch_size
        rows = [self._embed_batch(texts[i : i + size]) for i in range(0, len(texts), size)]
        return unit_rows(torch.cat(rows))

    def _embed_batch(self, texts: list[str]) -> torch.Tensor:
        extra = {"dimensions": self.options.dim} if self.options.send_dimensions else {}
        response = self._get_client().embeddings.create(
            model=self.options.model, input=texts, encoding_format="float", **extra
        )
        data = sorted(response.data, key=lambda d: d.index)
        if len(data) != len(texts):
            raise RuntimeError(f"embeddings endpoint returned {len(data)} vectors for {len(texts)} texts")
        x = torch.tensor([d.embedding for d in data], dtype=torch.float32)
        self._check_dim(x.shape[1])
        return x

    def _check_dim(self, width: int) -> None:
        if self._dim is None:
            self._dim = width
        elif width != self._dim:
            raise ValueError(f"model {self.options.model!r} returned {width}-d vectors, expected {self._dim}")

    def _get_client(self):
        with self._lock:
            if self._client is None:
                self._client = make_client(self.options)
            return self._client


def make_client(options: OpenAIEmbedder.Options):
    """An ``openai.OpenAI`` client for ``options.base_url``."""
    try:
        import openai
    except ImportError as exc:
        raise ImportError("the 'openai' embedder needs the openai client: pip install openai") from exc
    api_key = options.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    return openai.OpenAI(base_url=options.base_url, api_key=api_key, timeout=options.timeout)
