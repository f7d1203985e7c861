"""Train fact wrappers (:mod:`inferscale.encode.wrappers`) by distillation against prompt injection.

The model stays frozen; only a few input embeddings are trained: ``--header`` vectors before each
fact and ``--trailer`` vectors after it, encoded offline with the fact behind its facts window.
The target is prompt injection: after a user's facts as text, a question about one of them, the
answer the model gives from the text (teacher forcing) — the student reads the same facts as
stored, wrapped K/V, and the loss is the KL divergence from the teacher over the answer's tokens.

The data is the model's own, never an evaluation set's: facts it wrote about people
(``benchmarks/fact_corpus.py``'s ``facts.txt``, where the facts written about one person come
together). A user holds ``--facts-per-user`` consecutive facts of the corpus in a seeded shuffled
order (stored order: each fact is encoded behind the ``--window`` facts stored before it, as the
product's ``facts`` window does); a sample reads ``k`` of them (``--k``, in turn) in a random
order, one of them the fact the sample asks about. ``--questions model``: the model writes a
question about that fact and answers it from the facts as text (greedy); ``--questions recall``:
a question from a fixed set of phrasings about the fact's person, and the fact's own text as the
answer the teacher is read along (nothing generated, so samples are cheap and many). Held-out
users measure the KL before and after (and as many training samples, the first); with
``--eval-every`` they are measured during training too and the vectors of the lowest held-out KL
are kept (early stopping).

    python benchmarks/train_wrappers.py --model qwen2.5-coder-0.5b-instruct --facts /work/data/facts05/facts.txt \\
        --trailer 4 --users 20 --steps 400 --out qwen05.wrappers.safetensors            # CPU, the 0.5B
    python benchmarks/train_wrappers.py --model <1.5B dir> --facts <corpus>/facts.txt --users 120 --steps 1500 ...  # GPU

Writes the wrappers file (``--out``) and, beside it, ``<out>.json``: the command, the KL before and
after on the training and held-out samples, and the loss curve.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from locomo import CLOSINGS, INSTRUCTION  # noqa: E402

from inferscale.encode import distill  # noqa: E402
from inferscale.encode.wrappers import FactWrappers, embedding_slots  # noqa: E402

#: capitalized words a fact may start with that are not a name
NOT_NAMES = {"In", "On", "At", "The", "A", "An", "After", "Before", "Since", "During", "Last", "Every", "When",
             "Her", "His", "Their", "She", "He", "They", "Each", "Most", "Once", "As", "For", "This", "That"}
#: ``--questions recall``: what a sample asks about the fact's person (the answer: the fact itself)
RECALL_QUESTIONS = ("What do you know about {name}?", "Tell me something about {name}.", "What did {name} do?",
                    "What is one fact about {name}?", "What happened with {name}?", "Remind me about {name}.")
QUESTION_PROMPT = ("Write one short question about {name} that this fact answers, naming {name}. "
                   "Reply with the question only.\nFact: {fact}")


def person_of(fact: str) -> str | None:
    """The person a fact names: its first capitalized word that is not a sentence opener."""
    for word in fact.split():
        word = word.strip(".,;:!?\"'").removesuffix("'s")
        if word[:1].isupper() and word not in NOT_NAMES and word.isalpha():
            return word
    return None


@dataclass
class Stored:
    """One stored fact encoded for training: its ids, the row's cache (the model's, post-RoPE, up to
    the fact's end, or up to its context's end when there is a header), and its pre-RoPE K/V."""

    ids: list[int]
    start: int  # the fact's first position in its row
    cache: tuple  # per layer (keys, values) [1, kv_heads, tokens, head_size], stored in bfloat16
    keys: torch.Tensor  # [layers, tokens, kv_heads, head_size] pre-RoPE (no header only)
    values: torch.Tensor


@dataclass
class Sample:
    read: list[int]  # indices into the user's stored facts, in segment order
    user: int
    query: list[int]  # the question's ids, then the teacher's answer
    answer: int  # answer tokens at the end of ``query``
    top_ids: torch.Tensor  # [answer, top] the teacher's most likely tokens per answer position
    top_logprobs: torch.Tensor


class Trainer:
    """The frozen model, the prompt format, the users' encoded facts and the vectors being trained."""

    def __init__(self, model, tokenizer, args, device):
        from inferscale.compose.prompt import PromptFormat
        from inferscale.compose.rope import RotaryEmbedding

        self.model, self.tokenizer, self.args, self.device = model, tokenizer, args, device
        self.rope = RotaryEmbedding.from_hf_config(model.config)
        self.fmt = PromptFormat.from_tokenizer(tokenizer, INSTRUCTION, CLOSINGS["answer"])
        self.prefix = self.fmt.prefix_ids(tokenizer)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        embedding = model.get_input_embeddings().weight
        self.filler = tokenizer.encode(" ", add_special_tokens=False)[-1]  # never a rendered fact's first or last
        base = embedding[self.filler].detach().float()
        n = args.header + args.trailer
        self.vectors = torch.nn.Parameter(base.repeat(n, 1) + 0.01 * base.norm() / base.numel() ** 0.5
                                          * torch.randn(n, base.numel(), generator=torch.Generator().manual_seed(args.seed)))
        self.scale = float(embedding.detach().float().pow(2).mean().sqrt())
        self.prefix_keys, self.prefix_values = self._prefix_kv()

    def fact_ids(self, text: str) -> list[int]:
        from inferscale.compose.prompt import fact_token_ids

        return fact_token_ids(self.tokenizer, text, "bullet")

    def _prefix_kv(self):
        cache = self._run([self.prefix])
        return self._pre_rope(cache, 0, 0, len(self.prefix))

    def _run(self, seqs: list[list[int]]):
        from inferscale.encode import prefill

        return prefill.forward(self.model, None, seqs, self.pad, keep_cache=True)

    def _pre_rope(self, cache, b: int, start: int, end: int):
        """Row ``b``'s K/V at ``start..end`` from a model cache, keys with RoPE undone."""
        positions = torch.arange(start, end, device=self.device)
        keys = torch.stack([self.rope.inverse(layer.keys[b, :, start:end].transpose(0, 1).float(), positions)
                            for layer in cache.layers])
        values = torch.stack([layer.values[b, :, start:end].transpose(0, 1).float() for layer in cache.layers])
        return keys, values

    def encode_user(self, texts: list[str]) -> list[Stored]:
        """Every fact of a user behind the ``--window`` facts stored before it, ``--encode-batch`` rows a pass."""
        ids = [self.fact_ids(t) for t in texts]
        rows = [(self.prefix + [t for f in ids[max(0, i - self.args.window):i] for t in f], ids[i]) for i in range(len(ids))]
        out = []
        for start in range(0, len(rows), self.args.encode_batch):
            batch = rows[start:start + self.args.encode_batch]
            keep = [len(ctx) + (0 if self.args.header else len(fact)) for ctx, fact in batch]
            with torch.no_grad():
                cache = self._run([ctx + fact for ctx, fact in batch])
            for b, (ctx, fact) in enumerate(batch):
                kv = tuple((layer.keys[b:b + 1, :, :keep[b]].to(torch.bfloat16).clone(),
                            layer.values[b:b + 1, :, :keep[b]].to(torch.bfloat16).clone()) for layer in cache.layers)
                keys, values = self._pre_rope(cache, b, len(ctx), len(ctx) + len(fact))
                out.append(Stored(fact, len(ctx), kv, keys.cpu(), values.cpu()))
        return out

    def wrapped_kvs(self, facts: list[Stored]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The facts' K/V with their wrappers (pre-RoPE), through the vectors being trained: one
        batched pass, each row after its own cached row (right-padded, masked)."""
        from transformers import DynamicCache

        h, t = self.args.header, self.args.trailer
        runs = [[-1 - s for s in range(h)] + (f.ids if h else []) + [-1 - h - s for s in range(t)] for f in facts]
        lengths = [f.cache[0][0].shape[2] for f in facts]
        past, width = max(lengths), max(map(len, runs))
        layers = tuple((torch.cat([_pad(f.cache[l][0], past) for f in facts]).to(self.model.dtype),
                        torch.cat([_pad(f.cache[l][1], past) for f in facts]).to(self.model.dtype))
                       for l in range(len(facts[0].cache)))
        ids = torch.tensor([run + [self.pad] * (width - len(run)) for run in runs], device=self.device)
        seen = torch.arange(past, device=self.device) < torch.tensor(lengths, device=self.device)[:, None]
        mine = torch.arange(width, device=self.device) < torch.tensor(list(map(len, runs)), device=self.device)[:, None]
        positions = torch.tensor(lengths, device=self.device)[:, None] + torch.arange(width, device=self.device)
        cache = DynamicCache(layers)
        with embedding_slots(self.model, self.vectors):
            self.model.model(input_ids=ids, attention_mask=torch.cat([seen, mine], 1).long(), position_ids=positions,
                             past_key_values=cache, use_cache=True)
        out = []
        for b, (f, run) in enumerate(zip(facts, runs)):
            where = torch.arange(lengths[b], lengths[b] + len(run), device=self.device)
            keys = torch.stack([self.rope.inverse(layer.keys[b, :, past:past + len(run)].transpose(0, 1).float(), where)
                                for layer in cache.layers])
            values = torch.stack([layer.values[b, :, past:past + len(run)].transpose(0, 1).float() for layer in cache.layers])
            if not h:  # the fact's own K/V come before the trailer, untouched by it
                keys = torch.cat([f.keys.to(keys), keys], dim=1)
                values = torch.cat([f.values.to(values), values], dim=1)
            out.append((keys, values))
        return out

    def student(self, sample: Sample, users: list[list[Stored]], wrapped: bool = True) -> torch.Tensor:
        """Log-probabilities over the sample's answer after its facts' (wrapped) K/V."""
        facts = [users[sample.user][j] for j in sample.read]
        kvs = self.wrapped_kvs(facts) if wrapped else [(f.keys.to(self.device), f.values.to(self.device)) for f in facts]
        keys = torch.cat([self.prefix_keys] + [k for k, _ in kvs], dim=1)
        values = torch.cat([self.prefix_values] + [v for _, v in kvs], dim=1)
        cache = distill.segment_cache(self.model, self.rope, keys, values)
        return distill.cached_logprobs(self.model, cache, keys.shape[1], sample.query, sample.answer)

    def loss(self, sample: Sample, users, wrapped: bool = True) -> torch.Tensor:
        """KL(teacher || student) per answer token over the teacher's most likely tokens and one bucket
        for the rest (a lower bound of the full KL, exact as the kept tokens cover the teacher's mass)."""
        return coarse_kl(sample.top_logprobs, sample.top_ids, self.student(sample, users, wrapped)).mean()

    def wrappers(self, model_name: str) -> FactWrappers:
        v = self.vectors.detach().cpu().float()
        return FactWrappers(v[:self.args.header], v[self.args.header:], self.filler, model_name)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``[1, heads, T, size]`` right-padded with zeros to ``width`` tokens."""
    return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[2]))


def coarse_kl(top_logprobs: torch.Tensor, top_ids: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Per position, KL between the teacher and the student over ``top_ids`` and the rest as one token."""
    top = top_logprobs.to(student.device)
    picked = student.gather(-1, top_ids.to(student.device))
    rest_t = torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-6))
    rest_s = torch.log1p(-picked.exp().sum(-1).clamp(max=1 - 1e-6))
    return (top.exp() * (top - picked)).sum(-1) + rest_t.exp() * (rest_t - rest_s)


def generate(trainer: Trainer, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids), ``--encode-batch`` at a time (left-padded),
    each cut after the end of its turn."""
    out, stop = [], {trainer.tokenizer.eos_token_id, *trainer.tokenizer.convert_tokens_to_ids(["<|im_end|>"])}
    for start in range(0, len(prompts), trainer.args.encode_batch):
        batch = prompts[start:start + trainer.args.encode_batch]
        width = max(map(len, batch))
        ids = torch.tensor([[trainer.pad] * (width - len(p)) + p for p in batch], device=trainer.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=trainer.device)
        with torch.no_grad():
            gen = trainer.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                                         pad_token_id=trainer.pad)
        for row in gen[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stop), len(row))
            out.append(row[:cut + 1] if cut < len(row) else row)
    return out


def write_questions(trainer: Trainer, facts: list[tuple[str, str]]) -> list[str]:
    """A question the model writes for each (person, fact)."""
    tok = trainer.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": QUESTION_PROMPT.format(name=n, fact=f)}],
                                       tokenize=True, add_generation_prompt=True) for n, f in facts]
    prompts = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p) for p in prompts]
    out = []
    for (name, _), row in zip(facts, generate(trainer, prompts, 28)):
        text = tok.decode(row, skip_special_tokens=True).strip().split("\n")[0]
        out.append(text if text.endswith("?") and name in text else f"What do you know about {name}?")
    return out


def make_samples(trainer: Trainer, users: list[list[str]], stored: list[list[Stored]], first_user: int,
                 rng: random.Random) -> list[Sample]:
    """``--samples-per-user`` per user: k facts read (one answering the question), the teacher's answer
    (greedy, from the facts as text) and the teacher's log-probabilities along it."""
    args, plans = trainer.args, []
    for u, texts in enumerate(users):
        for n in range(args.samples_per_user):
            k = min(args.k[n % len(args.k)], len(texts))
            target = rng.randrange(len(texts))
            read = rng.sample([j for j in range(len(texts)) if j != target], k - 1) + [target]
            rng.shuffle(read)
            plans.append((u, read, target))
    recall, tok = args.questions == "recall", trainer.tokenizer
    asked = [(person_of(users[u][t]) or "them", users[u][t]) for u, _, t in plans]
    texts = [trainer.prefix + [t for j in read for t in stored[u][j].ids] for u, read, _ in plans]
    questions = ([rng.choice(RECALL_QUESTIONS).format(name=name) for name, _ in asked] if recall
                 else write_questions(trainer, asked))
    queries = [trainer.fmt.query_ids(tok, q) for q in questions]
    if recall:  # the fact itself, then the end of the turn
        answers = [tok.encode(" " + fact, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
                   for _, fact in asked]
    else:
        answers = generate(trainer, [t + q for t, q in zip(texts, queries)], args.answer_tokens)
    samples = []
    for (u, read, _), text, query, answer in zip(plans, texts, queries, answers):
        answer = answer or [trainer.tokenizer.eos_token_id]
        with torch.no_grad():
            top = distill.text_logprobs(trainer.model, text + query + answer, len(answer)).topk(args.teacher_top, dim=-1)
        samples.append(Sample(read, first_user + u, query + answer, len(answer), top.indices.cpu(), top.values.cpu()))
    return samples


def mean_kl(trainer: Trainer, samples: list[Sample], users, wrapped: bool) -> float:
    with torch.no_grad():
        return sum(float(trainer.loss(s, users, wrapped)) for s in samples) / max(1, len(samples))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF directory or a known model name")
    p.add_argument("--facts", type=Path, required=True, help="fact_corpus.py's facts.txt (one fact a line)")
    p.add_argument("--header", type=int, default=0, help="vectors before each fact")
    p.add_argument("--trailer", type=int, default=4, help="vectors after each fact")
    p.add_argument("--window", type=int, default=10, help="facts each fact is encoded behind (the facts window)")
    p.add_argument("--users", type=int, default=20, help="training users")
    p.add_argument("--held-out", type=int, default=4, help="held-out users")
    p.add_argument("--facts-per-user", type=int, default=16)
    p.add_argument("--samples-per-user", type=int, default=8)
    p.add_argument("--k", type=lambda v: [int(x) for x in v.split(",")], default=[5, 10], help="facts read, in turn")
    p.add_argument("--questions", choices=["model", "recall"], default="model",
                   help="model: questions and answers the model writes; recall: templated questions, the fact as answer")
    p.add_argument("--answer-tokens", type=int, default=16, help="the teacher's answer (--questions model)")
    p.add_argument("--teacher-top", type=int, default=256, help="the teacher's most likely tokens kept per position")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--max-minutes", type=float, default=0, help="stop training after this long (from the start)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="measure the held-out KL every N steps and keep the best vectors (0: keep the last)")
    p.add_argument("--lr", type=float, default=0.05, help="Adam's step, in units of the embedding's RMS")
    p.add_argument("--encode-batch", type=int, default=8, help="rows a pass (encoding, generation)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="the wrappers file (.safetensors)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    model, tokenizer, device, dtype = distill.frozen_model(args.model, args.dtype)
    path = model.config.name_or_path
    rng = random.Random(args.seed)
    facts = [f.strip() for f in args.facts.read_text().splitlines() if f.strip()]
    count, size = args.users + args.held_out, args.facts_per_user
    if len(facts) < count * size:
        raise SystemExit(f"{args.facts}: {len(facts)} facts, {count * size} needed ({count} users x {size})")
    users = [facts[u * size:(u + 1) * size] for u in range(count)]
    for texts in users:
        rng.shuffle(texts)
    trainer = Trainer(model, tokenizer, args, device)
    began = time.perf_counter()
    stored = [trainer.encode_user(texts) for texts in users]
    encode_s = time.perf_counter() - began
    train = make_samples(trainer, users[:args.users], stored[:args.users], 0, rng)
    held = make_samples(trainer, users[args.users:], stored[args.users:], args.users, rng)
    data_s = time.perf_counter() - began
    print(f"{sum(map(len, users))} facts of {len(users)} users encoded in {encode_s:.0f} s; {len(train)} + {len(held)} "
          f"samples by {data_s:.0f} s", flush=True)
    seen = train[:max(len(held), 1)]  # the training samples the KL before and after is reported on
    before = {"train": mean_kl(trainer, seen, stored, False), "held_out": mean_kl(trainer, held, stored, False)}
    init = {"train": mean_kl(trainer, seen, stored, True), "held_out": mean_kl(trainer, held, stored, True)}
    print(f"KL without wrappers {before}; with the initial vectors {init}", flush=True)
    optimizer = torch.optim.Adam([trainer.vectors], lr=args.lr * trainer.scale)
    curve, order, held_curve = [], list(range(len(train))), []
    best = (init["held_out"], 0, trainer.vectors.detach().clone()) if args.eval_every else None  # KL, step, vectors
    for step in range(args.steps):
        if args.max_minutes and time.perf_counter() - began > 60 * args.max_minutes:
            print(f"stopped at step {step}: --max-minutes {args.max_minutes:g} reached", flush=True)
            break
        if step % len(train) == 0:
            rng.shuffle(order)
        loss = trainer.loss(train[order[step % len(train)]], stored)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        curve.append(float(loss.detach()))
        if (step + 1) % max(1, args.steps // 10) == 0:
            window = curve[-max(1, args.steps // 10):]
            print(f"step {step + 1:5d}  KL {sum(window) / len(window):.4f}  ({time.perf_counter() - began:.0f} s)", flush=True)
        if best and (step + 1) % args.eval_every == 0:
            kl = mean_kl(trainer, held, stored, True)
            held_curve.append((step + 1, kl))
            print(f"step {step + 1:5d}  held-out KL {kl:.4f}", flush=True)
            if kl < best[0]:
                best = (kl, step + 1, trainer.vectors.detach().clone())
    if best:
        with torch.no_grad():
            trainer.vectors.copy_(best[2])
        print(f"kept the vectors of step {best[1]} (held-out KL {best[0]:.4f})", flush=True)
    after = {"train": mean_kl(trainer, seen, stored, True), "held_out": mean_kl(trainer, held, stored, True)}
    print(f"KL after: {after} (without wrappers: {before})", flush=True)
    trainer.wrappers(Path(path).name).save(args.out)
    report = {"command": " ".join(["python", *sys.argv]), "model": Path(path).name, "device": device, "dtype": dtype,
              "header": args.header, "trailer": args.trailer, "window": args.window, "k": args.k,
              "users": args.users, "held_out_users": args.held_out, "samples": len(train), "held_out_samples": len(held),
              "steps": len(curve), "lr": args.lr, "encode_s": encode_s, "data_s": data_s,
              "train_s": time.perf_counter() - began - data_s, "kl_without": before, "kl_initial": init,
              "kl_after": after, "curve": curve,
              "questions": args.questions, "held_out_curve": held_curve, "kept_step": best[1] if best else len(curve)}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
