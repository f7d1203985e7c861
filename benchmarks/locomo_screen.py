"""LoCoMo accuracy screen: teacher-forced KL and gold-answer NLL, with no generation.

A low-noise measure of how far a way of storing facts moves the model from prompt injection,
for choosing what deserves an F1 run (``locomo_accuracy.py``). For each question, its top-k facts
(retrieved as the F1 harness retrieves them, composed the most relevant last) and its gold
answer, the model reads the gold answer's tokens (teacher forcing) after:

* the facts as text — the baseline (``--baseline``, prompt injection): the teacher;
* each method's segment — a ``kv*`` method's injected K/V (the instruction prefix and the facts,
  less the tail facts its recompute budget ``recompute_tokens`` leaves to be read as text), or a
  ``prompt*`` method's own text (e.g. the facts in stored order).

Per question and k it records KL(teacher || method) averaged over the answer's tokens and the
answer's mean negative log-likelihood under the method (and under the teacher). Nothing is
sampled, so there are no greedy flips: each question's value moves smoothly with the method.
The summary gives each method's mean per k and pooled over k (each question's values averaged
over the ks first), and its paired gap to ``--reference`` with a 95 % question-bootstrap interval,
in KL and in NLL. A method whose prompt differs from the baseline's (``closing=ask``: the question
also asked at the end of the system message) is judged by its NLL: its KL measures the change of
prompt as well as that of the K/V.

Methods are named as in the F1 harness (``kv[window=-10,closing=answer]``, with ``wrappers=FILE``
for learned fact wrappers, ``recompute_tokens=B`` for a tail, ``calibration=FILE``); any such name
parses, a set of ``locomo_accuracy.py`` too.

    python benchmarks/locomo_screen.py --sample 64 --ks 5,10,20,50 --cycle \\
        --methods 'kv[window=-10,closing=answer];kv[window=-10,closing=answer,wrappers=w.safetensors]' \\
        --reference 'kv[window=-10,closing=answer]' --out benchmarks/results/locomo_screen_qwen05_cpu.json
    python benchmarks/locomo_screen.py --model <1.5B dir> --ks 5,10,20,50 --methods ... --out ...  # GPU: all

``--cycle`` asks each question at one k (the ks in turn: a CPU-sized sample); without it every
question is asked at every k.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import locomo as harness  # noqa: E402
from locomo_gaps import gap  # noqa: E402

from inferscale.compose.blend import injected_length  # noqa: E402
from inferscale.encode import distill  # noqa: E402

BASELINE = "prompt[closing=answer]"


def gold_ids(tokenizer, answer) -> list[int]:
    """The gold answer's tokens, as the model would write them after the assistant's header."""
    return list(tokenizer.encode(str(answer).strip(), add_special_tokens=False)) or [tokenizer.eos_token_id]


def encoding_key(method: harness.Method) -> tuple:
    """What a method's stored K/V depend on at the model's pass: the window, the style, the wrappers."""
    if method.slots or method.contexts or method.neighbours:
        raise SystemExit(f"{method.name}: the screen reads one facts or turns window per method (no slots, "
                         f"contexts or neighbours)")
    return method.window, method.style, method.wrappers


class Memory:
    """Each conversation's facts encoded per :func:`encoding_key` (the model runs once per key), and
    the instruction prefix's K/V."""

    def __init__(self, encoder, prefix: list[int]):
        self.encoder, self.prefix = encoder, prefix
        self.prefix_kv = encoder.encode_ids(prefix)
        self.kvs: dict = {}

    def encode(self, cid: str, conv, needed: list[int], key: tuple) -> None:
        from inferscale.encode.wrappers import FactWrappers
        from inferscale.facts import Fact, make_fact_id

        window, style, wrappers = key
        self.encoder.window = harness.window_policy(window)
        self.encoder.fact_style = style
        self.encoder.wrappers = FactWrappers.load(wrappers).check(self.encoder.model) if wrappers else None
        facts = [Fact(make_fact_id(cid, text, src), cid, text, src) for text, src in conv.all_facts()]
        kvs = self.encoder.encode(facts, conv.turns, progress=False, prefix_ids=self.prefix,
                                  only={facts[j].fact_id for j in needed})
        self.kvs[(cid, key)] = {j: kvs[facts[j].fact_id] for j in needed}

    def unwrap(self, cid: str, key: tuple, wrapped: tuple) -> None:
        """``key``'s facts taken from ``wrapped``'s, whose wrappers are trailers only: a trailer comes
        after the fact, so the fact's own K/V are the same (the model runs once for both)."""
        from inferscale.encode.wrappers import FactWrappers
        from inferscale.kv import FactKV

        t = FactWrappers.load(wrapped[2]).num_trailer
        self.kvs[(cid, key)] = {j: FactKV(kv.token_ids[:-t], kv.keys[:, :-t].clone(), kv.values[:, :-t].clone())
                                for j, kv in self.kvs[(cid, wrapped)].items()}

    def transformed(self, cid: str, method: harness.Method) -> dict:
        """The conversation's facts as ``method`` stores them (a calibration or a content scale after
        the model's pass)."""
        kvs = self.kvs[(cid, encoding_key(method))]
        if method.calibration:
            from inferscale.encode.calibration import KVCalibration

            cal = KVCalibration.load(method.calibration)
            kvs = {j: cal.apply(kv, self.encoder.key_bias) for j, kv in kvs.items()}
        elif method.content_scale != 1.0:
            kvs = {j: harness.content_scaled(kv, self.encoder.key_bias, method.content_scale) for j, kv in kvs.items()}
        return at_rest(kvs, method.at_rest)


def at_rest(kvs: dict, form: str) -> dict:
    """The facts as a store keeping them in ``form`` (``Config.kv_dtype_at_rest``) gives them back."""
    from inferscale.kv_fp8 import FP8_E4M3, check_at_rest, fp8_round_trip

    check_at_rest(form)
    return {j: fp8_round_trip(kv) for j, kv in kvs.items()} if form == FP8_E4M3 else kvs


def derivable(keys: list[tuple]) -> dict[tuple, tuple]:
    """Plain encodings that another encoding's trailer-only wrappers carry: plain key -> wrapped key."""
    from inferscale.encode.wrappers import FactWrappers

    out = {}
    for window, style, wrappers in keys:
        if wrappers and (window, style, "") in keys and (window, style, "") not in out \
                and FactWrappers.load(wrappers).num_header == 0:
            out[(window, style, "")] = (window, style, wrappers)
    return out


def text_ids(method: harness.Method, item, k: int, prompts) -> list[int]:
    """A prompt method's whole prompt (prefix, facts in its order, the query)."""
    ids = list(prompts.prefix)
    for j in harness.segment_order(item.retrieved[:k], method.order):
        ids += prompts.fact(item.conv, j, method.style)
    return ids + prompts.query(method.closing, item.question)


def kv_logprobs(model, rope, method, item, k, prompts, memory, kvs, gold) -> tuple[torch.Tensor, int]:
    """The method's log-probabilities over the gold answer, and how many memory tokens it recomputes."""
    order = harness.segment_order(item.retrieved[:k], method.order)
    facts = [kvs[j] for j in order]
    claim = injected_length([memory.prefix_kv.num_tokens] + [kv.num_tokens for kv in facts], method.recompute_tokens)
    parts = [memory.prefix_kv, *facts]
    keys = torch.cat([p.keys for p in parts], dim=1)[:, :claim]
    values = torch.cat([p.values for p in parts], dim=1)[:, :claim]
    segment = [t for p in parts for t in p.token_ids]
    tail = segment[claim:]
    cache = distill.segment_cache(model, rope, keys, values)
    ids = tail + prompts.query(method.closing, item.question) + gold
    return distill.cached_logprobs(model, cache, claim, ids, len(gold)), len(tail)


def screen(model, rope, tokenizer, methods, baseline, items_by_k, prompts, memory) -> list[dict]:
    """One row per (question, k, method): KL from the teacher and gold NLL, both per answer token."""
    rows = []
    kv_of = {}
    for k, items in items_by_k.items():
        for item in items:
            gold = gold_ids(tokenizer, item.answer)
            with torch.no_grad():
                teacher = distill.text_logprobs(model, text_ids(baseline, item, k, prompts) + gold, len(gold))
                for method in methods:
                    recomputed = 0
                    if method.name == baseline.name:
                        student = teacher
                    elif method.mode == "prompt":
                        student = distill.text_logprobs(model, text_ids(method, item, k, prompts) + gold, len(gold))
                    else:
                        key = (item.conv, method.name)
                        if key not in kv_of:
                            kv_of[key] = memory.transformed(item.conv, method)
                        student, recomputed = kv_logprobs(model, rope, method, item, k, prompts, memory, kv_of[key], gold)
                    rows.append({"conv": item.conv, "q": item.index, "k": k, "category": item.category,
                                 "method": method.name, "answer_tokens": len(gold), "recomputed": recomputed,
                                 "kl": float(distill.kl_per_token(teacher, student).mean()),
                                 "nll": float(distill.nll_per_token(student, gold).mean())})
    return rows


def per_question(rows: list[dict], method: str, field: str, category: int | None = None) -> dict:
    """Each question's ``field`` averaged over the ks it was asked at."""
    values: dict = defaultdict(list)
    for r in rows:
        if r["method"] == method and (category is None or r["category"] == category):
            values[(r["conv"], r["q"])].append(r[field])
    return {q: sum(v) / len(v) for q, v in values.items()}


def summarize(rows: list[dict], methods: list[str], reference: str | None, resamples: int = 2000) -> dict:
    """Per method: the mean KL and NLL per k and pooled over k (with 95 % intervals), and the paired
    pooled gap of each to ``reference`` (all questions, multi-hop, temporal)."""
    rng = np.random.default_rng(0)
    out: dict = {}
    for m in methods:
        entry: dict = {"per_k": {}, "pooled": {}, "gap": {}}
        for k in sorted({r["k"] for r in rows}):
            sel = [r for r in rows if r["method"] == m and r["k"] == k]
            entry["per_k"][str(k)] = {f: float(np.mean([r[f] for r in sel])) for f in ("kl", "nll")} if sel else {}
        for field in ("kl", "nll"):
            own = per_question(rows, m, field)
            mean, low, high = gap(np.array(list(own.values())), resamples, rng)
            entry["pooled"][field] = {"mean": mean, "low": low, "high": high, "questions": len(own)}
            if reference and m != reference:
                for group, cat in harness_groups().items():
                    a, b = per_question(rows, m, field, cat), per_question(rows, reference, field, cat)
                    keys = [q for q in a if q in b]
                    if keys:
                        mean, low, high = gap(np.array([a[q] - b[q] for q in keys]), resamples, rng)
                        ratio = sum(a[q] for q in keys) / max(sum(b[q] for q in keys), 1e-12)
                        entry["gap"].setdefault(field, {})[group] = {"gap": mean, "low": low, "high": high,
                                                                      "ratio": ratio, "questions": len(keys)}
        out[m] = entry
    return out


def harness_groups() -> dict:
    from locomo_gaps import GROUPS

    return GROUPS


def markdown(summary: dict, reference: str | None, ks: list[int], n: int, model: str) -> str:
    lines = [f"LoCoMo screen, {n} questions, {model}: KL from prompt injection and gold-answer NLL per answer token", "",
             "| method | KL per k (" + " / ".join(map(str, ks)) + ") | KL pooled (95 %) | NLL pooled (95 %) | "
             f"KL − reference (95 %) | KL ÷ reference | NLL − reference (95 %) |", "|---|---|---|---|---|---|---|"]
    for m, s in summary.items():
        per_k = " / ".join(f"{s['per_k'].get(str(k), {}).get('kl', float('nan')):.3f}" for k in ks)
        kl, nll = s["pooled"]["kl"], s["pooled"]["nll"]
        g, n = s["gap"].get("kl", {}).get("all"), s["gap"].get("nll", {}).get("all")
        ratio = f"{g['ratio']:.3f}" if g else "—"
        lines.append(f"| {m} | {per_k} | {kl['mean']:.4f} ({kl['low']:.4f}, {kl['high']:.4f}) | "
                     f"{nll['mean']:.3f} ({nll['low']:.3f}, {nll['high']:.3f}) | {_gap_cell(g, 4)} | {ratio} | "
                     f"{_gap_cell(n, 3)} |")
    if reference:
        lines += ["", f"Reference: `{reference}`; gaps are paired per question, pooled over k."]
    return "\n".join(lines) + "\n"


def _gap_cell(gap: dict | None, digits: int) -> str:
    """A paired gap with its 95 % interval, "—" for none (the reference itself)."""
    if not gap:
        return "—"
    return f"{gap['gap']:+.{digits}f} ({gap['low']:+.{digits}f}, {gap['high']:+.{digits}f})"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/data/locomo")
    p.add_argument("--sample", type=int, default=0, help="a stratified, seeded sample of N questions (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ks", default="5,10,20,50")
    p.add_argument("--cycle", action="store_true", help="each question at one k, the ks in turn")
    p.add_argument("--methods", required=True, help="method names joined by ';' (or a locomo_accuracy.py set)")
    p.add_argument("--baseline", default=BASELINE, help="the teacher: a prompt method")
    p.add_argument("--reference", default=None, help="the method every gap is taken to")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="HF directory or known model name")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--embedder", default="minilm")
    p.add_argument("--retrieval", default=None, help="retrieval cache (JSON), as locomo_accuracy.py's")
    p.add_argument("--encode-batch", type=int, default=16)
    p.add_argument("--out", required=True, help="the JSON (its .json suffix added where missing) and the table beside it (.md)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from inferscale.compose.rope import RotaryEmbedding
    from inferscale.encode.encoder import FactEncoder

    ks = [int(k) for k in args.ks.split(",")]
    methods = harness.select_methods(args.methods)
    baseline = harness.select_methods(args.baseline)[0]
    if baseline.mode != "prompt":
        raise SystemExit(f"the baseline must be a prompt method, got {baseline.name}")
    methods = [baseline] + [m for m in methods if m.name != baseline.name]
    convs, keys = harness.load_items(argparse.Namespace(data=args.data, sample=args.sample, seed=args.seed))
    retrieved = harness.retrieve(convs, keys, max(50, *ks), Path(args.retrieval) if args.retrieval else None,
                                 args.embedder)
    items = harness.make_items(convs, keys, retrieved, max(ks))
    items_by_k = {k: items[n::len(ks)] for n, k in enumerate(ks)} if args.cycle else {k: items for k in ks}
    model, tokenizer, device, dtype = distill.frozen_model(args.model, args.dtype)
    model_path = model.config.name_or_path
    rope = RotaryEmbedding.from_hf_config(model.config)
    prompts = harness.Prompts(tokenizer, convs)
    start = time.perf_counter()
    encoder = FactEncoder(model, tokenizer, batch_size=args.encode_batch)
    memory = Memory(encoder, prompts.prefix)
    needed: dict = defaultdict(set)
    for k, group in items_by_k.items():
        for it in group:
            needed[it.conv].update(it.retrieved[:k])
    keys = list(dict.fromkeys(encoding_key(m) for m in methods if m.mode == "kv"))
    derived = derivable(keys)
    for key in [k for k in keys if k not in derived]:
        for cid, facts in needed.items():
            memory.encode(cid, convs[cid], sorted(facts), key)
        print(f"encoded {sum(map(len, needed.values()))} facts for {key} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    for key, wrapped in derived.items():
        for cid in needed:
            memory.unwrap(cid, key, wrapped)
    encode_s = time.perf_counter() - start
    rows = screen(model, rope, tokenizer, methods, baseline, items_by_k, prompts, memory)
    names = [m.name for m in methods]
    summary = summarize(rows, names, args.reference)
    table = markdown(summary, args.reference, ks, len(items), f"{Path(model_path).name} ({dtype}, {device})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(["python", *sys.argv]), "model": Path(model_path).name, "dtype": dtype,
              "device": device, "ks": ks, "cycle": args.cycle, "questions": len(items), "baseline": baseline.name,
              "reference": args.reference, "encode_s": encode_s, "screen_s": time.perf_counter() - start - encode_s,
              "summary": summary, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    print("\n" + table, flush=True)


if __name__ == "__main__":
    main()
