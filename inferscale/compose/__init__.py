"""Composing a request's memory, vLLM-free: the segment ``[instruction prefix | facts]`` and what
goes to vLLM with it. ``rope.py`` is chunked RoPE (stored pre-RoPE keys rotated to their positions
in the segment, exactly; ``rope_types.py`` each RoPE type's frequencies), ``segment.py`` the segment
read from a store and rotated, ``prompt.py`` the prompt around it from the model's chat template,
``blend.py`` what is injected and what vLLM recomputes (the recompute budget, key scale),
``request.py`` a request's ``kv_transfer_params`` (parsed, checked), ``salt.py`` its cache salt
(keyed with the server secret); ``base.py`` the Composer interface (retrieved facts → the
segment's order), ``relevance.py`` the built-in one, ``plugin.py`` its registration."""
