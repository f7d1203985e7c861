"""Offline encoding speed: seconds per LoCoMo conversation, whole rows vs shared prefills.

Every conversation's facts (LoCoMo's observations, both speakers, each with
its source turn) are encoded as the memory API stores them: behind the
instruction prefix of the tokenizer's chat template, then the fact's window.
Each window runs both ways in the same run, one after the other for every
conversation (the order alternates):

* ``before``: whole rows (``FactEncoder(share_prefixes=False)``), one
  ``[prefix | window | fact]`` row per fact, ``--batch-size`` rows a pass;
* ``after``: shared prefills (the default): the prefix once, each distinct
  window once (the facts of one turn share it), then the facts against the
  cached K/V, at most ``--batch-size`` rows a pass.

Windows: ``N`` is the N turns ending at the fact's source turn (``turns``,
w = 0 is no context), ``facts:N`` the N facts before it (the default policy).
The model is a config.json shape with random weights (true timings,
meaningless K/V), on cuda when there is one; its vocabulary is widened to the
tokenizer's where that is larger (the encoder never runs the LM head, so the
cost is the same). Printed: seconds per conversation (median of ``--reps``), tokens
run (padding included) and the largest relative K/V difference between the
two paths.

    python benchmarks/encode_speed.py --config llama-3.1-8b --tokenizer .gpu/tokenizer \\
        --data .gpu/locomo --out benchmarks/results/encode_speed_h200.json

On a CPU, ``--config smoke --convs 1 --reps 3 --threads 1`` checks it in
about two minutes. The paper reports 39-206 s per conversation on
Llama-3.1-8B.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ttft import SHAPES  # noqa: E402

PAPER_S_PER_CONV = (39, 206)  # Llama-3.1-8B, per LoCoMo conversation


# ---------------------------------------------------------------- setup


def model_config(spec: str) -> tuple[str, dict]:
    """A known shape's name, or a config.json path: (label, config dict)."""
    if spec in SHAPES:
        return spec, dict(SHAPES[spec])
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(f"--config {spec!r}: neither a known shape ({', '.join(sorted(SHAPES))}) nor a config.json file")
    return path.parent.name or path.stem, json.loads(path.read_text())


def default_tokenizer() -> Path:
    from inferscale.encode.weights import cache_dir

    return cache_dir() / "models" / "qwen2.5-coder-0.5b-instruct-float32"


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise SystemExit(f"--tokenizer {path}: no tokenizer files there (convert the demo model with "
                         f"`inferscale convert qwen2.5-coder-0.5b-instruct`, or pass a tokenizer directory)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def build_model(cfg: dict, vocab: int, dtype, device):
    """Random weights of ``cfg``'s shape; the vocabulary at least ``vocab``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in cfg.items() if k not in ("torch_dtype", "dtype")}
    config = AutoConfig.for_model(**{**cfg, "vocab_size": max(cfg.get("vocab_size", 0), vocab)})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load_conversations(data: Path, limit: int, max_sessions: int | None):
    from inferscale.datasets.locomo import load_conversation

    paths = sorted(data.glob("*.json"))
    if not paths:
        raise SystemExit(f"--data {data}: no LoCoMo conversations (*.json) there")
    return [load_conversation(p, max_sessions) for p in paths[: limit or None]]


def conversation_facts(conv) -> list:
    from inferscale.facts import Fact, make_fact_id

    user = f"locomo-{conv.sample_id}"
    return [Fact(make_fact_id(user, text, src), user, text, src) for text, src in conv.all_facts()]


def window_policy(spec: str):
    from inferscale.encode import FactsWindow, TurnsWindow

    if spec.startswith("facts:"):
        return FactsWindow(FactsWindow.Options(window=int(spec.split(":", 1)[1])))
    return TurnsWindow(TurnsWindow.Options(window=int(spec)))


# ---------------------------------------------------------------- measuring


class TokenCounter:
    """Input positions (padding included) and forward passes of the model, while open."""

    def __init__(self, model):
        self.tokens = self.passes = 0
        self._handle = model.base_model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.tokens += kwargs["input_ids"].numel()
        self.passes += 1

    def __enter__(self) -> TokenCounter:
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def timed_encode(encoder, facts, turns, prefix) -> tuple[dict, dict]:
    """The K/V, and seconds, tokens and passes of one ``encode``."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with TokenCounter(encoder.model) as counter:
        sync()
        start = time.perf_counter()
        kvs = encoder.encode(facts, turns, progress=False, prefix_ids=prefix)
        sync()
        seconds = time.perf_counter() - start
    return kvs, {"seconds": seconds, "tokens": counter.tokens, "passes": counter.passes}


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest |a - b| of a layer over that layer's largest |b|, over every fact's keys and values."""
    worst = 0.0
    for fid, kv in b.items():
        for x, y in ((a[fid].keys, kv.keys), (a[fid].values, kv.values)):
            x, y = x.float(), y.float()
            diff = (x - y).abs().flatten(1).amax(1) / y.abs().flatten(1).amax(1).clamp(min=1e-30)
            worst = max(worst, diff.max().item())
    return worst


def measure_conversation(encoders: dict, conv, prefix, reps: int, first: int) -> dict:
    """Both paths ``reps`` times, in alternating order; the median seconds of each."""
    facts = conversation_facts(conv)
    row = {"conversation": conv.sample_id, "facts": len(facts), "turns": len(conv.turns)}
    seconds: dict[str, list[float]] = {"before": [], "after": []}
    for rep in range(reps):
        order = ("before", "after") if (first + rep) % 2 == 0 else ("after", "before")
        kvs = {}
        for mode in order:
            kvs[mode], row[mode] = timed_encode(encoders[mode], facts, conv.turns, prefix)
            seconds[mode].append(row[mode]["seconds"])
    for mode, times in seconds.items():
        row[mode] = {**row[mode], "seconds": statistics.median(times), "all_seconds": times}
    row["max_rel_diff"] = max_rel_diff(kvs["after"], kvs["before"])
    return row


def measure_window(spec: str, model, tokenizer, convs, prefix, batch_size: int, reps: int) -> dict:
    from inferscale.encode import FactEncoder

    window = window_policy(spec)
    encoders = {"before": FactEncoder(model, tokenizer, window, batch_size, share_prefixes=False),
                "after": FactEncoder(model, tokenizer, window, batch_size, share_prefixes=True)}
    warm = conversation_facts(convs[0])[: 2 * batch_size]
    for encoder in encoders.values():  # kernels, allocator
        encoder.encode(warm, convs[0].turns, progress=False, prefix_ids=prefix)
    rows = []
    for i, conv in enumerate(convs):
        rows.append(measure_conversation(encoders, conv, prefix, reps, i))
        print(f"  w={spec} {conv.sample_id}: before {rows[-1]['before']['seconds']:.2f} s, "
              f"after {rows[-1]['after']['seconds']:.2f} s", flush=True)
    return {"window": spec, "conversations": rows, **summary(rows)}


def summary(rows: list[dict]) -> dict:
    before = statistics.mean(r["before"]["seconds"] for r in rows)
    after = statistics.mean(r["after"]["seconds"] for r in rows)
    tokens = {m: sum(r[m]["tokens"] for r in rows) for m in ("before", "after")}
    return {"before_s_per_conv": before, "after_s_per_conv": after, "speedup": before / after,
            "tokens_before": tokens["before"], "tokens_after": tokens["after"],
            "max_rel_diff": max(r["max_rel_diff"] for r in rows)}


# ---------------------------------------------------------------- report


def table(result: dict) -> str:
    lines = ["| window | facts / conv | before s / conv | after s / conv | after vs before | tokens run before → after "
             "| max rel K/V diff |", "|---|---|---|---|---|---|---|"]
    for w in result["windows"]:
        facts = statistics.mean(r["facts"] for r in w["conversations"])
        lines.append(f"| {w['window']} | {facts:.0f} | {w['before_s_per_conv']:.3f} | {w['after_s_per_conv']:.3f} "
                     f"| {w['speedup']:.2f}× | {w['tokens_before']:,} → {w['tokens_after']:,} "
                     f"| {w['max_rel_diff']:.1e} |")
    return "\n".join(lines)


def window_label(spec: str) -> str:
    return f"{spec.split(':')[1]} facts" if spec.startswith("facts:") else f"{spec} turns"


def plot(result: dict, path: Path) -> bool:
    """Bars of seconds per conversation per window, before and after; the paper's range
    for the Llama-3.1-8B shape. False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = result["windows"]
    xs = range(len(windows))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.bar([x - 0.2 for x in xs], [w["before_s_per_conv"] for w in windows], 0.4, label="before: whole rows")
    ax.bar([x + 0.2 for x in xs], [w["after_s_per_conv"] for w in windows], 0.4, label="after: shared prefills")
    if result["shape"] == "llama-3.1-8b":
        ax.axhspan(*PAPER_S_PER_CONV, color="tab:red", alpha=0.12, label="paper, Llama-3.1-8B: 39-206 s")
    ax.set_xticks(list(xs), [window_label(w["window"]) for w in windows])
    ax.set_yscale("log")
    ax.set_ylabel("seconds per LoCoMo conversation")
    ax.set_title(f"{result['shape']}, {result['device']}, {result['dtype']}, batch {result['batch_size']}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama-3.1-8b", help=f"a shape ({', '.join(sorted(SHAPES))}) or a config.json")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: the converted "
                        "Qwen2.5-Coder-0.5B-Instruct in $INFERSCALE_CACHE/models)")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/locomo"), help="LoCoMo *.json directory")
    parser.add_argument("--convs", type=int, default=0, help="the first N conversations (0: all)")
    parser.add_argument("--max-sessions", type=int, default=None, help="the first sessions of each conversation")
    parser.add_argument("--windows", default="0,2,facts:5,20", help="N turns, or facts:N (longest last)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--reps", type=int, default=1, help="times each conversation is encoded each way (median)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/encode_speed.json"))
    return parser.parse_args()


def header(args, shape: str, cfg: dict, model, tokenizer, prefix) -> dict:
    """What was run, on what."""
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    return {"command": " ".join(sys.argv), "shape": shape, "config": cfg,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(model.dtype).removeprefix("torch."),
            "batch_size": args.batch_size, "reps": args.reps, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "attention": model.config._attn_implementation, "tokenizer": getattr(tokenizer, "name_or_path", ""),
            "vocab_size": model.config.vocab_size, "prefix_tokens": len(prefix),
            "paper_s_per_conv": PAPER_S_PER_CONV, "windows": []}


def main() -> None:
    args = parse_args()
    import torch

    from inferscale.compose.prompt import PromptFormat
    from inferscale.config import DEFAULT_CLOSING, DEFAULT_INSTRUCTION

    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    shape, cfg = model_config(args.config)
    tokenizer = load_tokenizer(args.tokenizer or default_tokenizer())
    convs = load_conversations(args.data, args.convs, args.max_sessions)
    prefix = PromptFormat.from_tokenizer(tokenizer, DEFAULT_INSTRUCTION, DEFAULT_CLOSING).prefix_ids(tokenizer)
    model = build_model(cfg, len(tokenizer), dtype, device)
    print(f"{shape} on {device} ({dtype}), {len(convs)} conversations, prefix {len(prefix)} tokens", flush=True)
    result = header(args, shape, cfg, model, tokenizer, prefix)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.windows.split(","):  # written after each window: a cut-short run keeps what it measured
        result["windows"].append(measure_window(spec, model, tokenizer, convs, prefix, args.batch_size, args.reps))
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(f"wrote {args.out}" + (f" and {args.out.with_suffix('.png')}" if plot(result, args.out.with_suffix(".png")) else ""))


if __name__ == "__main__":
    main()
