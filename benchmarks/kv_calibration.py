"""Calibrate stored facts' K/V against prompt injection, with no labels.

Each fact's K/V is encoded behind a few other facts, not behind the ones it is read with, so a
query after injected facts sees keys and values a little unlike those after the same facts as
text. This script fits the correction of :mod:`inferscale.encode.calibration` — per layer and KV
head (``--form head``), one scale on the keys' content (around the key bias: ``k = b + c (k - b)``,
a softmax temperature on what the keys say) and one on the values (``v = s v``); per channel, with
a shift on each (``--form channel``) — so that the model's next-token distributions over a query
after the injected facts match those after the same facts as text (the KL divergence, prompt
injection as the teacher).
No answers are used: the queries are questions about people the facts name, followed by the
answer the model gives from the text (teacher forcing), and the facts come from a corpus that is
not the evaluation's (``benchmarks/fact_corpus.py``: one fact a line, each naming a person).
The product applies the file to the stored K/V at encoding (``Config.calibration``), so a request
costs nothing more.

Each sample is a user: ``--pool`` facts in a stored order (each encoded behind the ``--window``
facts stored before it, as the product's ``facts`` window does), of which ``--k`` are read in a
random order after the instruction, then a question about a person one of them names.

    python benchmarks/kv_calibration.py --model <HF dir> --facts <corpus>/facts.txt --window 10 \
        --k 50 --samples 96 --steps 300 --out kv_calibration.json        # on the GPU
    python benchmarks/kv_calibration.py --model <tiny> --facts facts.txt --k 6 --pool 12 \
        --samples 4 --steps 5 --out /tmp/c.json                          # a CPU smoke

Writes OUT (JSON): the calibration (``key_scale``, ``value_scale``, and in the channel form
``key_shift``, ``value_shift``), the KL before and after on the training samples and on held-out
ones, and the command.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from locomo_accuracy import CLOSINGS, INSTRUCTION, window_policy  # noqa: E402

from inferscale.encode.calibration import FORMS, KVCalibration, corrected  # noqa: E402


@dataclass
class Sample:
    """One user's read: token ids of the prefix, the facts in segment order and the query (with the
    teacher's answer), the facts' stored K/V, and the teacher's log-probabilities over the query."""

    prefix: list[int]
    facts: list[list[int]]
    query: list[int]
    keys: torch.Tensor  # [layers, segment tokens, kv_heads, head_size], pre-RoPE, prefix first
    values: torch.Tensor
    teacher: torch.Tensor  # [query tokens, vocab] log-probabilities


def read_facts(path: Path) -> list[str]:
    facts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if len(facts) < 2:
        raise SystemExit(f"{path}: expected one fact a line, found {len(facts)}")
    return facts


#: capitalized words a fact may start with that are not a name
_NOT_NAMES = {"In", "On", "At", "The", "A", "An", "After", "Before", "Since", "During", "Last", "Every", "When",
              "Her", "His", "Their", "She", "He", "They", "Each", "Most", "Once", "As", "For"}


def question(fact: str) -> str:
    """A question about the person a fact names (its first capitalized word that is not a
    sentence opener; the corpus' facts name their person)."""
    words = [w.strip(".,;:!?").removesuffix("'s") for w in fact.split()]
    name = next((w for w in words if w[:1].isupper() and w not in _NOT_NAMES), words[0])
    return f"What do you know about {name}?"


def build_samples(model, tokenizer, facts: list[str], args, rng: random.Random, count: int, device) -> list[Sample]:
    from inferscale.compose.prompt import PromptFormat, fact_token_ids
    from inferscale.encode.encoder import FactEncoder
    from inferscale.facts import Fact, make_fact_id

    fmt = PromptFormat.from_tokenizer(tokenizer, INSTRUCTION, CLOSINGS["answer"])
    prefix = fmt.prefix_ids(tokenizer)
    encoder = FactEncoder(model, tokenizer, window_policy(-args.window),
                          batch_size=args.encode_batch, share_prefixes=False)
    prefix_kv = encoder.encode_ids(prefix)
    samples = []
    for _ in range(count):
        pool = rng.sample(facts, min(args.pool, len(facts)))
        stored = [Fact(make_fact_id("calibration", text, None), "calibration", text) for text in pool]
        read = rng.sample(range(len(stored)), min(args.k, len(stored)))
        if args.stored_order:
            read.sort()
        kvs = encoder.encode(stored, progress=False, prefix_ids=prefix, only={stored[i].fact_id for i in read})
        seg_facts = [fact_token_ids(tokenizer, pool[i], "bullet") for i in read]
        ask = fmt.query_ids(tokenizer, question(pool[rng.choice(read)]))
        segment = prefix + [t for f in seg_facts for t in f]
        with torch.no_grad():
            answer = greedy(model, segment + ask, args.answer_tokens, device)
            ids = torch.tensor([segment + ask + answer], device=device)
            logits = model(input_ids=ids).logits[0, len(segment):].float()  # after each query token
        keys = torch.cat([prefix_kv.keys] + [kvs[stored[i].fact_id].keys for i in read], dim=1)
        values = torch.cat([prefix_kv.values] + [kvs[stored[i].fact_id].values for i in read], dim=1)
        samples.append(Sample(prefix, seg_facts, ask + answer, keys.to(device), values.to(device),
                              torch.log_softmax(logits, -1)))
    return samples


def greedy(model, ids: list[int], n: int, device) -> list[int]:
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=n, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device))
    return out[0, len(ids):].tolist()


class Scales(torch.nn.Module):
    """The correction being fitted (:func:`inferscale.encode.calibration.corrected`), log-parametrized
    scales. ``head`` form: a key content scale and a value scale per layer and KV head. ``channel``
    form: both per channel of each head, and a shift on the keys and on the values, each in units of
    ``spread`` (``[2, layers, kv_heads, head_size]``: the RMS of the facts' key content and values per
    channel), so one learning rate suits every channel."""

    def __init__(self, layers: int, kv_heads: int, head_size: int, form: str = "head", spread: torch.Tensor | None = None):
        super().__init__()
        shape = (layers, kv_heads) if form == "head" else (layers, kv_heads, head_size)
        self.form = form
        self.log_key = torch.nn.Parameter(torch.zeros(shape))
        self.log_value = torch.nn.Parameter(torch.zeros(shape))
        if form == "channel":
            self.key_shift = torch.nn.Parameter(torch.zeros(layers, kv_heads, head_size))
            self.value_shift = torch.nn.Parameter(torch.zeros(layers, kv_heads, head_size))
            self.register_buffer("spread", spread if spread is not None else torch.ones(2, *shape))

    def shifts(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.form == "head":
            return None, None
        return self.key_shift * self.spread[0], self.value_shift * self.spread[1]

    def apply(self, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, facts_from: int):
        """Corrected copies of ``keys``/``values`` ``[layers, T, kv_heads, d]``; tokens before
        ``facts_from`` (the prefix, computed as text) are left alone."""
        facts_k, facts_v = corrected(keys[:, facts_from:], values[:, facts_from:], bias,
                                     self.log_key.exp(), self.log_value.exp(), *self.shifts())
        return torch.cat([keys[:, :facts_from], facts_k], dim=1), torch.cat([values[:, :facts_from], facts_v], dim=1)

    def calibration(self, model: str) -> KVCalibration:
        key_shift, value_shift = (t.detach().cpu() if t is not None else None for t in self.shifts())
        return KVCalibration(self.log_key.detach().exp().cpu(), self.log_value.detach().exp().cpu(),
                             key_shift, value_shift, model=model)


def spread(samples: list[Sample], bias: torch.Tensor) -> torch.Tensor:
    """Per layer, KV head and channel, the RMS of the facts' key content (``k - b``) and values."""
    keys = torch.cat([(s.keys[:, len(s.prefix):].float() - bias[:, None]) for s in samples], dim=1)
    values = torch.cat([s.values[:, len(s.prefix):].float() for s in samples], dim=1)
    return torch.stack([keys.pow(2).mean(1).sqrt(), values.pow(2).mean(1).sqrt()]).clamp_min(1e-6)


def student_logprobs(model, rope, sample: Sample, scales: Scales | None, bias: torch.Tensor) -> torch.Tensor:
    """Log-probabilities over the query after the facts' stored K/V, placed at 0..m-1 with RoPE."""
    from transformers import DynamicCache

    keys, values = sample.keys, sample.values
    if scales is not None:
        keys, values = scales.apply(keys, values, bias, len(sample.prefix))
    m = keys.shape[1]
    positions = torch.arange(m, device=keys.device)
    cache = DynamicCache(config=model.config)
    for layer in range(keys.shape[0]):
        k = rope.rotate(keys[layer].float(), positions).to(model.dtype)
        cache.update(k.transpose(0, 1)[None], values[layer].transpose(0, 1)[None].to(model.dtype), layer)
    ids = torch.tensor([sample.query], device=keys.device)
    out = model(input_ids=ids, past_key_values=cache, position_ids=torch.arange(m, m + ids.shape[1], device=keys.device)[None])
    return torch.log_softmax(out.logits[0].float(), -1)


def kl(model, rope, samples: list[Sample], scales: Scales | None, bias: torch.Tensor) -> float:
    """Mean KL(teacher || student) per query token."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for s in samples:
            student = student_logprobs(model, rope, s, scales, bias)
            total += float((s.teacher.exp() * (s.teacher - student)).sum())
            tokens += len(s.query)
    return total / max(tokens, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory (the serving model)")
    parser.add_argument("--facts", type=Path, required=True, help="one fact a line (benchmarks/fact_corpus.py's facts.txt)")
    parser.add_argument("--window", type=int, default=10, help="facts each fact is encoded behind (the facts window)")
    parser.add_argument("--k", type=int, default=50, help="facts read per sample")
    parser.add_argument("--pool", type=int, default=200, help="facts a sample's user has stored")
    parser.add_argument("--samples", type=int, default=96, help="training samples (users)")
    parser.add_argument("--held-out", type=int, default=None, help="held-out samples (default: a quarter of --samples)")
    parser.add_argument("--answer-tokens", type=int, default=8, help="teacher answer tokens scored after the question")
    parser.add_argument("--form", choices=FORMS, default="head",
                        help="head: a key content scale and a value scale per layer and KV head; channel: both per "
                             "channel, with a shift on keys and values")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--encode-batch", type=int, default=32)
    parser.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--stored-order", action="store_true",
                        help="read the facts in the order they were stored (a check: with --window >= --pool the "
                             "injected K/V are the text's own, and the KL before fitting is ~0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inferscale.compose.rope import RotaryEmbedding
    from inferscale.encode.capture import attention_modules, key_biases, text_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    rope = RotaryEmbedding.from_hf_config(model.config)
    config = text_config(model)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bias = key_biases(attention_modules(model), heads, size).to(device)
    facts = read_facts(args.facts)
    rng = random.Random(args.seed)
    start = time.perf_counter()
    held = args.held_out if args.held_out is not None else max(1, args.samples // 4)
    train = build_samples(model, tokenizer, facts, args, rng, args.samples, device)
    test = build_samples(model, tokenizer, facts, args, rng, held, device)
    built_s = time.perf_counter() - start
    scales = Scales(config.num_hidden_layers, heads, size, args.form,
                    spread(train, bias) if args.form == "channel" else None).to(device)
    before = {"train": kl(model, rope, train, None, bias), "held_out": kl(model, rope, test, None, bias)}
    print(f"{len(train)} + {len(test)} samples in {built_s:.0f} s; KL before: {before}", flush=True)
    optimizer = torch.optim.Adam(scales.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(args.steps):
        sample = train[step % len(train)]
        student = student_logprobs(model, rope, sample, scales, bias)
        loss = (sample.teacher.exp() * (sample.teacher - student)).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % max(1, args.steps // 10) == 0:
            print(f"step {step:4d}  KL {loss.item():.4f}", flush=True)
    after = {"train": kl(model, rope, train, scales, bias), "held_out": kl(model, rope, test, scales, bias)}
    print(f"KL after: {after} ({time.perf_counter() - start:.0f} s)", flush=True)
    result = {"command": " ".join(["python", *sys.argv]), "model": Path(args.model).name, "device": device,
              "dtype": str(dtype).removeprefix("torch."), "window": args.window, "k": args.k, "pool": args.pool,
              "samples": len(train), "held_out": len(test), "steps": args.steps, "lr": args.lr,
              "kl_before": before, "kl_after": after, **scales.calibration(Path(args.model).name).to_dict()}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
