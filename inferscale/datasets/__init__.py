"""Conversations to build memory from: the built-in demo and LoCoMo."""
