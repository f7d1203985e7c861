"""Built-in window policies, registered through the same hook as third-party ones."""

from inferscale.hookspecs import hookimpl


@hookimpl
def register_windows(register):
    from inferscale.encode.policies import BUILTIN_POLICIES

    for policy in BUILTIN_POLICIES:
        register(policy)
