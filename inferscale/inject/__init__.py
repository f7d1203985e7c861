"""The write path, vLLM-free: from a scheduled load to K/V in the paged cache.

Scheduler side: ``planner.py`` matches a request's prompt with its stored memory (how many
tokens it covers, or a typed refusal), ``load_signal.py`` whether the engine has room for a
recompute tail, ``load_mode.py`` whether loads run before the batch or beside it,
``background_requests.py`` the requests loading beside it. Worker side: ``writer.py`` holds the
write policy; ``loader.py`` reads the facts' K/V from the memory tier (``user_fills.py``: users
read from the store of record on a thread), and either ``fused_write.py`` writes every layer in
one Triton kernel (its table: ``sources.py``; replayed from CUDA graphs: ``write_graphs.py``) or
each layer goes through the attention backend's own op, overlapping the forward pass
(``layer_loads.py``); ``background.py`` loads on a stream of their own; ``cache_layout.py`` how K
and V lie in vLLM's cache tensors, confirmed at engine start. Both sides: ``report.py`` what a
client is told (and why it fell back), ``stats.py`` what is counted. Nothing here imports vLLM:
the adapter (:mod:`inferscale.connector.vllm_adapter`) hands in the caches and the layers.
"""
