"""K/V at rest in fp8: how far the round trip moves real K/V, and the bytes it saves.

    python benchmarks/fp8_at_rest.py --facts 120 --out benchmarks/results/fp8_at_rest_qwen05_cpu   # ~5 min, CPU

1. encodes LoCoMo facts (``--locomo``, the first conversations, ``--facts`` of them, each behind the
   instruction prefix) with Qwen2.5-Coder-0.5B-Instruct in ``--dtype`` (transformers, on the CPU);
2. quantizes their K/V to e4m3 in every way of a grid and measures the round trip's error:

   * the scale's granularity: one per fact, layer and KV head (``head``) or one per token too (``token``);
   * the scale: a power of two (``pow2``, the smallest with ``|x − o| ≤ 448 s``) or ``amax / 448`` (``exact``);
   * the offset subtracted first: none, the model's key bias (``bias``, keys only: what
     :mod:`inferscale.encode.calibration` keeps apart) or the fact's mean of each channel over its tokens
     (``mean``);

   each as the relative error ``‖x̂ − x‖ / ‖x‖``, as ``‖x̂ − x‖ / ‖x − x̄‖`` (against what varies over a
   fact's tokens: a key channel that only carries the bias tells attention nothing), and the worst
   layer and head of that. The product's quantizer (:func:`inferscale.kv_fp8.fp8_round_trip`) is the
   ``head, pow2, mean`` row, checked here against it;
3. the bytes: per fact at rest (the disk store's segment file and the memory tier's count, model dtype
   and fp8), and host → device bytes per request of ``--k`` facts (what the fused write reads from the
   pinned tier), for the 0.5B and, from their K/V shapes and the same facts' token counts, for larger
   models.

Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inferscale.kv_fp8 import FP8, FP8_E4M3, FP8_MAX, all_at_rest, fp8_round_trip  # noqa: E402

MODEL = "qwen2.5-coder-0.5b-instruct"
#: (name, layers, KV heads, head size) of models whose bytes are extrapolated from the facts' token counts
SHAPES = [("qwen2.5-0.5b", 24, 2, 64), ("qwen2.5-1.5b", 28, 2, 128), ("qwen2.5-7b", 28, 4, 128),
          ("llama-3.1-8b", 32, 8, 128)]


def encode(locomo: Path, count: int, dtype: str):
    """``count`` LoCoMo facts' K/V (model dtype, ``[L, T, H, D]``), the model's key bias ``[L, H, D]`` and
    the instruction prefix's length."""
    from inferscale.compose.prompt import PromptFormat
    from inferscale.config import DEFAULT_INSTRUCTION
    from inferscale.datasets.locomo import load_all
    from inferscale.encode.encoder import FactEncoder
    from inferscale.encode.weights import model_dir
    from inferscale.facts import Fact, make_fact_id

    facts = [Fact(make_fact_id("u", text, turn), "u", text, turn)
             for conversation in load_all(locomo) for text, turn in conversation.all_facts()][:count]
    with FactEncoder.from_spec(str(model_dir(MODEL, "float32")), dtype=dtype) as encoder:
        prefix = PromptFormat.from_tokenizer(encoder.tokenizer, DEFAULT_INSTRUCTION).prefix_ids(encoder.tokenizer)
        kvs = encoder.encode(facts, prefix_ids=prefix, progress=True)
        return list(kvs.values()), encoder.key_bias, len(prefix)


def round_trip(x: torch.Tensor, per_token: bool, pow2: bool, offset: torch.Tensor | float) -> torch.Tensor:
    """``x`` ``[L, T, H, D]`` through e4m3 with a scale per layer and head (and token), around ``offset``."""
    centred = x.float() - offset
    amax = centred.abs().amax(dim=(3,) if per_token else (1, 3), keepdim=True)
    scale = amax / FP8_MAX
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
        scale = torch.where(amax > FP8_MAX * scale, 2 * scale, scale)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    codes = (centred / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (codes.float() * scale + offset).to(x.dtype)


def offsets(kind: str, x: torch.Tensor, part: str, bias: torch.Tensor) -> torch.Tensor | float | None:
    if kind == "none":
        return 0.0
    if kind == "bias":
        return bias[:, None].float() if part == "keys" else None
    return x.float().mean(dim=1, keepdim=True).to(torch.bfloat16).float()


def errors(kvs, bias: torch.Tensor) -> list[dict]:
    """The grid's errors over every fact (sums of squares pooled over facts)."""
    rows = []
    for part in ("keys", "values"):
        for granularity in ("head", "token"):
            for scale in ("pow2", "exact"):
                for offset in ("none", "bias", "mean"):
                    sums, worst = [0.0, 0.0, 0.0], 0.0
                    for kv in kvs:
                        x = getattr(kv, part)
                        o = offsets(offset, x, part, bias)
                        if o is None:
                            break
                        error = (round_trip(x, granularity == "token", scale == "pow2", o).float() - x.float())
                        varying = x.float() - x.float().mean(dim=1, keepdim=True)
                        sums[0] += float(error.pow(2).sum())
                        sums[1] += float(x.float().pow(2).sum())
                        sums[2] += float(varying.pow(2).sum())
                        per_head = error.pow(2).sum(dim=(1, 3)) / varying.pow(2).sum(dim=(1, 3)).clamp(min=1e-30)
                        worst = max(worst, float(per_head.max()) ** 0.5)
                    else:
                        rows.append({"part": part, "scale_per": granularity, "scale": scale, "offset": offset,
                                     "rel_error": (sums[0] / sums[1]) ** 0.5, "rel_error_varying": (sums[0] / sums[2]) ** 0.5,
                                     "worst_head_varying": worst})
    return rows


def product_error(kvs) -> dict:
    """:func:`fp8_round_trip`'s errors (the product's quantizer), as the grid measures them."""
    out = {}
    for part in ("keys", "values"):
        error = sum(float((getattr(fp8_round_trip(kv), part).float() - getattr(kv, part).float()).pow(2).sum())
                    for kv in kvs)
        varying = sum(float((getattr(kv, part).float() - getattr(kv, part).float().mean(1, keepdim=True)).pow(2).sum())
                      for kv in kvs)
        out[part] = (error / varying) ** 0.5
    return out


def stored_bytes(kvs) -> dict:
    """Bytes per fact as the disk store's files and a pinned tier hold them, model dtype and fp8."""
    from inferscale.config import BackendSpec, build
    from inferscale.storage.disk import DiskStore

    facts = {f"f{i}": kv for i, kv in enumerate(kvs)}
    out = {}
    for form in ("model", FP8_E4M3):
        with tempfile.TemporaryDirectory() as root:
            disk = DiskStore(DiskStore.Options(root=root))
            disk.put("u", all_at_rest(facts, form))
            files = sum(p.stat().st_size for p in disk.user_dir("u").glob("seg-*"))
            tier = build("kv_store", BackendSpec("pinned"), kv_dtype_at_rest=form, device="cpu")
            tier.load("u", facts, "e")
            out[form] = {"disk_bytes_per_fact": files / len(facts), "tier_bytes_per_fact": tier.nbytes("u") / len(facts)}
    return out


def bus_bytes(lengths: list[int], k: int, prefix: int) -> list[dict]:
    """Per model shape, bf16 and fp8: bytes of a fact of the mean length, and host → device bytes of a
    request of ``k`` such facts after the ``prefix``: what the fused write reads from the pinned tier
    (fp8: the codes; the dequant lies in GPU memory)."""
    from inferscale.storage.layout import KVLayout

    tokens = prefix + k * statistics.mean(lengths)
    rows = []
    for name, layers, heads, size in SHAPES:
        model = KVLayout(layers, heads, size, torch.bfloat16)
        fp8 = model.kept_as(FP8_E4M3)
        rows.append({"model": name, "fact_bytes": model.nbytes([round(statistics.mean(lengths))]),
                     "fact_bytes_fp8": fp8.nbytes([round(statistics.mean(lengths))]),
                     "request_bytes": tokens * model.token_nbytes(), "request_bytes_fp8": tokens * fp8.token_nbytes(),
                     "dequant_bytes_in_gpu_memory": (1 + k) * fp8.fact_nbytes()})
    return rows


def markdown(result: dict) -> str:
    lines = [f"# fp8 at rest: round-trip error and bytes ({result['model']}, {result['dtype']}, "
             f"{result['facts']} LoCoMo facts, {result['tokens']} tokens)", "",
             "Relative error of the round trip, pooled over facts: against ‖x‖, and against what varies over a "
             "fact's tokens (‖x − x̄‖); the worst layer and head of the latter. The product: **head, pow2, mean** "
             f"(fp8_round_trip: keys {result['product']['keys']:.4f}, values {result['product']['values']:.4f}).", "",
             "| part | scale per | scale | offset | ‖x̂−x‖/‖x‖ | ‖x̂−x‖/‖x−x̄‖ | worst head |", "|---|---|---|---|---|---|---|"]
    for row in result["errors"]:
        lines.append(f"| {row['part']} | {row['scale_per']} | {row['scale']} | {row['offset']} | {row['rel_error']:.4f} "
                     f"| {row['rel_error_varying']:.4f} | {row['worst_head_varying']:.3f} |")
    lines += ["", "Bytes per fact at rest (measured, 0.5B):", "", "| form | disk (segment file) | memory tier |",
              "|---|---|---|"]
    for form, row in result["stored"].items():
        lines.append(f"| {form} | {row['disk_bytes_per_fact']:,.0f} | {row['tier_bytes_per_fact']:,.0f} |")
    lines += ["", f"Per model in bf16, a fact of {result['mean_tokens']:.0f} tokens and a request of k = {result['k']} facts after a "
              f"{result['prefix_tokens']}-token prefix (host → device: the codes; an fp8 fact's dequant lies in GPU memory):",
              "", "| model | fact bytes | fact bytes fp8 | request H→D | request H→D fp8 | dequant in GPU memory |",
              "|---|---|---|---|---|---|"]
    for row in result["bytes"]:
        lines.append(f"| {row['model']} | {row['fact_bytes']:,} | {row['fact_bytes_fp8']:,} | "
                     f"{row['request_bytes'] / 2**20:.2f} MiB | {row['request_bytes_fp8'] / 2**20:.2f} MiB | "
                     f"{row['dequant_bytes_in_gpu_memory'] / 2**20:.2f} MiB |")
    lines += ["", f"`{result['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--locomo", default=str(REPO.parent / "shared" / "data" / "locomo"))
    parser.add_argument("--facts", type=int, default=120)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--out", default="benchmarks/results/fp8_at_rest_qwen05_cpu")
    args = parser.parse_args(argv)
    began = time.monotonic()
    kvs, bias, prefix_tokens = encode(Path(args.locomo), args.facts, args.dtype)
    lengths = [kv.num_tokens for kv in kvs]
    result = {"model": MODEL, "dtype": args.dtype, "facts": len(kvs), "tokens": sum(lengths),
              "mean_tokens": statistics.mean(lengths), "key_bias_max": float(bias.abs().max()), "k": args.k,
              "prefix_tokens": prefix_tokens, "errors": errors(kvs, bias), "product": product_error(kvs),
              "stored": stored_bytes(kvs),
              "bytes": bus_bytes(lengths, args.k, prefix_tokens),
              "command": " ".join(["python", *sys.argv]), "seconds": time.monotonic() - began}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
