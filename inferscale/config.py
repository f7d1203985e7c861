"""One validated, frozen configuration object for every backend.

Build it from a dict, a TOML file, or the environment::

    Config.from_dict({"retriever": {"name": "faiss", "options": {"nlist": 64}}})
    Config.from_toml("inferscale.toml")
    Config.from_env()     # INFERSCALE_CONFIG=<toml>, INFERSCALE_RETRIEVER=faiss, ...

Backend names are checked against the registered plugins when a backend is
built (:func:`build`); options are checked against the backend's ``Options``.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from inferscale.errors import ConfigError

DEFAULT_INSTRUCTION = (
    "You are a helpful assistant. Answer the user's question using these facts "
    "you remember about them. If the facts do not contain the answer, say so.\nFacts:\n"
)


#: closes the facts (after them, before the question); vLLM always computes it fresh, so
#: the answer starts from an instruction rather than continuing the list of facts
DEFAULT_CLOSING = "Answer the question with the fact that answers it, in a few words.\n"
FACT_STYLES = ("bullet", "line")


@dataclass(frozen=True)
class BackendSpec:
    """A backend selected by registered name, with its options."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"backend name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"options of {self.name!r} must be a table, got {self.options!r}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    @classmethod
    def parse(cls, value: Any, section: str) -> BackendSpec:
        if isinstance(value, BackendSpec):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Mapping):
            extra = set(value) - {"name", "options"}
            if extra or "name" not in value:
                raise ConfigError(f"[{section}] takes 'name' and 'options', got {sorted(value)}")
            return cls(value["name"], value.get("options", {}))
        raise ConfigError(f"[{section}] must be a backend name or a table, got {value!r}")

    def to_dict(self) -> dict:
        return {"name": self.name, "options": dict(self.options)}


@dataclass(frozen=True)
class ModelSpec:
    """The serving LLM: a Hugging Face directory, a GGUF file inside one, or the
    name of a model whose weights install offline (see :mod:`inferscale.encode.weights`)."""

    path: str | None = "qwen2.5-coder-0.5b-instruct"
    gguf_file: str | None = None
    #: the dtype vLLM serves the model in
    dtype: str = "float32"
    #: the dtype the fact encoder runs the model in (K/V are cast to the cache's dtype on injection)
    encode_dtype: str = "float32"
    #: the engine's context limit, at most the model's own
    max_model_len: int = 4096

    def __post_init__(self):
        for name in ("dtype", "encode_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"model {name} must be float32, bfloat16 or float16, got {getattr(self, name)!r}")
        if isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ConfigError(f"model max_model_len must be a positive integer, got {self.max_model_len!r}")


_BACKENDS = {
    "retriever": "exact",
    "kv_store": "pinned",
    "window": "facts",
    "composer": "relevance",
    "embedder": "minilm",
}


#: Config.pinned_reads
PINNED_READS = ("copy", "overlap")


@dataclass(frozen=True)
class Config:
    model: ModelSpec = ModelSpec()
    retriever: BackendSpec = BackendSpec("exact")
    kv_store: BackendSpec = BackendSpec("pinned")
    #: what each fact is encoded behind (a window policy)
    window: BackendSpec = BackendSpec("facts", {"window": 5})
    composer: BackendSpec = BackendSpec("relevance")
    embedder: BackendSpec = BackendSpec("minilm")
    data_dir: str = "~/.local/share/inferscale"
    instruction: str = DEFAULT_INSTRUCTION
    top_k: int = 10
    #: how a fact reads in the segment: "bullet" ("- fact\n") or "line" ("fact\n")
    fact_style: str = "bullet"
    #: text right after the facts (prefilled with the question, never injected)
    closing: str = DEFAULT_CLOSING
    #: memory tokens at the segment's tail vLLM recomputes: an integer or "auto" (by device)
    recompute_tokens: int | str = "auto"
    #: the injected facts' keys are multiplied by this (attention temperature 1/key_scale)
    key_scale: float = 1.0
    #: at most this many facts are kept per conversation turn (Mem0 extraction or given facts)
    max_facts_per_turn: int = 5
    #: on CUDA, write a step's memory into the paged cache with one fused kernel
    #: (connector/fused_write.py) instead of whole-tensor ops and one backend write per layer
    #: (where the kernel cannot run, e.g. the CPU or an unknown cache layout, the latter is used)
    fused_write: bool = True
    #: how the fused write reads facts held in pinned host memory (kv_store "pinned"): "overlap"
    #: (the kernel reads host memory in place, a group of layers per launch on a side stream, each
    #: layer's attention waiting only for its group) or "copy" (one DMA per fact to the GPU, then
    #: the kernel, all before the forward pass). On an H200 at 50 and 100 facts, "overlap" (with
    #: the defaults below) added 0.94-1.17x and 0.83-0.92x the PCIe copy time to TTFT on two
    #: machines, "copy" 0.9-1.5x on earlier ones (benchmarks/results/README.md)
    pinned_reads: str = "overlap"
    #: with pinned_reads = "overlap": at most this many programs of the kernel per layer, each
    #: writing every n-th token (0: one program per token). Reads of host memory wait on the bus;
    #: fewer programs hold fewer of the SMs the forward pass beside them needs. On an H200
    #: (Llama-3.1-8B shape, 8 launches) 16 programs cut what the reads add to a forward pass
    #: beside them from 2.2 to 0.8 ms at 50 facts, 5.6 to 2.7 ms at 100 (the second table of
    #: benchmarks/fused_write_speed.py; benchmarks/results/README.md)
    pinned_read_programs: int = 16
    #: with pinned_reads = "overlap": launches the read is split into, a group of consecutive
    #: layers each; layer 0's attention waits for the first group only, so more groups start the
    #: forward sooner, each launch costing host time
    pinned_read_launches: int = 8
    #: replay the fused write from CUDA graphs captured once per table capacity
    #: (connector/write_graphs.py): a step's write costs one graph launch instead of Triton's
    #: launcher and a table copy; false launches the kernel every step
    write_graphs: bool = True
    #: with write_graphs and pinned_reads = "overlap": the groups' launches of an in-place read
    #: replayed from one CUDA graph per step (each group's event recorded by the graph), instead
    #: of a Triton launch and an event per group (connector/write_graphs.py). On an H200 at 50
    #: facts this cut what the read adds to TTFT from 3.6 to 2.4 ms (0.94x the PCIe copy time),
    #: in the same rounds (benchmarks/results/README.md); false launches each group
    pinned_read_graphs: bool = True
    #: with pinned_reads = "overlap": a step that loads fewer MiB than this copies them to the GPU
    #: first, as "copy" does (one DMA per fact, then the write on the forward stream). An in-place
    #: read costs about the same fixed host time at any size (its launch, the forward's waits):
    #: on an H200 (benchmarks/results/README.md), in the same run, 1 / 10 / 25 facts of 20 tokens
    #: (2.5 / 25 / 62.5 MiB) added 1.1 / 1.4 / 1.8 ms to TTFT copied first, 1.9 / 2.3 / 2.2-2.4 ms
    #: read in place; at 50 facts (125 MiB) both added 2.7-3.0 ms, and earlier runs found the
    #: in-place read the faster there. 0 reads every step in place
    pinned_copy_below_mib: float = 96.0
    #: the server secret that keys cache salts (created, mode 0600, on first use); "" = <data_dir>/secret
    secret_file: str = ""

    def __post_init__(self):
        for name in ("top_k", "max_facts_per_turn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("instruction", "closing", "secret_file"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string")
        for name in ("fused_write", "write_graphs", "pinned_read_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, least in (("pinned_read_programs", 0), ("pinned_read_launches", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name} must be an integer ≥ {least}, got {value!r}")
        value = self.pinned_copy_below_mib
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ConfigError(f"pinned_copy_below_mib must be a number ≥ 0, got {value!r}")
        if self.pinned_reads not in PINNED_READS:
            raise ConfigError(f"pinned_reads must be one of {', '.join(PINNED_READS)}, got {self.pinned_reads!r}")
        if self.fact_style not in FACT_STYLES:
            raise ConfigError(f"fact_style must be one of {', '.join(FACT_STYLES)}, got {self.fact_style!r}")
        try:
            self.blend("cpu")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def blend(self, device_type: str):
        """The recompute budget and key scale for an engine on ``device_type``."""
        from inferscale.compose.blend import Blend, resolve_recompute_tokens

        return Blend(resolve_recompute_tokens(self.recompute_tokens, device_type), self.key_scale)

    @property
    def data_path(self) -> Path:
        return Path(os.path.expanduser(self.data_dir))

    @property
    def kv_path(self) -> Path:
        """Where the disk store keeps the users' files."""
        return self.data_path / "kv"

    @property
    def secret_path(self) -> Path:
        """The server secret every cache salt is keyed with (:mod:`inferscale.secret`)."""
        return Path(os.path.expanduser(self.secret_file)) if self.secret_file else self.data_path / "secret"

    @property
    def mem0_path(self) -> Path:
        """Mem0's own store (extraction history)."""
        return self.data_path / "mem0"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown config key(s) {sorted(unknown)} — known: {sorted(known)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in _BACKENDS:
                kwargs[key] = BackendSpec.parse(value, key)
            elif key == "model":
                kwargs[key] = _parse_model(value)
            else:
                kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> Config:
        try:
            with open(path, "rb") as fh:
                return cls.from_dict(tomllib.load(fh))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """``INFERSCALE_CONFIG`` (a TOML file) then per-key overrides:
        ``INFERSCALE_RETRIEVER``, ``INFERSCALE_KV_STORE``, ``INFERSCALE_WINDOW``,
        ``INFERSCALE_COMPOSER``, ``INFERSCALE_EMBEDDER`` (backend names),
        ``INFERSCALE_DATA_DIR``, ``INFERSCALE_TOP_K``, ``INFERSCALE_MODEL``, ``INFERSCALE_SECRET_FILE``."""
        env = os.environ if environ is None else environ
        base = cls.from_toml(env["INFERSCALE_CONFIG"]) if env.get("INFERSCALE_CONFIG") else cls()
        data = base.to_dict()
        for key in _BACKENDS:
            if name := env.get(f"INFERSCALE_{key.upper()}"):
                data[key] = {"name": name, "options": {}}
        if value := env.get("INFERSCALE_DATA_DIR"):
            data["data_dir"] = value
        if value := env.get("INFERSCALE_SECRET_FILE"):
            data["secret_file"] = value
        if value := env.get("INFERSCALE_MODEL"):
            data["model"] = {**data["model"], "path": value}
        if value := env.get("INFERSCALE_TOP_K"):
            try:
                data["top_k"] = int(value)
            except ValueError:
                raise ConfigError(f"INFERSCALE_TOP_K must be an integer, got {value!r}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-serialisable dict (round-trips through :meth:`from_dict`)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, BackendSpec):
                value = value.to_dict()
            elif isinstance(value, ModelSpec):
                value = dataclasses.asdict(value)
            out[f.name] = value
        return out


def _parse_model(value: Any) -> ModelSpec:
    if isinstance(value, ModelSpec):
        return value
    if isinstance(value, str):
        return ModelSpec(path=value)
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(ModelSpec)}
        if set(value) - known:
            raise ConfigError(f"[model] unknown key(s) {sorted(set(value) - known)} — known: {sorted(known)}")
        return ModelSpec(**value)
    raise ConfigError(f"[model] must be a path or a table, got {value!r}")


def build(kind: str, spec: BackendSpec, **runtime: Any):
    """Instantiate the backend ``spec`` names, with validated options.

    ``runtime`` carries objects only known at run time (a device, a data dir)
    to backends whose constructor accepts them.
    """
    from inferscale.plugins import get_backend

    cls = get_backend(kind, spec.name)
    options = make_options(cls, spec.options, f"{kind} {spec.name!r}")
    return cls(options, **runtime)


def make_options(cls: type, options: Mapping[str, Any], where: str):
    """Validate ``options`` against ``cls.Options`` (a dataclass)."""
    opt_cls = getattr(cls, "Options", None)
    if opt_cls is None:
        if options:
            raise ConfigError(f"{where} takes no options, got {sorted(options)}")
        return None
    fields = {f.name: f for f in dataclasses.fields(opt_cls)}
    unknown = set(options) - set(fields)
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {sorted(unknown)} — known: {sorted(fields)}")
    try:
        return opt_cls(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
