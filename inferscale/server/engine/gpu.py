"""Sharing one GPU between the engine and the fact encoder.

vLLM takes ``--gpu-memory-utilization`` (default 0.9) of the GPU's memory at
start-up, for weights and its KV cache. The fact encoder (the same model, run
by transformers in the front process) runs on the CPU by default and needs
none of it; with ``--encoder-device cuda`` it needs its weights (in the
config's ``encode_dtype``) plus room for one encoding batch, so the engine must
take that much less. :func:`engine_utilization` computes the fraction.
"""

from __future__ import annotations

import math
from pathlib import Path

from inferscale.errors import ConfigError

#: vLLM's own default
DEFAULT_UTILIZATION = 0.9
#: an encoding batch's activations and the CUDA context, beside the encoder's weights
ENCODER_HEADROOM_BYTES = 2 << 30
#: below this the engine would have little room for its KV cache
MIN_UTILIZATION = 0.2
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def encoder_bytes(model_dir: Path, dtype: str) -> int:
    """The encoder's weights in ``dtype`` (from the safetensors headers; no tensor is read)."""
    from safetensors import safe_open

    count = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            count += sum(math.prod(fh.get_slice(name).get_shape()) for name in fh.keys())
    if count == 0:
        raise ConfigError(f"{model_dir} holds no .safetensors weights to size the encoder by")
    return count * _ITEMSIZE[dtype]


def engine_utilization(encoder_nbytes: int, gpu_nbytes: int, default: float = DEFAULT_UTILIZATION) -> float:
    """``--gpu-memory-utilization`` that leaves the encoder its memory on the same GPU."""
    share = (encoder_nbytes + ENCODER_HEADROOM_BYTES) / gpu_nbytes
    utilization = math.floor((default - share) * 100) / 100
    if utilization < MIN_UTILIZATION:
        raise ConfigError(
            f"the fact encoder needs {(encoder_nbytes + ENCODER_HEADROOM_BYTES) / 2**30:.1f} GiB of the GPU's "
            f"{gpu_nbytes / 2**30:.1f} GiB, leaving the engine too little: run the encoder on the CPU "
            "(--encoder-device cpu), in a smaller encode_dtype, or set --gpu-memory-utilization yourself")
    return utilization
