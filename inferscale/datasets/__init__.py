"""Conversations to build memory from: ``demo.py`` (the built-in conversation of ``inferscale
demo``), ``locomo.py`` (LoCoMo's conversations, facts and questions, read from its JSON)."""
