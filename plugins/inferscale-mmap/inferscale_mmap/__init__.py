"""Example InferScale plugin: the ``mmap`` memory tier."""
