"""``inferscale users``, ``facts`` and ``forget``: the memory side, on the data directory or
(``--server``) through a running server."""

from __future__ import annotations

import argparse
import json

from inferscale.cli.common import memory_of


def cmd_users(args) -> int:
    """List the users with memory."""
    memory = memory_of(args)
    for user in memory.users():
        print(user)
    return 0


def cmd_facts(args) -> int:
    """List a user's facts: id, source turn, text (or --json)."""
    memory = memory_of(args)
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

    memory = memory_of(args)
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


def add_parsers(sub) -> None:
    def memory_cmd(name, func, user: bool = True):
        p = sub.add_parser(name, help=func.__doc__)
        if user:
            p.add_argument("user", type=_user_id, help="a user id, e.g. alice@example.com")
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
