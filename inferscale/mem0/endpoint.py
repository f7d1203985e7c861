"""The OpenAI-compatible endpoint Mem0's extraction calls: the errors it can meet, the
pre-flight check (``GET /models``: something answers, it serves the model, its context holds
Mem0's prompt and the answer)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from inferscale.errors import ConfigError, InferScaleError

#: Mem0's extraction prompt (system + user skeleton), in Qwen2.5 tokens (7924 + ≈80)
MEM0_PROMPT_TOKENS = 8_000
#: room for what Mem0 adds per call: last 10 messages (≤ 300 chars each) + 10 existing memories
CONTEXT_HEADROOM = 2_048


class ExtractionError(InferScaleError):
    """Fact extraction failed; the message says at which endpoint and turn."""


class EndpointUnreachableError(ExtractionError, ConnectionError):
    """The OpenAI-compatible LLM endpoint did not answer."""

    def __init__(self, url: str, reason: object):
        self.url = url
        super().__init__(f"LLM endpoint {url} is unreachable ({reason}) — start an OpenAI-compatible "
                         f"server there, e.g. `vllm serve <model> --enable-prefix-caching --port <port>`")


@dataclass(frozen=True)
class ServedModel:
    """What the endpoint reports for the model extraction will use."""

    model_id: str
    max_model_len: int | None


def list_models(url: str, api_key: str, timeout_s: float) -> list[dict]:
    """``GET {url}/models``; :class:`EndpointUnreachableError` when nothing answers."""
    request = urllib.request.Request(f"{url}/models", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = json.load(response)
    except urllib.error.HTTPError as exc:
        raise ExtractionError(f"LLM endpoint {url} answered GET /models with HTTP {exc.code}: "
                              "is it an OpenAI-compatible base URL (ending in /v1)?") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise EndpointUnreachableError(url, getattr(exc, "reason", exc)) from exc
    except ValueError as exc:
        raise ExtractionError(f"LLM endpoint {url} answered GET /models with something other than JSON") from exc
    models = body.get("data") if isinstance(body, dict) else None
    if not models:
        raise ExtractionError(f"LLM endpoint {url} serves no models (GET /models: {str(body)[:200]})")
    return models


def pick_model(models: list[dict], wanted: str | None, url: str) -> ServedModel:
    """The wanted model (or the first served one) with its ``max_model_len`` if reported."""
    ids = [str(m.get("id")) for m in models]
    if wanted is not None and wanted not in ids:
        raise ConfigError(f"LLM endpoint {url} does not serve {wanted!r} — it serves: {', '.join(ids)}")
    model = models[ids.index(wanted) if wanted is not None else 0]
    length = model.get("max_model_len")
    return ServedModel(str(model["id"]), int(length) if isinstance(length, int) else None)


def context_tokens(output_tokens: int) -> int:
    """The served context one extraction call needs: Mem0's prompt, what it adds, the answer."""
    return MEM0_PROMPT_TOKENS + CONTEXT_HEADROOM + output_tokens


def check_context(served: ServedModel, output_tokens: int, url: str) -> None:
    """ConfigError when the served context cannot hold Mem0's prompt plus the answer."""
    needed = context_tokens(output_tokens)
    if served.max_model_len is not None and served.max_model_len < needed:
        raise ConfigError(
            f"{served.model_id} at {url} has max_model_len {served.max_model_len}, but Mem0's extraction "
            f"prompt is ≈{MEM0_PROMPT_TOKENS} tokens before context and answer: serve it with "
            f"--max-model-len {needed} or more (longer answers are cut off and Mem0 then stores nothing)")
