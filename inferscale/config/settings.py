"""The user's settings: one validated, frozen :class:`Config` for every backend.

Build it from a dict, a TOML file, or the environment::

    Config.from_dict({"retriever": {"name": "faiss", "options": {"nlist": 64}}})
    Config.from_toml("inferscale.toml")
    Config.from_env()     # INFERSCALE_CONFIG=<toml>, INFERSCALE_RETRIEVER=faiss, ...

Loading (each of these) checks every backend's name against the registered plugins
(:mod:`inferscale.config.names`); a backend's options are checked against its ``Options``
when it is built (:func:`~inferscale.config.specs.build`). The connector's internal tuning is
:attr:`Config.tuning` (:mod:`inferscale.config.tuning`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferscale.config.names import BACKEND_DEFAULTS, check_backend_names
from inferscale.config.specs import BackendSpec, ModelSpec
from inferscale.config.tuning import TUNING_KEYS, Tuning, split_flat_tuning
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
class Config:
    model: ModelSpec = ModelSpec()
    retriever: BackendSpec = BackendSpec("exact")
    kv_store: BackendSpec = BackendSpec("pinned")
    #: the store of record (a kv_store backend that is durable): "disk" under <data_dir>/kv, or a
    #: store replicas share ("redis", or "disk" with a root on a shared filesystem: docs/cluster.md)
    store: BackendSpec = BackendSpec("disk")
    #: what each fact is encoded behind (a window policy)
    window: BackendSpec = BackendSpec("facts", {"window": 10})
    composer: BackendSpec = BackendSpec("relevance")
    embedder: BackendSpec = BackendSpec("minilm")
    data_dir: str = "~/.local/share/inferscale"
    instruction: str = DEFAULT_INSTRUCTION
    top_k: int = 10
    #: how a fact reads in the segment: "bullet" ("- fact\n") or "line" ("fact\n")
    fact_style: str = "bullet"
    #: text right after the facts (prefilled with the question, never injected)
    closing: str = DEFAULT_CLOSING
    #: memory tokens at the segment's tail vLLM recomputes: "adaptive" (up to the device's budget,
    #: 256 on CUDA and 16 on a CPU, only while the engine has room to prefill them; thresholds in
    #: ``tuning``), "auto" (the device's budget for every request) or an integer (fixed)
    recompute_tokens: int | str = "adaptive"
    #: the injected facts' keys are multiplied by this: a temperature 1/key_scale on models without
    #: a key bias; with one (Qwen2) it also scales the bias's positional term (docs/connector.md)
    key_scale: float = 1.0
    #: the form facts' K/V are kept in, on disk, in host or GPU memory and over the bus: "model" (the
    #: model's dtype) or "fp8_e4m3" (half the bytes; dequantized as they are written into the cache:
    #: :mod:`inferscale.kv_fp8`). Writes store new facts in it; a user stored in the other form is
    #: converted by their next write, and held in this form by the memory tier meanwhile.
    kv_dtype_at_rest: str = "model"
    #: a KV calibration file (``benchmarks/kv_calibration.py``) every fact's K/V are corrected with
    #: at encoding, fitted for the model and window ("": none; :mod:`inferscale.encode.calibration`)
    calibration: str = ""
    #: a fact wrappers file (``benchmarks/train_wrappers.py``): learned embeddings around every fact,
    #: encoded and injected with it, trained for the model ("": none; :mod:`inferscale.encode.wrappers`)
    wrappers: str = ""
    #: at most this many facts are kept per conversation turn (Mem0 extraction or given facts)
    max_facts_per_turn: int = 5
    #: the server secret that keys cache salts (created, mode 0600, on first use); "" = <data_dir>/secret
    secret_file: str = ""
    #: how the connector writes memory into vLLM's cache: internal tuning (a ``[tuning]`` table)
    tuning: Tuning = Tuning()

    def __post_init__(self):
        for name in ("top_k", "max_facts_per_turn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("instruction", "closing", "secret_file", "calibration", "wrappers"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string")
        if not isinstance(self.tuning, Tuning):
            object.__setattr__(self, "tuning", Tuning.parse(self.tuning))
        from inferscale.kv_fp8 import check_at_rest

        try:
            check_at_rest(self.kv_dtype_at_rest)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.fact_style not in FACT_STYLES:
            raise ConfigError(f"fact_style must be one of {', '.join(FACT_STYLES)}, got {self.fact_style!r}")
        try:
            self.blend("cpu")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def blend(self, device_type: str):
        """The recompute budget and key scale for an engine on ``device_type``."""
        from inferscale.compose.blend import resolve_blend

        return resolve_blend(self.recompute_tokens, self.key_scale, device_type)

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
        """The config ``data`` describes (as :meth:`to_dict` writes it); every backend name is
        checked against the registered plugins. Tuning keys at the top level (deprecated) go
        into ``tuning``."""
        data = split_flat_tuning(data, "top-level config key(s)", stacklevel=2)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown config key(s) {sorted(unknown)} — known: {sorted(known)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in BACKEND_DEFAULTS or key == "store":
                kwargs[key] = BackendSpec.parse(value, key)
            elif key == "model":
                kwargs[key] = ModelSpec.parse(value)
            elif key == "tuning":
                kwargs[key] = Tuning.parse(value)
            else:
                kwargs[key] = value
        config = cls(**kwargs)
        config.check_backends()
        return config

    def check_backends(self) -> None:
        """Raise :class:`~inferscale.errors.UnknownBackendError` (a ``ConfigError`` listing the
        known names) if a backend this config names is not registered by any plugin."""
        check_backend_names({kind: getattr(self, kind).name for kind in BACKEND_DEFAULTS})
        check_backend_names({"kv_store": self.store.name})

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> Config:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
        return cls.from_dict(split_flat_tuning(data, f"{path}: top-level key(s)", stacklevel=2))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """``INFERSCALE_CONFIG`` (a TOML file) then per-key overrides:
        ``INFERSCALE_RETRIEVER``, ``INFERSCALE_KV_STORE``, ``INFERSCALE_WINDOW``,
        ``INFERSCALE_COMPOSER``, ``INFERSCALE_EMBEDDER`` (backend names),
        ``INFERSCALE_DATA_DIR``, ``INFERSCALE_TOP_K``, ``INFERSCALE_MODEL``, ``INFERSCALE_SECRET_FILE``."""
        env = os.environ if environ is None else environ
        base = cls.from_toml(env["INFERSCALE_CONFIG"]) if env.get("INFERSCALE_CONFIG") else cls()
        data = base.to_dict()
        for key in BACKEND_DEFAULTS:
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
            elif isinstance(value, (ModelSpec, Tuning)):
                value = dataclasses.asdict(value)
            out[f.name] = value
        return out


_generated_init = Config.__init__


@functools.wraps(_generated_init)
def _init(self, *args: Any, **kwargs: Any) -> None:
    # the tuning knobs as keyword arguments, as before Config.tuning: deprecated, moved into it
    if TUNING_KEYS.intersection(kwargs):
        kwargs = split_flat_tuning(kwargs, "Config keyword argument(s)", stacklevel=2,
                                   instead="in tuning=Tuning(...)")
    _generated_init(self, *args, **kwargs)


Config.__init__ = _init  # type: ignore[method-assign]
