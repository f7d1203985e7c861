"""How exactly chunked RoPE reproduces each model's rotary embedding.

For every model case of ``tests/test_rope.py`` and every dtype, over 2000 random
positions in [0, 131072] (head size 128, 4 heads, x ~ N(0, 1)), the max abs error of:

* ``a_vs_hf_fp32``: ``rotate`` vs transformers' rotary run in float32 on the same input,
  rounded to the dtype (what the tests compare);
* ``a_vs_hf_native``: ``rotate`` vs transformers run natively in the dtype (cos/sin and
  every product rounded to bf16/fp16; we round once);
* ``c_relocate``: ``relocate(rotate(x, p), p, q)`` vs ``rotate(x, q)``;
* ``c_naive_delta``: the same with a rotation by float32 ``(q - p) * inv_freq`` instead,
  for comparison (why ``relocate`` uses ``angle(q) - angle(p)``).

Writes ``benchmarks/results/rope_exactness.json`` and ``.md``. Run from the
repository root: ``python -m benchmarks.rope_exactness``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import torch

from inferscale.compose.rope import RotaryEmbedding

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NUM_POSITIONS, HEADS, HEAD_DIM, MAX_POSITION = 2000, 4, 128, 131_072
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COLUMNS = ("a_vs_hf_fp32", "a_vs_hf_native", "c_relocate", "c_naive_delta")


def load_test_cases() -> ModuleType:
    """``tests/test_rope.py``, so the benchmark measures exactly the tested configs."""
    spec = importlib.util.spec_from_file_location("test_rope", ROOT / "tests" / "test_rope.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def naive_relocate(rope: RotaryEmbedding, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Rotation by the float32 angle ``(dst - src) * inv_freq``, without attention scaling."""
    unscaled = RotaryEmbedding(rope.inv_freq, rope.head_size, style=rope.style)
    return unscaled.rotate(x, dst - src)


def measure(case, dtype: torch.dtype, generator: torch.Generator) -> dict[str, float]:
    """The four max abs errors for one model case and dtype."""
    config = case.config(HEAD_DIM)
    src = torch.randint(0, MAX_POSITION + 1, (NUM_POSITIONS,), generator=generator)
    dst = torch.randint(0, MAX_POSITION + 1, (NUM_POSITIONS,), generator=generator)
    x = torch.randn(NUM_POSITIONS, HEADS, HEAD_DIM, generator=generator).to(dtype)
    # one seq_len for the batch, as transformers: the longest position of src and dst
    rope = RotaryEmbedding.from_hf_config(config, seq_len=int(torch.maximum(src, dst).max()) + 1)
    both = torch.cat((src, dst))
    rotated = rope.rotate(torch.cat((x, x)), both)
    at_src, at_dst = rotated[:NUM_POSITIONS], rotated[NUM_POSITIONS:]
    return {
        "a_vs_hf_fp32": max_abs(rotated, case.hf_rotate(config, torch.cat((x, x)).float(), both).to(dtype)),
        "a_vs_hf_native": max_abs(rotated, case.hf_rotate(config, torch.cat((x, x)), both)),
        "c_relocate": max_abs(rope.relocate(at_src, src, dst), at_dst),
        "c_naive_delta": max_abs(naive_relocate(rope, at_src, src, dst), at_dst),
    }


def to_markdown(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        f"# RoPE exactness: max abs error over {NUM_POSITIONS} random positions in [0, {MAX_POSITION}]",
        "",
        f"head size {HEAD_DIM}, {HEADS} heads, x ~ N(0, 1) (so |x| <= ~5). See benchmarks/rope_exactness.py.",
        "",
        "| config | dtype | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for name, per_dtype in results.items():
        for dtype, errors in per_dtype.items():
            lines.append(f"| {name} | {dtype} | " + " | ".join(f"{errors[c]:.3g}" for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    cases = load_test_cases().CASES
    generator = torch.Generator().manual_seed(0)
    results = {case.name: {name: measure(case, dtype, generator) for name, dtype in DTYPES.items()} for case in cases}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rope_exactness.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = to_markdown(results)
    (RESULTS / "rope_exactness.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
