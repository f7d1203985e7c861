"""Stock `vllm serve` (OpenAI-compatible API) with the connector, driven by the openai client."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

import tiny_models
import vllm_harness as vh
from inferscale.compose.request import make_params
from inferscale.connector.engine import kv_transfer_config
from vllm_server import serve

pytestmark = pytest.mark.slow
FACTS = ["Alice has a cat named Miso.", "Alice works as a nurse in Lisbon."]


def test_vllm_serve_injects_memory_from_request_params(tmp_path):
    from openai import OpenAI

    model = tiny_models.tiny_model_dir("qwen2", "float32")
    prompt, segment = vh.joint_memory(model, tmp_path, "alice", FACTS, "What is my cat called?")
    config = json.dumps(kv_transfer_config(vh.engine_config(model, tmp_path, "float32")))
    with serve(model, "--dtype", "float32", "--max-model-len", "1024", "--enable-prefix-caching",
               "--kv-transfer-config", config) as url:
        client = OpenAI(base_url=url, api_key="EMPTY")

        def complete(**extra):
            return client.completions.create(model=str(model), prompt=prompt, max_tokens=8, temperature=0.0,
                                             extra_body=extra)

        plain = complete()
        params, salt = vh.memory_request(tmp_path, "alice", ["f0", "f1"], segment)
        injected = complete(kv_transfer_params=params, cache_salt=salt)
        foreign = complete(kv_transfer_params=make_params("bob", ["f0"]), cache_salt=salt)
        metrics = _connector_metrics(url.removesuffix("/v1"), "vllm:inferscale_fallbacks_total")
    assert injected.choices[0].text == plain.choices[0].text
    report = (injected.model_extra or {}).get("kv_transfer_params", {}).get("inferscale", {})
    assert report.get("injected_tokens") == len(segment), injected.model_extra
    assert injected.usage.prompt_tokens_details is None or injected.usage.prompt_tokens_details.cached_tokens in (
        None, len(segment))
    assert foreign.choices[0].text == plain.choices[0].text
    assert (foreign.model_extra or {})["kv_transfer_params"]["inferscale"]["fallback"] == "refused"  # the reason stays in the server log
    assert metrics["vllm:inferscale_injected_requests_total"] == 1
    assert metrics["vllm:inferscale_injected_tokens_total"] == len(segment)
    assert metrics['vllm:inferscale_fallbacks_total{reason="refused"}'] == 1  # counted as the client is told
    assert metrics['vllm:inferscale_fallbacks_total{reason="invalid_params"}'] == 0
    assert not any("unknown_user" in name for name in metrics)
    assert metrics['vllm:inferscale_store_hits_total{tier="disk"}'] == 1  # the first load of alice
    # host time on the request path: the scheduler planned both requests with memory, the worker loaded one
    assert metrics["vllm:inferscale_plan_calls_total"] >= 2
    assert metrics['vllm:inferscale_host_seconds_total{step="plan"}'] > 0  # counted; how much is for benchmarks
    assert metrics['vllm:inferscale_host_seconds_total{step="load"}'] > 0
    assert metrics['vllm:inferscale_load_steps_total{read="resident"}'] == 1  # on a CPU: nothing crosses a bus
    assert metrics['vllm:inferscale_load_steps_total{read="copied"}'] == 0  # shown, though never taken here
    # no request was parked to load beside the batch (a CPU loads before the forward pass): shown at 0
    assert metrics["vllm:inferscale_parked_requests_total"] == 0
    assert metrics['vllm:inferscale_parked_schedules_total{until="scheduled"}'] == 0
    # the recompute budget each matched request got (this engine's is fixed at 0): a histogram
    assert metrics["vllm:inferscale_recompute_budget_tokens_count"] == 1
    assert metrics['vllm:inferscale_recompute_budget_tokens_bucket{le="0.0"}'] == 1


def _connector_metrics(base: str, wait_for: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The connector's counters and histogram counts on the server's /metrics (labels other than
    reason/tier/step/read/until/le dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
            text = response.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("vllm:inferscale_") and sample.name.endswith(("_total", "_count", "_bucket")):
                    extra = {k: v for k, v in sample.labels.items() if k in ("reason", "tier", "step", "read", "until", "le")}
                    label = ",".join(f'{k}="{v}"' for k, v in extra.items())
                    out[sample.name + (f"{{{label}}}" if label else "")] = sample.value
        if any(key.startswith(wait_for) and value for key, value in out.items()) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)
