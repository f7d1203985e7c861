from inferscale import hookimpl
from inferscale_threshold.composer import ThresholdComposer


@hookimpl
def register_composers(register):
    register(ThresholdComposer)
