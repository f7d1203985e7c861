"""The write path, vLLM-free: from a scheduled load to K/V in the paged cache.

Scheduler side, :mod:`~inferscale.inject.planner` matches a request's prompt with
its stored memory. Worker side, :mod:`~inferscale.inject.writer` holds the write
policy: :mod:`~inferscale.inject.loader` reads the facts' K/V from the memory
tier, and either :mod:`~inferscale.inject.fused_write` writes every layer in one
kernel (its table: :mod:`~inferscale.inject.sources`; replayed from CUDA graphs:
:mod:`~inferscale.inject.write_graphs`) or each layer goes through the attention
backend's own op, overlapping the forward pass (:mod:`~inferscale.inject.layer_loads`).
Nothing here imports vLLM: the adapter (:mod:`inferscale.connector.vllm_adapter`)
hands in the caches and the layers.
"""
