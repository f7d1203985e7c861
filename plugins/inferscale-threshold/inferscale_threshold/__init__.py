"""Example InferScale plugin: the ``threshold`` composer."""
