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
random order after the instruction, then a question about a person one of them names (``--k
5,10,20,50``: the samples read each number in turn, so one fit serves every k).

    python benchmarks/kv_calibration.py --model <HF dir> --facts <corpus>/facts.txt --window 10 \
        --k 5,10,20,50 --samples 96 --steps 300 --out kv_calibration.json   # on the GPU
    python benchmarks/kv_calibration.py --model <tiny> --facts facts.txt --k 6 --pool 12 \
        --samples 4 --steps 5 --out /tmp/c.json                          # a CPU smoke

With ``--locomo DIR`` the KL before and after is also measured on LoCoMo questions after their
retrieved facts (``locomo``: conversations the fit never saw, their answers never read).

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

from locomo import CLOSINGS, INSTRUCTION, window_policy  # noqa: E402

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


class Reader:
    """What every sample shares: the model, the prompt format, the prefix and its K/V, and an
    encoder of facts behind the ``--window`` facts stored before each."""

    def __init__(self, model, tokenizer, args, device):
        from inferscale.compose.prompt import PromptFormat
        from inferscale.encode.encoder import FactEncoder

        self.model, self.tokenizer, self.args, self.device = model, tokenizer, args, device
        self.fmt = PromptFormat.from_tokenizer(tokenizer, INSTRUCTION, CLOSINGS["answer"])
        self.prefix = self.fmt.prefix_ids(tokenizer)
        self.encoder = FactEncoder(model, tokenizer, window_policy(-args.window), batch_size=args.encode_batch,
                                   share_prefixes=False)
        self.prefix_kv = self.encoder.encode_ids(self.prefix)

    def encode(self, stored: list, only: set[str]) -> dict:
        return self.encoder.encode(stored, progress=False, prefix_ids=self.prefix, only=only)

    def sample(self, texts: list[str], kvs: list, ask: str) -> Sample:
        """The facts ``texts`` (with their K/V ``kvs``) read in this order, then the question ``ask``
        and the answer the model gives from the text."""
        from inferscale.compose.prompt import fact_token_ids

        seg_facts = [fact_token_ids(self.tokenizer, text, "bullet") for text in texts]
        query = self.fmt.query_ids(self.tokenizer, ask)
        segment = self.prefix + [t for f in seg_facts for t in f]
        with torch.no_grad():
            answer = greedy(self.model, segment + query, self.args.answer_tokens, self.device)
            ids = torch.tensor([segment + query + answer], device=self.device)
            logits = self.model(input_ids=ids).logits[0, len(segment):].float()  # after each query token
        keys = torch.cat([self.prefix_kv.keys] + [kv.keys for kv in kvs], dim=1)
        values = torch.cat([self.prefix_kv.values] + [kv.values for kv in kvs], dim=1)
        return Sample(self.prefix, seg_facts, query + answer, keys.to(self.device), values.to(self.device),
                      torch.log_softmax(logits, -1))


def build_samples(reader: Reader, facts: list[str], rng: random.Random, count: int) -> list[Sample]:
    """Users drawn from the corpus: ``--pool`` facts stored, ``--k`` read in a random order, a
    question about a person one of them names."""
    from inferscale.facts import Fact, make_fact_id

    args, samples = reader.args, []
    for n in range(count):
        pool = rng.sample(facts, min(args.pool, len(facts)))
        stored = [Fact(make_fact_id("calibration", text, None), "calibration", text) for text in pool]
        read = rng.sample(range(len(stored)), min(args.k[n % len(args.k)], len(stored)))
        if args.stored_order:
            read.sort()
        kvs = reader.encode(stored, {stored[i].fact_id for i in read})
        samples.append(reader.sample([pool[i] for i in read], [kvs[stored[i].fact_id] for i in read],
                                     question(pool[rng.choice(read)])))
    return samples


def locomo_samples(reader: Reader, data: Path, count: int, retrieval: Path | None, embedder: str, seed: int) -> list[Sample]:
    """A check on conversations the fit never saw: ``count`` LoCoMo questions (a stratified, seeded
    sample), each after its top ``--k`` facts (a list: in turn) (retrieved as ``locomo_accuracy.py`` retrieves them,
    composed the most relevant last), each fact encoded behind the ``--window`` facts stored before
    it. The teacher's answer from the text is scored, as in the fit; LoCoMo's answers are not read."""
    from types import SimpleNamespace

    from locomo import load_items, retrieve

    from inferscale.facts import Fact, make_fact_id

    convs, keys = load_items(SimpleNamespace(data=data, sample=count, seed=seed))
    ks = reader.args.k
    retrieved = retrieve(convs, keys, max(ks), retrieval, embedder)
    k_of = {key: ks[n % len(ks)] for n, key in enumerate(keys)}
    samples = []
    for cid in dict.fromkeys(c for c, _ in keys):
        conv = convs[cid]
        stored = [Fact(make_fact_id(cid, text, src), cid, text, src) for text, src in conv.all_facts()]
        asked = [(i, retrieved[(c, i)][: k_of[(c, i)]]) for c, i in keys if c == cid]
        kvs = reader.encode(stored, {stored[j].fact_id for _, top in asked for j in top})
        for i, top in asked:
            read = list(reversed(top))  # the relevance composer: the most relevant last
            samples.append(reader.sample([stored[j].text for j in read], [kvs[stored[j].fact_id] for j in read],
                                         conv.questions[i].question))
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
        # in float32: k - b cancels (|b| reaches 354 on the 1.5B), which bf16 cannot carry
        facts_k, facts_v = corrected(keys[:, facts_from:].float(), values[:, facts_from:].float(), bias,
                                     self.log_key.exp(), self.log_value.exp(), *self.shifts())
        return (torch.cat([keys[:, :facts_from].float(), facts_k], dim=1),
                torch.cat([values[:, :facts_from].float(), facts_v], dim=1))

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
    parser.add_argument("--k", type=lambda v: [int(k) for k in v.split(",")], default=[50],
                        help="facts read per sample; a list (5,10,20,50): the samples take each in turn")
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
    parser.add_argument("--locomo", type=Path, default=None,
                        help="LoCoMo conversations (../shared/data/locomo): also the KL before and after on "
                             "--locomo-questions of their questions, which the fit never sees")
    parser.add_argument("--locomo-questions", type=int, default=64)
    parser.add_argument("--locomo-retrieval", type=Path, default=None,
                        help="locomo_accuracy.py's retrieval cache (benchmarks/results/locomo_retrieval_minilm.json; "
                             "default: retrieve with --embedder)")
    parser.add_argument("--embedder", default="minilm", help="the retrieval embedder when the cache lacks questions")
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
    reader = Reader(model, tokenizer, args, device)
    train = build_samples(reader, facts, rng, args.samples)
    test = build_samples(reader, facts, rng, held)
    locomo = locomo_samples(reader, args.locomo, args.locomo_questions, args.locomo_retrieval, args.embedder,
                            args.seed) if args.locomo else []
    built_s = time.perf_counter() - start
    scales = Scales(config.num_hidden_layers, heads, size, args.form,
                    spread(train, bias) if args.form == "channel" else None).to(device)
    sets = {"train": train, "held_out": test, **({"locomo": locomo} if locomo else {})}
    before = {name: kl(model, rope, group, None, bias) for name, group in sets.items()}
    print(f"{len(train)} + {len(test)} + {len(locomo)} samples in {built_s:.0f} s; KL before: {before}", flush=True)
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
    after = {name: kl(model, rope, group, scales, bias) for name, group in sets.items()}
    print(f"KL after: {after} ({time.perf_counter() - start:.0f} s)", flush=True)
    result = {"command": " ".join(["python", *sys.argv]), "model": Path(args.model).name, "device": device,
              "dtype": str(dtype).removeprefix("torch."), "window": args.window, "k": args.k, "pool": args.pool,
              "samples": len(train), "held_out": len(test), "locomo_questions": len(locomo), "steps": args.steps, "lr": args.lr,
              "kl_before": before, "kl_after": after, **scales.calibration(Path(args.model).name).to_dict()}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
