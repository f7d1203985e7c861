"""The vLLM side: the only part that imports vLLM. ``vllm_adapter.py`` is the KV connector
(``KVConnectorBase_V1``, loaded by vLLM from this module path), a thin adapter that hands vLLM's
objects to the vLLM-free write path (:mod:`inferscale.inject`); ``compat.py`` holds every
difference between the vLLM releases supported and every environment setting; ``engine.py``
builds a ``vllm.LLM`` with the connector (and the ``--kv-transfer-config`` for ``vllm serve``);
``metrics.py`` the connector's counts on vLLM's ``/metrics``."""
