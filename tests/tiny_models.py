"""Tiny random-weight Llama / Qwen2 / Qwen3 models with an offline-trained tokenizer.

Each model is a complete Hugging Face directory (config.json,
model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json with a ChatML chat template) that both transformers and
vLLM load. Head size 32 is one vLLM's CPU attention backend supports.

Everything is seeded, so a directory is rebuilt identically; it is cached
under ``$INFERSCALE_CACHE/tiny/<RECIPE>/<arch>-<dtype>``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

#: bump when the recipe changes, so stale cached directories are not reused
RECIPE = "v1"
ARCHS = ("llama", "qwen2", "qwen3")
#: wider variants for tensor parallelism on GPUs: name -> (architecture, config overrides). Head
#: size 64 (FlashAttention's smallest common size); "kv8" splits 4 + 4 KV heads over 2 ranks like
#: Llama-3.1-8B's 8, "kv1" has fewer KV heads than 2 ranks (vLLM replicates the head).
VARIANTS = {
    "llama-kv8": ("llama", {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8,
                            "head_dim": 64, "intermediate_size": 1024}),
    "llama-kv1": ("llama", {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 1,
                            "head_dim": 64, "intermediate_size": 1024}),
}
DONE_MARKER = ".tiny-complete"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 1024
SEED = 1234

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_EXTRA_TEXT = """\
Alice moved to Lisbon in 2021 and works as a nurse at the city hospital.
Bob has two dogs named Rex and Luna; he walks them every morning before work.
Caroline is researching adoption agencies and wants to become a counselor.
Melanie painted a sunrise over the lake last summer and plans to run a charity race.
The user prefers tea over coffee, is allergic to peanuts, and speaks French and German.
What did you do last weekend? I went hiking with my sister and we saw a waterfall.
My favourite book is about a lighthouse keeper who writes letters to the sea.
"""

_CORPUS_MODULES = (
    "argparse",
    "collections",
    "functools",
    "itertools",
    "json",
    "re",
    "string",
    "textwrap",
    "logging",
    "pathlib",
    "dataclasses",
    "typing",
    "unittest",
    "heapq",
    "bisect",
    "statistics",
    "fractions",
    "decimal",
    "datetime",
    "calendar",
)


def corpus() -> list[str]:
    """Built-in English text: standard-library docstrings plus a few chatty lines."""
    import importlib
    import inspect

    texts = _EXTRA_TEXT.splitlines()
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        texts.append(inspect.getdoc(module) or "")
        for _, obj in sorted(vars(module).items()):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == name:
                texts.append(inspect.getdoc(obj) or "")
    return [t for t in texts if t]


def build_tokenizer():
    """A byte-level BPE (vocab ≈ 1000) trained offline, wrapped as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


def build_config(arch: str, tokenizer):
    """A ≈1-3 M parameter config: 4 layers, hidden 128, 4 q / 2 kv heads, head size 32
    (a :data:`VARIANTS` name: its architecture with its overrides)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    arch, overrides = VARIANTS.get(arch, (arch, {}))
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "qwen2":  # Qwen2 always has q/k/v bias
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "qwen3":  # Qwen3 has q_norm / k_norm before RoPE
        return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    raise ValueError(f"unknown tiny arch {arch!r} — known: {', '.join(ARCHS)}")


def build_model(arch: str, tokenizer, dtype: str = "float32"):
    """Seeded random weights; biases and norm weights perturbed so that they matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED + (*ARCHS, *VARIANTS).index(arch))
    model = AutoModelForCausalLM.from_config(build_config(arch, tokenizer), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model = model.to(getattr(torch, dtype)).eval()
    model.config.dtype = getattr(torch, dtype)
    return model


def build_dir(arch: str, out: Path, dtype: str = "float32") -> Path:
    """Write a complete HF directory for ``arch`` into ``out``."""
    from transformers import GenerationConfig

    tokenizer = build_tokenizer()
    model = build_model(arch, tokenizer, dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def tiny_root() -> Path:
    from inferscale.encode.weights import cache_dir

    return cache_dir() / "tiny" / RECIPE


def tiny_model_dir(arch: str, dtype: str = "float32", root: Path | None = None) -> Path:
    """The cached directory of a tiny model, built on first use (temp dir + rename)."""
    if arch not in ARCHS and arch not in VARIANTS:
        raise ValueError(f"unknown tiny arch {arch!r} — known: {', '.join((*ARCHS, *VARIANTS))}")
    root = root or tiny_root()
    target = root / f"{arch}-{dtype}"
    if (target / DONE_MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}."))
    try:
        build_dir(arch, tmp, dtype)
        (tmp / DONE_MARKER).write_text(RECIPE + "\n")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / DONE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
