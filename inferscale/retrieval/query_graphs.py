"""One query through a sentence-transformers model as a replayed CUDA graph.

Embedding one short question is all launches: MiniLM's six layers are a hundred
small kernels, each issued from Python, and sentence-transformers adds its
batching around them. On the request path (embed → retrieve → compose →
generate) that host time is latency. :class:`QueryGraphs` pads the question to
a length bucket and replays a graph captured once per bucket: the tokenizer,
one small copy, one replay and the pooled vector back.

It covers the common model shape — a Hugging Face encoder, mean pooling, an
optional normalisation — and says so through :meth:`QueryGraphs.supports`;
anything else, or a question longer than the largest bucket, takes the
ordinary path. The attention mask goes in prepared (4-D, boolean), so the
model never inspects it on the host, which capture would forbid.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inferscale.devices import module_device

#: padded lengths a graph is captured for (tokens, with [CLS] and [SEP])
BUCKETS: tuple[int, ...] = (16, 32, 64, 128)


@dataclass
class _Graph:
    inputs: torch.Tensor  # [2, L] int64: the token ids, then 1 for a real token and 0 for padding
    pooled: torch.Tensor | None = None  # the graph's output
    graph: torch.cuda.CUDAGraph | None = None  # None: run eagerly (not CUDA, or capture failed)


class QueryGraphs:
    """Single-text embeddings on a GPU by graph replay (see the module docs); on a CPU, or for a
    model that cannot be captured, the same padded forward runs eagerly."""

    def __init__(self, model, buckets: Sequence[int] = BUCKETS, capture: bool = True):
        """``capture=False`` runs the padded forward eagerly even on a GPU (to compare)."""
        self.capture = capture
        self.tokenizer = model.tokenizer
        self.encoder = model[0].auto_model
        self._token_types = "token_type_ids" in getattr(self.tokenizer, "model_input_names", ())
        self.device = module_device(self.encoder)
        limit = int(getattr(model, "max_seq_length", None) or buckets[-1])
        self.buckets = tuple(b for b in buckets if b <= limit) or (limit,)
        self._graphs: dict[int, _Graph] = {}
        self._lock = threading.Lock()

    @staticmethod
    def supports(model) -> bool:
        """Whether ``model`` (a SentenceTransformer) is an encoder + mean pooling (+ normalise)."""
        modules = list(model)
        names = [type(m).__name__ for m in modules]
        if len(modules) not in (2, 3) or names[0] != "Transformer" or names[1] != "Pooling" \
                or names[2:] not in ([], ["Normalize"]):
            return False
        return hasattr(modules[0], "auto_model") and getattr(model, "tokenizer", None) is not None \
            and _mean_pooling(modules[1])

    def embed(self, text: str) -> torch.Tensor | None:
        """``[1, dim]`` float32 mean-pooled vector on the model's device (not normalised); None
        when the text is longer than the largest bucket."""
        ids = self._token_ids(text)
        bucket = next((b for b in self.buckets if len(ids) <= b), None)
        if bucket is None:
            return None
        inputs = torch.zeros(2, bucket, dtype=torch.long)
        inputs[0, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        inputs[1, : len(ids)] = 1
        with self._lock, torch.inference_mode():  # one set of static buffers per bucket
            entry = self._graphs.get(bucket) or self._prepare(bucket)
            entry.inputs.copy_(inputs)
            if entry.graph is None:
                return self._forward(entry.inputs)
            entry.graph.replay()
            return entry.pooled.clone()

    def _token_ids(self, text: str) -> list[int]:
        """The text's ids with the model's special tokens; any text longer than the largest bucket
        comes back longer than it. A fast tokenizer's Rust backend is called directly (a third of
        the time of the Python wrapper, on the request's path), unless padding or a truncation
        someone left set on it (the wrapper sets both per call) could change the ids."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        cut = getattr(backend, "truncation", None) if backend is not None else None
        if backend is None or getattr(backend, "padding", None) is not None \
                or (cut is not None and cut.get("max_length", 0) <= self.buckets[-1]):
            return self.tokenizer(text, truncation=True, max_length=self.buckets[-1] + 1)["input_ids"]
        return backend.encode(text).ids

    def _forward(self, inputs: torch.Tensor) -> torch.Tensor:
        input_ids, keep = inputs[:1], inputs[1:] != 0
        mask = keep[:, None, None, :].expand(-1, 1, keep.shape[1], -1)  # [1, 1, L, L], True: attend
        extra = {"token_type_ids": torch.zeros_like(input_ids)} if self._token_types else {}
        hidden = self.encoder(input_ids=input_ids, attention_mask=mask, **extra).last_hidden_state
        weights = keep.unsqueeze(-1).to(hidden.dtype)
        return ((hidden * weights).sum(1) / weights.sum(1).clamp(min=1)).float()

    def _prepare(self, bucket: int) -> _Graph:
        entry = _Graph(torch.zeros(2, bucket, dtype=torch.long, device=self.device))
        entry.inputs[1, :2] = 1
        if self.capture and self.device.type == "cuda":
            try:
                entry.graph, entry.pooled = self._capture(entry.inputs)
            except Exception:  # a model that cannot be captured still runs, eagerly
                torch.cuda.synchronize(self.device)
        self._graphs[bucket] = entry
        return entry

    def _capture(self, inputs: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph (lazy initialisation, autotuning)
                self._forward(inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pooled = self._forward(inputs)
        return graph, pooled


def _mean_pooling(pooling) -> bool:
    config = pooling.get_config_dict() if hasattr(pooling, "get_config_dict") else {}
    if not config.get("include_prompt", True):
        return False
    if "pooling_mode" in config and isinstance(config["pooling_mode"], str):
        return config["pooling_mode"] == "mean"
    modes = {k: v for k, v in config.items() if k.startswith("pooling_mode_")}
    return bool(modes.get("pooling_mode_mean_tokens")) and not any(
        v for k, v in modes.items() if k != "pooling_mode_mean_tokens")
