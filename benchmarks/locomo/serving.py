"""Asking the questions: the product's engine over the encoded facts, one request per question (the
facts as text, or their K/V through the connector with the salt it expects), one ``generate`` per
method and k, each answer scored."""

from __future__ import annotations

import uuid
from pathlib import Path

from .encoding import user_of
from .methods import Contexts, Method
from .prompts import INSTRUCTION, Prompts, segment_order
from .questions import Item
from .scoring import contains, f1


def build_engine(args, model_dir: str, data_dir: Path):
    """The product's engine (``connector.engine.make_llm``): the connector reads ``data_dir``;
    each request sets its own recompute budget and key scale."""
    import torch

    from inferscale.config import Config
    from inferscale.connector.engine import make_llm

    gpu = torch.cuda.is_available()
    config = Config.from_dict({"model": {"path": model_dir, "dtype": args.dtype}, "data_dir": str(data_dir),
                               "instruction": INSTRUCTION, "kv_store": "hbm" if gpu else "pinned",
                               "recompute_tokens": 0})
    # a fixed cache (--kv-cache-gib) skips vLLM's memory profile, which fails when another process on
    # the GPU frees memory while it runs; the utilization is then only the free memory vLLM asks for
    memory = {"gpu_memory_utilization": args.gpu_memory_utilization} if gpu else {"kv_cache_memory_bytes": 2 << 30}
    if gpu and args.kv_cache_gib:
        memory["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    return make_llm(model_dir, config, in_process=True, enforce_eager=not args.cuda_graphs, **memory)


def request(method: Method, item: Item, k: int, prompts: Prompts, fact_ids: dict, nonce: str, salt_of,
            contexts: Contexts | None = None):
    """(prompt dict, kv_transfer_params or None) for one question; ``salt_of`` is :func:`cache_salts`',
    ``contexts`` what each fact was encoded behind (methods with ``contexts`` only)."""
    from inferscale.compose.request import make_params

    order = segment_order(item.retrieved[:k], method.order)
    segment = list(prompts.prefix)
    for j in order:
        segment += prompts.fact(item.conv, j, method.style, method.wrappers if method.mode == "kv" else "")
    ids = segment + prompts.query(method.closing, item.question)
    if method.mode == "prompt":
        return {"prompt_token_ids": ids, "cache_salt": f"text:{nonce}"}, None
    user = user_of(item.conv, method.encodings[0])
    if method.contexts:
        chosen = [contexts.choose(method, item.conv, j, set(order)) for j in order]
    else:
        chosen = [method.encoding_at(slot) for slot in range(len(order))]
    facts = [fact_ids[(item.conv, encoding)][j] for encoding, j in zip(chosen, order)]
    salt = salt_of(user, segment, method.recompute_tokens, method.key_scale)
    params = make_params(user, facts, method.recompute_tokens, method.key_scale)
    return {"prompt_token_ids": ids, "cache_salt": f"{salt}:{nonce}"}, params


def cache_salts(data_dir: Path):
    """``salt_of(user, segment, recompute_tokens, key_scale)``: the salt the connector reading
    ``data_dir`` expects (keyed with its secret, at the user's epoch)."""
    from inferscale.compose.salt import CacheSalts
    from inferscale.config import Config
    from inferscale.storage.disk import DiskStore

    config = Config(data_dir=str(data_dir))
    salts, disk = CacheSalts.from_file(config.secret_path), DiskStore(DiskStore.Options(root=str(config.kv_path)))
    return lambda user, segment, *recipe: salts.segment(user, disk.epoch(user), segment, *recipe)


def run_method(llm, method: Method, k: int, items, prompts, fact_ids, max_tokens: int, salt_of,
               contexts: Contexts | None = None) -> list[dict]:
    from inferscale.connector.compat import greedy_sampling

    nonce = uuid.uuid4().hex
    batch, sampling = [], []
    for item in items:
        prompt, params = request(method, item, k, prompts, fact_ids, nonce, salt_of, contexts)
        batch.append(prompt)
        sampling.append(greedy_sampling(max_tokens, params))
    outputs = llm.generate(batch, sampling, use_tqdm=False)
    rows = []
    for item, prompt, out in zip(items, batch, outputs):
        report = ((out.kv_transfer_params or {}).get("inferscale") or {}) if method.mode == "kv" else {}
        text = out.outputs[0].text.strip()
        rows.append({"conv": item.conv, "q": item.index, "k": k, "method": method.name, "answer": text,
                     "f1": f1(text, item.answer), "contains": contains(text, item.answer),
                     "prompt_tokens": len(prompt["prompt_token_ids"]),
                     "injected": report.get("injected_tokens", 0), "recomputed": report.get("recomputed_tokens", 0),
                     "fallback": report.get("fallback")})
    return rows
