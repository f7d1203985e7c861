"""A test plugin registered by hand in a fixture (not through an entry point)."""

from inferscale import hookimpl
from inferscale.compose.base import Composer


class ReverseAlphaComposer(Composer):
    name = "reverse-alpha"

    def __init__(self, options=None):
        pass

    def order(self, hits):
        return sorted((h.fact_id for h in hits), reverse=True)


class Nameless:
    pass


@hookimpl
def register_composers(register):
    register(ReverseAlphaComposer)
