"""Registers the built-in composers."""

from inferscale.compose.relevance import RelevanceComposer
from inferscale.hookspecs import hookimpl


@hookimpl
def register_composers(register):
    register(RelevanceComposer)
