"""Helpers for tests that run real vLLM engines with the InferScale connector.

Engines run in-process (fast start) unless a test asks for the multiprocess
engine. vLLM keeps one KV-connector agent per process, so only one in-process
engine may live at a time: :func:`close_engine` tears it down completely.
"""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path
from typing import Any

import torch

import tiny_models

from inferscale.compose.request import make_params
from inferscale.compose.salt import CacheSalts
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
from inferscale.config import BackendSpec, Config, ModelSpec, Tuning
from inferscale.connector.engine import kv_transfer_config
from inferscale.storage.disk import DiskStore

GREEDY_TOKENS = 8
#: INFERSCALE_TEST_CUDA_GRAPHS=1 (GPU machine): engines capture CUDA graphs, so injection is
#: also checked under piecewise and full graph replay
EAGER = os.environ.get("INFERSCALE_TEST_CUDA_GRAPHS") != "1"
#: INFERSCALE_TEST_FUSED_WRITE=0/1 (GPU machine): the connector writes per layer / with the fused
#: kernel (unset: Tuning's default; on a CPU the per-layer path runs either way)
FUSED_WRITE = {"0": False, "1": True}.get(os.environ.get("INFERSCALE_TEST_FUSED_WRITE", ""), Tuning.fused_write)
#: INFERSCALE_TEST_PINNED_READS=copy/overlap (GPU machine): how the fused write reads the pinned store
PINNED_READS = os.environ.get("INFERSCALE_TEST_PINNED_READS", Tuning.pinned_reads)
#: INFERSCALE_TEST_PINNED_READ_PROGRAMS=n (GPU machine): the in-place reads capped at n programs per layer
PINNED_READ_PROGRAMS = int(os.environ.get("INFERSCALE_TEST_PINNED_READ_PROGRAMS") or Tuning.pinned_read_programs)
#: INFERSCALE_TEST_PINNED_READ_GRAPHS=0/1 (GPU machine): the in-place reads launched per group /
#: replayed from CUDA graphs (unset: Tuning's default)
PINNED_READ_GRAPHS = {"0": False, "1": True}.get(os.environ.get("INFERSCALE_TEST_PINNED_READ_GRAPHS", ""),
                                                 Tuning.pinned_read_graphs)
#: INFERSCALE_TEST_PINNED_COPY_BELOW_MIB=x (GPU machine): steps loading fewer MiB are copied, not read in place
#: (unset: Tuning's default, under which a tiny model's reads are all copied)
PINNED_COPY_BELOW_MIB = float(os.environ.get("INFERSCALE_TEST_PINNED_COPY_BELOW_MIB") or Tuning.pinned_copy_below_mib)
#: INFERSCALE_TEST_KV_STORE=hbm (GPU machine): the connector's memory tier (default: pinned host);
#: on the GPU the hbm store's fused writes are replayed from CUDA graphs (Config.tuning.write_graphs)
KV_STORE = os.environ.get("INFERSCALE_TEST_KV_STORE", "pinned")
#: INFERSCALE_TEST_ASYNC_LOADS=always/never: requests load their memory in the background / before the
#: forward pass, or "auto" (unset: Tuning's default)
ASYNC_LOADS = os.environ.get("INFERSCALE_TEST_ASYNC_LOADS") or Tuning.async_loads
#: INFERSCALE_TEST_BLOCK_SIZE=64 (GPU machine): tokens per KV cache block (unset: vLLM's choice)
BLOCK_SIZE = {"block_size": int(os.environ["INFERSCALE_TEST_BLOCK_SIZE"])} if os.environ.get("INFERSCALE_TEST_BLOCK_SIZE") else {}
#: on a GPU an engine holds its model and a 128 MiB cache; vLLM still refuses to start unless the free
#: memory covers gpu_memory_utilization of the device, so the tests ask for a tenth, leaving room for
#: other engines on the same GPU (a benchmark beside them)
MEMORY = {"gpu_memory_utilization": 0.1} if torch.cuda.is_available() else {}
TOP_LOGPROBS = 5


def engine_config(model_dir: Path, data_dir: Path, dtype: str, recompute_tokens: int | str = 0,
                  kv_dtype_at_rest: str = "model", async_loads: str | None = None) -> Config:
    """The connector's config; by default every memory token is injected (no tail recompute),
    so a test compares injected K/V with plain prefill token for token."""
    return Config(model=ModelSpec(path=str(model_dir), dtype=dtype), data_dir=str(data_dir),
                  kv_store=BackendSpec(KV_STORE), recompute_tokens=recompute_tokens, kv_dtype_at_rest=kv_dtype_at_rest,
                  tuning=Tuning(fused_write=FUSED_WRITE, pinned_reads=PINNED_READS,
                                pinned_read_programs=PINNED_READ_PROGRAMS, pinned_read_graphs=PINNED_READ_GRAPHS,
                                pinned_copy_below_mib=PINNED_COPY_BELOW_MIB, async_loads=async_loads or ASYNC_LOADS))


@contextlib.contextmanager
def env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_engine(model_dir: Path, data_dir: Path, dtype: str, *, multiprocess: bool = False,
                prefix_caching: bool = True, connector: tuple[str, str] | None = None,
                recompute_tokens: int | str = 0, kv_dtype_at_rest: str = "model", async_loads: str | None = None,
                load_failure_policy: str | None = None, **kwargs: Any):
    """``async_loads``: Config.tuning's (default: :data:`ASYNC_LOADS`); ``load_failure_policy``:
    vLLM's ``kv_load_failure_policy`` (default: the product's, ``compat.load_failure_policy``)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    release_shared()
    ktc = kv_transfer_config(engine_config(model_dir, data_dir, dtype, recompute_tokens, kv_dtype_at_rest,
                                           async_loads))
    if load_failure_policy:
        ktc["kv_load_failure_policy"] = load_failure_policy
    if connector:
        ktc["kv_connector"], ktc["kv_connector_module_path"] = connector
    with env(VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0"):
        return LLM(model=str(model_dir), dtype=dtype, max_model_len=1024, enable_prefix_caching=prefix_caching,
                   kv_transfer_config=KVTransferConfig(**ktc), kv_cache_memory_bytes=128 << 20, seed=0,
                   disable_log_stats=False, **{"enforce_eager": EAGER, **BLOCK_SIZE, **MEMORY, **kwargs})


def close_engine(llm) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    close_engine_state()


def close_engine_state() -> None:
    """Drop vLLM's per-process state (KV-connector agent, distributed groups)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()


def greedy(llm, prompt_ids: list[int], params: dict | None = None, salt: str | None = None,
           max_tokens: int = GREEDY_TOKENS):
    """Greedy tokens, their logprobs, and the RequestOutput."""
    from vllm import SamplingParams

    prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
    if salt is not None:
        prompt["cache_salt"] = salt
    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP_LOGPROBS,
                              extra_args=extra, ignore_eos=True)
    (out,) = llm.generate([prompt], sampling, use_tqdm=False)
    completion = out.outputs[0]
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
    return list(completion.token_ids), logprobs, out


def logprob_gap(a, b) -> tuple[float, int]:
    """Compare two greedy runs (RequestOutputs) step by step while they agree.

    Returns (max |Δlogprob| over every token both steps rank in their top-k, the
    number of leading steps whose greedy tokens agree). Where the runs first
    pick different tokens, that step's shared candidates are still compared:
    a flip between near-tied tokens shows up as a small gap, a wrong K/V as a
    large one.
    """
    steps_a, steps_b = a.outputs[0].logprobs, b.outputs[0].logprobs
    tokens_a, tokens_b = a.outputs[0].token_ids, b.outputs[0].token_ids
    gap, agree = 0.0, 0
    for step_a, step_b, ta, tb in zip(steps_a, steps_b, tokens_a, tokens_b):
        shared = set(step_a) & set(step_b)
        gap = max([gap, *(abs(step_a[t].logprob - step_b[t].logprob) for t in shared)])
        if ta != tb:
            break
        agree += 1
    return gap, agree


def report(out) -> dict:
    return (out.kv_transfer_params or {}).get("inferscale") or {}


def memory_request(data_dir: Path, user_id: str, fact_ids: list[str], segment_ids: list[int],
                   recompute_tokens: int | None = None, key_scale: float | None = None) -> tuple[dict, str]:
    """kv_transfer_params and the cache salt the server gives a request for this memory:
    keyed with the secret of ``data_dir`` (the engine's), at the user's current epoch."""
    config = Config(data_dir=str(data_dir))
    epoch = DiskStore(DiskStore.Options(root=str(config.kv_path))).epoch(user_id)
    salt = CacheSalts.from_file(config.secret_path).segment(user_id, epoch, segment_ids, recompute_tokens, key_scale)
    return make_params(user_id, fact_ids, recompute_tokens, key_scale), salt


@contextlib.contextmanager
def connector_log():
    """The messages the connector logs (in this process: an in-process engine's scheduler)."""
    import logging

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger, handler = logging.getLogger("vllm.inferscale.connector"), Collect(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def write_prefix(disk: DiskStore, encoder, prefix_ids: list[int]) -> None:
    disk.put(SYSTEM_USER, {PREFIX_FACT: encoder.encode_ids(prefix_ids)})


def noisy(kv, scale: float = 3.0, seed: int = 0):
    """The same tokens with K/V perturbed: valid-looking but wrong memory."""
    gen = torch.Generator().manual_seed(seed)
    kv = type(kv)(kv.token_ids, kv.keys.clone(), kv.values.clone())
    kv.keys += scale * torch.randn(kv.keys.shape, generator=gen).to(kv.keys.dtype)
    kv.values += scale * torch.randn(kv.values.shape, generator=gen).to(kv.values.dtype)
    return kv


def joint_memory(model_dir: Path, data_dir: Path, user: str, facts: list[str], query: str) -> tuple[list[int], list[int]]:
    """Store ``facts`` for ``user``, each encoded behind the prefix and the facts before it
    (so injection is exact), and return (prompt token ids, segment token ids)."""
    from inferscale.compose.prompt import PromptFormat, fact_token_ids
    from inferscale.config import DEFAULT_INSTRUCTION
    from inferscale.encode.encoder import FactEncoder

    with FactEncoder.from_spec(str(model_dir), dtype="float32") as encoder:
        tok = encoder.tokenizer
        fmt = PromptFormat.from_tokenizer(tok, DEFAULT_INSTRUCTION)
        disk = DiskStore(DiskStore.Options(root=str(data_dir / "kv")))
        segment = fmt.prefix_ids(tok)
        write_prefix(disk, encoder, segment)
        kvs = {}
        for i, text in enumerate(facts):
            ids = fact_token_ids(tok, text)
            kvs[f"f{i}"] = encoder.encode_ids(ids, context_ids=segment)
            segment = segment + ids
        disk.put(user, kvs)
        return segment + fmt.query_ids(tok, query), segment


# ---------------------------------------------------------------- engines shared between modules

_shared: dict[str, Any] = {}


def shared(key: str, make, close) -> Any:
    """An engine-holding object shared by every test module that asks with the same ``key``
    (modules that share one sit next to each other). vLLM keeps one in-process engine per
    process, so asking with another key, or starting any other engine here
    (:func:`make_engine`), closes the shared one first; the session's end closes it too."""
    if _shared.get("key") != key:
        release_shared()
        _shared.update(key=key, value=make(), close=close)
    return _shared["value"]


def release_shared() -> None:
    if _shared:
        close, value = _shared["close"], _shared["value"]
        _shared.clear()
        close(value)


def facade(tmp_path_factory):
    """The tiny Qwen2 behind the facade, in-process, shared by the API and isolation tests
    (they use disjoint users)."""
    from inferscale.api import InferScale

    def make():
        model = tiny_models.tiny_model_dir("qwen2", "float32")
        data = tmp_path_factory.mktemp("facade")
        api = InferScale.from_config({"model": str(model), "data_dir": str(data)}, enforce_eager=True,
                                     kv_cache_memory_bytes=128 << 20, max_model_len=1024)
        with env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):  # in-process, without leaving the setting behind
            api.generation.llm  # noqa: B018  (starts the engine now)
        return api

    def close(api):
        api.close()
        close_engine_state()

    return shared("facade-qwen2-float32", make, close)
