"""The parts of a config that name things: a backend (:class:`BackendSpec`), the model
(:class:`ModelSpec`), and how a named backend is built with validated options (:func:`build`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from inferscale.errors import ConfigError


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

    @classmethod
    def parse(cls, value: Any) -> ModelSpec:
        """A path (the model's name or directory) or a ``[model]`` table."""
        if isinstance(value, ModelSpec):
            return value
        if isinstance(value, str):
            return cls(path=value)
        if isinstance(value, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            if set(value) - known:
                raise ConfigError(f"[model] unknown key(s) {sorted(set(value) - known)} — known: {sorted(known)}")
            return cls(**value)
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
