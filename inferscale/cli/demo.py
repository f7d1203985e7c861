"""``inferscale demo``, ``encode`` and ``ask``: memory built from a conversation, and
questions answered from it by KV injection and by prompt injection."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

from inferscale.cli.common import api_of, positive_int, top_k


def cmd_demo(args) -> int:
    """Build memory for a small conversation, answer questions both ways, compare."""
    if args.data_dir or args.config or os.environ.get("INFERSCALE_DATA_DIR") or os.environ.get("INFERSCALE_CONFIG"):
        return _demo(args)
    with tempfile.TemporaryDirectory(prefix="inferscale-demo-") as scratch:  # not into the home data dir
        print(f"the demo's memory goes to {scratch} (removed at the end; --data-dir keeps it)", flush=True)
        args.data_dir = scratch
        return _demo(args)


def _demo(args) -> int:
    from inferscale.datasets import demo as demo_data

    mem = api_of(args, in_process=True)
    user, turns, facts, questions = _demo_inputs(args, demo_data)
    print(f"model: {mem.model_dir}\nbuilding memory for {user!r}: {len(facts)} facts ...", flush=True)
    mem.add_conversation(user, turns, facts)
    rows = []
    for question, expected in questions.items():
        for mode in ("kv", "prompt"):
            mem.generate(user, question, k=args.k, mode=mode, max_tokens=1, fresh_cache=True)  # warm
        answers = {mode: mem.generate(user, question, k=args.k, mode=mode, max_tokens=args.max_tokens,
                                      fresh_cache=True) for mode in ("kv", "prompt")}
        rows.append((expected, answers))
        _print_pair(question, expected, answers)
    _print_summary(rows)
    mem.close()
    return 0


def _demo_inputs(args, demo_data):
    if not args.locomo:
        return demo_data.USER, demo_data.TURNS, demo_data.FACTS, demo_data.QUESTIONS
    from inferscale.datasets.locomo import load_conversation

    conv = load_conversation(args.locomo, max_sessions=args.sessions)
    speaker = conv.speakers[0]
    questions = {q.question: q.answer for q in conv.questions if speaker in q.question}
    return speaker.lower(), conv.turns, conv.facts[speaker], dict(list(questions.items())[: args.questions])


def _right(answer, expected: str) -> bool:
    return expected.lower() in answer.text.lower()


def _print_pair(question, expected, answers) -> None:
    print(f"\nQ: {question}   (expected: {expected})")
    for mode, label in (("kv", "KV injection    "), ("prompt", "prompt injection")):
        a = answers[mode]
        t = a.timings
        note = f" (fallback: {a.fallback})" if a.fallback else ""
        print(f"  {label} | TTFT {t['engine_ttft']:7.1f} ms | q→first token {t['query_to_first_token']:7.1f} ms"
              f" | prefilled {a.prompt_tokens - a.injected_tokens:4d}/{a.prompt_tokens} tokens{note}")
        print(f"    {'✓' if _right(a, expected) else '✗'} {a.text.strip()[:200]}")


def _print_summary(rows) -> None:
    def median(values):
        values = sorted(v for v in values if not math.isnan(v))
        return values[len(values) // 2] if values else float("nan")

    kv = median(r[1]["kv"].timings["engine_ttft"] for r in rows)
    text = median(r[1]["prompt"].timings["engine_ttft"] for r in rows)
    right = {mode: sum(_right(r[1][mode], r[0]) for r in rows) for mode in ("kv", "prompt")}
    print(f"\nright answers: KV injection {right['kv']}/{len(rows)}, prompt injection {right['prompt']}/{len(rows)}")
    print(f"median engine TTFT: KV injection {kv:.1f} ms, prompt injection {text:.1f} ms "
          f"({text / kv:.2f}× faster with KV injection)")


def cmd_add(args) -> int:
    """Encode a LoCoMo conversation's facts (its observations) into memory, one user per speaker."""
    from inferscale.datasets.locomo import load_conversation

    mem = api_of(args)
    conv = load_conversation(args.locomo, max_sessions=args.sessions)
    for speaker in conv.speakers:
        facts = mem.add_conversation(speaker.lower(), conv.turns, conv.facts.get(speaker, []))
        print(f"{speaker.lower()}: {len(facts)} facts stored in {mem.config.data_path}")
    return 0


def _user_id(value: str) -> str:
    from inferscale.cli.memory import _user_id as checked

    return checked(value)


def cmd_ask(args) -> int:
    """Answer a question for a user from memory."""
    mem = api_of(args, in_process=True)
    answer = mem.generate(args.user, args.question, k=args.k, mode=args.mode, max_tokens=args.max_tokens)
    print(answer.text.strip())
    print(json.dumps({"facts": len(answer.fact_ids), "fallback": answer.fallback,
                      "timings_ms": {k: round(v, 2) for k, v in answer.timings.items()}}), file=sys.stderr)
    mem.close()
    return 0


def add_parsers(sub, common) -> None:
    demo = common(sub.add_parser("demo", help=cmd_demo.__doc__))
    demo.add_argument("--locomo", help="a LoCoMo conversation file instead of the built-in one")
    demo.add_argument("--sessions", type=positive_int, default=2,
                      help="with --locomo: the conversation's first N sessions (default 2)")
    demo.add_argument("--questions", type=positive_int, default=4, help="with --locomo: questions asked (default 4)")
    demo.add_argument("-k", type=top_k, default=None, help="facts per question, 1..1024 (default: the config's top_k)")
    demo.add_argument("--max-tokens", type=positive_int, default=32, help="tokens per answer (default 32)")
    demo.set_defaults(func=cmd_demo)

    add = common(sub.add_parser("encode", aliases=["add"], help=cmd_add.__doc__))
    add.add_argument("locomo", help="a LoCoMo conversation file")
    add.add_argument("--sessions", type=positive_int, default=None,
                     help="the conversation's first N sessions (default: all)")
    add.set_defaults(func=cmd_add)

    ask = common(sub.add_parser("ask", help="answer a question for a user from memory"))
    ask.add_argument("user", type=_user_id, help="whose memory answers (a user id, e.g. alice@example.com)")
    ask.add_argument("question", help="the question, in quotes")
    ask.add_argument("-k", type=top_k, default=None, help="facts to retrieve, 1..1024 (default: the config's top_k)")
    ask.add_argument("--mode", choices=("kv", "prompt", "none"), default="kv",
                     help="kv: the facts' K/V injected (default); prompt: the same facts as text; none: no memory")
    ask.add_argument("--max-tokens", type=positive_int, default=64, help="tokens of the answer (default 64)")
    ask.set_defaults(func=cmd_ask)
