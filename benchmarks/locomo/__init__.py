"""The LoCoMo accuracy harness as a library (``benchmarks/locomo_accuracy.py`` is its command line;
``locomo_screen.py``, ``kv_calibration.py`` and ``train_wrappers.py`` use it too). ``scoring.py``
scores an answer (token F1, containment, evidence recall); ``methods.py`` is a method (how the facts
reach the model: ``kv[...]`` / ``prompt[...]``) and ``grids.py`` the named sets of them;
``questions.py`` loads the questions and retrieves their facts; ``encoding.py`` encodes the facts
each method reads into the store; ``prompts.py`` is the prompt every method shares; ``serving.py``
asks the engine and scores the answers; ``report.py`` writes the summary, the table and the answers.
Import it with ``benchmarks/`` on ``sys.path`` (as every benchmark script does)."""

from .encoding import content_scaled, encode_all, source_tag, user_of, window_policy
from .grids import CALIBRATION, CALIBRATION_CHANNEL, method_sets, select_methods
from .methods import WRAPPED, Contexts, Method, context_encoding, kv_encodings, parse_method, usable, wrappers_of
from .prompts import CLOSINGS, INSTRUCTION, Prompts, segment_order
from .questions import (MAX_NEIGHBOURS, Item, load_items, make_items, needed_facts, recall_at, related_ranks,
                        retrieve)
from .report import gap_table, markdown, paired_gaps, summarize, write_results
from .scoring import contains, f1, normalize, recall
from .serving import build_engine, cache_salts, request, run_method

__all__ = ["CALIBRATION", "CALIBRATION_CHANNEL", "CLOSINGS", "INSTRUCTION", "MAX_NEIGHBOURS", "WRAPPED", "Contexts",
           "Item", "Method", "Prompts", "build_engine", "cache_salts", "contains", "content_scaled", "context_encoding",
           "encode_all", "f1", "gap_table", "kv_encodings", "load_items", "make_items", "markdown", "method_sets",
           "needed_facts", "normalize", "paired_gaps", "parse_method", "recall", "recall_at", "related_ranks",
           "request", "retrieve", "run_method", "segment_order", "select_methods", "source_tag", "summarize", "usable",
           "user_of", "window_policy", "wrappers_of", "write_results"]
