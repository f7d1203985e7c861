"""One table of the same GPU benchmarks on two vLLM releases, from their result files.

    python benchmarks/releases_table.py --release 0.26.0 ttft26.json load26.json \
        --release 0.33.0 ttft33.json load33.json --out benchmarks/results/vllm_releases_h200

Each ``--release`` names a release and its ``ttft.py`` and ``vllm_serve_load.py`` JSONs, measured on
the same machine one after the other (``benchmarks/gpu/h200_releases.sh``). Writes OUT.md and OUT.json:
engine TTFT per store and k (KV injection, vLLM's own prefix-cache hit of the same tokens, prompt
injection, no memory) and requests/s at 100 users per system, each release beside the other.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def ttft_rows(path: Path) -> dict[tuple[str, int], dict]:
    return {(r["kv_store"], r["k"]): r for r in json.loads(path.read_text())["rows"] if r["recompute_tokens"] == 0}


def load_rows(path: Path, users: int = 100) -> dict[str, dict]:
    return {r["system"]: r for r in json.loads(path.read_text())["rows"] if r["users"] == users}


def ttft_table(releases: list[str], ttft: dict[str, dict]) -> list[str]:
    lines = ["| store | k | " + " | ".join(f"{v}: KV / prefix hit / prompt / none ms, KV − hit" for v in releases) + " |",
             "|---|---|" + "---|" * len(releases)]
    for key in sorted(next(iter(ttft.values()))):
        cells = []
        for v in releases:
            r = ttft[v].get(key)
            cells.append("—" if r is None else
                         f"{r['kv_ms']:.2f} / {r['cached_ms']:.2f} / {r['prompt_ms']:.2f} / {r['none_ms']:.2f}, "
                         f"{r['kv_minus_cached_ms']:+.2f}")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return lines


def load_table(releases: list[str], load: dict[str, dict]) -> list[str]:
    lines = ["| system (100 users) | " + " | ".join(f"{v}: req/s (× prompt)" for v in releases) + " |",
             "|---|" + "---|" * len(releases)]
    for system in next(iter(load.values())):
        cells = []
        for v in releases:
            r, prompt = load[v].get(system), load[v].get("prompt")
            cells.append("—" if r is None else f"{r['requests_per_s']:.1f} ({r['requests_per_s'] / prompt['requests_per_s']:.2f}×)")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", nargs=3, action="append", required=True, metavar=("VERSION", "TTFT_JSON", "LOAD_JSON"))
    parser.add_argument("--out", required=True, help="path without suffix: OUT.md and OUT.json are written")
    args = parser.parse_args(argv)
    releases = [v for v, _, _ in args.release]
    ttft = {v: ttft_rows(Path(t)) for v, t, _ in args.release}
    load = {v: load_rows(Path(l)) for v, _, l in args.release}
    commands = {v: {"ttft": json.loads(Path(t).read_text())["command"], "load": json.loads(Path(l).read_text())["command"]}
                for v, t, l in args.release}
    md = ["# The same benchmarks on vLLM " + " and ".join(releases), "",
          "Engine TTFT (`ttft.py`, Llama-3.1-8B shape, random weights, CUDA graphs, multiprocess engine, B = 0):", "",
          *ttft_table(releases, ttft), "",
          "Load through `vllm serve` (`vllm_serve_load.py`, Qwen2.5-7B shape, 200 facts a user, k = 50, 32 output tokens):", "",
          *load_table(releases, load), "", "Commands:", ""]
    md += [f"- {v}: `{c['ttft']}`; `{c['load']}`" for v, c in commands.items()]
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    out.with_suffix(".json").write_text(json.dumps({
        "releases": releases, "commands": commands,
        "ttft": {v: [{"kv_store": s, "k": k, **{f: r[f] for f in ("kv_ms", "cached_ms", "prompt_ms", "none_ms", "kv_minus_cached_ms")}}
                     for (s, k), r in sorted(rows.items())] for v, rows in ttft.items()},
        "load_100_users": {v: {s: r["requests_per_s"] for s, r in rows.items()} for v, rows in load.items()},
    }, indent=1) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
