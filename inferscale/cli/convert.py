"""``inferscale convert``: a known offline model, or a GGUF file, as a Hugging Face directory for vLLM."""

from __future__ import annotations

import os


def cmd_convert(args) -> int:
    """Convert a known offline model (or a GGUF file) to a Hugging Face directory for vLLM."""
    from inferscale.encode import weights as models

    if os.path.isfile(args.model):
        print(models.convert_gguf(args.model, args.out, args.dtype))
    else:
        print(models.model_dir(args.model, args.dtype))
    return 0


def add_parsers(sub) -> None:
    convert = sub.add_parser("convert", help=cmd_convert.__doc__)
    convert.add_argument("model", help="a known model name (e.g. qwen2.5-coder-0.5b-instruct) or a .gguf file")
    convert.add_argument("--out", help="output directory (for a GGUF file)")
    convert.add_argument("--dtype", default="bfloat16", help="dtype of the converted weights: bfloat16 "
                                                             "(default), float16, or float32 (what the default config serves)")
    convert.set_defaults(func=cmd_convert)
