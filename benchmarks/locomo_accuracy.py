"""LoCoMo answer accuracy: KV injection vs prompt injection at several k (same facts, same prompt tokens).

One memory per conversation holds both speakers' facts (LoCoMo's observations, dated by session),
encoded by the serving model behind their source turns. For each question (categories 1–4) the top-k
facts are retrieved once and answered twice: with the facts' K/V injected, and with the same facts as
text. The score is LoCoMo's token-level F1 against the gold answer (normalised as in the LoCoMo/Mem0
evaluations: lower-case, no punctuation or articles).

    python benchmarks/locomo_accuracy.py --conversation ../shared/data/locomo/conv-26.json \
        --sessions 4 --questions 40 --ks 5,20 --out benchmarks/results/locomo_accuracy_cpu.json
"""

from __future__ import annotations

import argparse
import json
import re
import string
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from inferscale.locomo import CATEGORIES, load_conversation


def normalize(text: str) -> list[str]:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return text.split()


def f1(prediction: str, gold: str) -> float:
    pred, ref = normalize(prediction), normalize(gold)
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


INSTRUCTION = (
    "You answer questions about a conversation between two people, using the facts below that were "
    "remembered from it. Answer in a few words, with a date when asked when.\nFacts:\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversation", required=True)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--ks", default="5,20")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", default="benchmarks/results/locomo_accuracy.json")
    args = parser.parse_args()

    from inferscale.api import InferScale

    conv = load_conversation(args.conversation, max_sessions=args.sessions)
    user = conv.sample_id.replace("/", "-")
    facts = [f for speaker in conv.speakers for f in conv.facts.get(speaker, [])]
    questions = conv.questions[: args.questions]
    mem = InferScale.from_config({
        "model": args.model, "data_dir": tempfile.mkdtemp(prefix="locomo-"), "instruction": INSTRUCTION,
        "encoder": {"name": "turns", "options": {"window": args.window}},
    }, enforce_eager=True)
    start = time.perf_counter()
    mem.add_conversation(user, conv.turns, facts)
    build_s = time.perf_counter() - start
    rows = []
    for k in (int(x) for x in args.ks.split(",")):
        for q in questions:
            for mode in ("kv", "prompt"):
                a = mem.generate(user, q.question, k=k, mode=mode, max_tokens=args.max_tokens)
                rows.append({"k": k, "mode": mode, "category": q.category, "question": q.question,
                             "gold": q.answer, "answer": a.text.strip(), "f1": f1(a.text, q.answer),
                             "ttft_ms": a.timings["engine_ttft"], "fallback": a.fallback})
    mem.close()
    summary = summarize(rows)
    out = {"conversation": conv.sample_id, "sessions": args.sessions, "facts": len(facts), "model": args.model,
           "window": args.window, "build_s": build_s, "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print_table(summary, len(facts), len(questions))


def summarize(rows: list[dict]) -> dict:
    groups: dict[tuple, list[float]] = defaultdict(list)
    ttft: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        for cat in (r["category"], "all"):
            groups[(r["k"], r["mode"], cat)].append(r["f1"])
        ttft[(r["k"], r["mode"])].append(r["ttft_ms"])
    out: dict = {}
    for (k, mode, cat), values in groups.items():
        out.setdefault(str(k), {}).setdefault(mode, {})[str(cat)] = sum(values) / len(values)
    for (k, mode), values in ttft.items():
        out[str(k)][mode]["median_ttft_ms"] = sorted(values)[len(values) // 2]
    return out


def print_table(summary: dict, num_facts: int, num_questions: int) -> None:
    cats = ["1", "2", "3", "4", "all"]
    print(f"\nLoCoMo F1 ({num_questions} questions, {num_facts} facts)")
    print("| k | mode | " + " | ".join(CATEGORIES.get(int(c), c) if c != "all" else "all" for c in cats)
          + " | median TTFT ms |")
    print("|---|---|" + "---|" * len(cats) + "---|")
    for k, modes in summary.items():
        for mode, scores in modes.items():
            cells = " | ".join(f"{scores[c]:.3f}" if c in scores else "—" for c in cats)
            print(f"| {k} | {mode} | {cells} | {scores['median_ttft_ms']:.0f} |")


if __name__ == "__main__":
    main()
