"""Latency of embedding one question: sentence-transformers' encode, the padded forward run eagerly,
and its CUDA-graph replay (:mod:`inferscale.retrieval.query_graphs`), in the same run.

    python benchmarks/embed_latency.py --model-path .gpu/minilm --reps 200 --out embed_latency.json

Prints a table (median ms per question, and the largest difference between the unit vectors of
each path and sentence-transformers') and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from inferscale.retrieval.checks import unit_rows
from inferscale.retrieval.embed_local import SentenceTransformerEmbedder
from inferscale.retrieval.query_graphs import QueryGraphs

QUESTIONS = [
    "When did Caroline go to the LGBTQ support group?",
    "What did I do on my weekends with my friends last spring?",
    "What fields would Caroline be likely to pursue in her education?",
    "How long has Melanie been practicing art?",
    "Would Caroline still want to pursue counseling as a career if she hadn't received support growing up?",
    "What is my dog's name?",
    "Which city did John move to after he finished college, and who did he live with there?",
    "Where?",
]


def median_ms(run, reps: int) -> float:
    times = []
    for _ in range(reps):
        for question in QUESTIONS:
            start = time.perf_counter()
            run(question)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="a sentence-transformers directory (default: MiniLM)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=100, help="rounds over the questions")
    parser.add_argument("--out", type=Path, default=Path("embed_latency.json"))
    args = parser.parse_args()

    options = SentenceTransformerEmbedder.Options(model_path=args.model_path, device=args.device, query_graphs=False)
    embedder = SentenceTransformerEmbedder(options)
    model = embedder._load()
    eager = QueryGraphs(model, capture=False)
    graphed = QueryGraphs(model)

    paths = {
        "sentence-transformers encode": lambda q: embedder.embed([q]),
        "padded forward, eager": lambda q: unit_rows(eager.embed(q).cpu()),
        "padded forward, CUDA graph": lambda q: unit_rows(graphed.embed(q).cpu()),
    }
    reference = {q: embedder.embed([q]) for q in QUESTIONS}
    rows = []
    for name, run in paths.items():
        for _ in range(3):  # warm-up: capture, lazy initialisation
            for q in QUESTIONS:
                run(q)
        gap = max(float((run(q) - reference[q]).abs().max()) for q in QUESTIONS)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rows.append({"path": name, "median_ms": median_ms(run, args.reps), "max_abs_diff_vs_st": gap})
    captured = sorted(b for b, e in graphed._graphs.items() if e.graph is not None)
    base = rows[0]["median_ms"]
    print(f"device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}; "
          f"{len(QUESTIONS)} questions x {args.reps}; graphs captured for buckets {captured}")
    print(f"{'path':32s} {'median ms':>10s} {'vs encode':>10s} {'max |diff|':>11s}")
    for row in rows:
        row["vs_encode"] = row["median_ms"] / base
        print(f"{row['path']:32s} {row['median_ms']:10.3f} {row['vs_encode']:10.2f} {row['max_abs_diff_vs_st']:11.2e}")
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "model": args.model_path or "all-MiniLM-L6-v2", "questions": QUESTIONS, "reps": args.reps,
              "captured_buckets": captured, "rows": rows,
              "command": "python benchmarks/embed_latency.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)}
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
