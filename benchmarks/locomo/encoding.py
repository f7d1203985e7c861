"""Encoding the facts the questions need, once per encoding (window, fact style, nearest facts,
transform), into the disk store the engine's connector reads, each encoding under its own user."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

from .methods import wrappers_of


def user_of(conv: str, encoding: tuple[int, str, int, float]) -> str:
    """The user an encoding is stored under. Every facts window, every nearest-facts window and no
    context at all (window 0) share one user, their fact ids tagged by window (:func:`source_tag`),
    so one request can read several encodings."""
    window, style, neighbours, scale = encoding
    kind = "wrap" if wrappers_of(scale) else "cal"
    scaled = f".{kind}-{Path(scale).stem}" if isinstance(scale, str) else f".c{scale:g}" if scale != 1.0 else ""
    return f"{conv}.w{window}.{style}{scaled}" if window > 0 and not neighbours else f"{conv}.facts.{style}{scaled}"


def source_tag(encoding: tuple[int, str, int, float], source: str | None) -> str | None:
    """What a fact id is made from besides user and text: the source turn, and for the facts
    windows (which share a user) the window."""
    window, _, neighbours, _ = encoding
    if neighbours:
        return f"{source}|n{neighbours}"
    return f"{source}|f{-window}" if window <= 0 else source


def window_policy(window: int, neighbours: int = 0):
    """``window`` turns before each fact, (negative) the ``-window`` facts before it, or the
    ``neighbours`` facts nearest to it."""
    from inferscale.config import BackendSpec, build

    if neighbours:
        return build("window", BackendSpec("neighbours", {"window": neighbours}))
    if window >= 0:
        return build("window", BackendSpec("turns", {"window": window}))
    return build("window", BackendSpec("facts", {"window": -window}))


def content_scaled(kv, bias, scale: float):
    """``kv`` with its keys' content scaled around the key bias (``bias``: ``[layers, kv_heads,
    head_size]``, :attr:`FactEncoder.key_bias`): ``b + scale (k - b)``.

    A key is ``k = W x + b``; the query's logit on it is ``q . R(k) = q . R(W x) + q . R(b)``. The
    bias term depends only on the two positions (it draws the model's positional patterns, its
    attention sinks among them) and is large on Qwen2 models (|b| up to 354 on the 1.5B's layer 0).
    Scaling the whole key by ``c`` scales that term too, on the injected facts only, and moves their
    attention against the prefix and the question; scaling ``W x`` alone is a temperature on what
    the keys say."""
    from inferscale.encode.calibration import corrected
    from inferscale.kv import FactKV

    keys, _ = corrected(kv.keys.float(), kv.values, bias, scale, 1.0)
    return FactKV(kv.token_ids, keys.to(kv.keys.dtype), kv.values)


def encode_all(args, convs, needed, encodings, model_dir: str, data_dir: Path, prefix_ids, kv_dtype, ranks) -> dict:
    """Encode the needed facts once per (window, style): (conv, encoding) → {fact index: fact_id};
    ``ranks``: each fact's nearest facts (:func:`related_ranks`), for the nearest-facts windows."""
    import torch

    from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
    from inferscale.encode.calibration import KVCalibration
    from inferscale.encode.encoder import FactEncoder
    from inferscale.encode.wrappers import FactWrappers
    from inferscale.facts import Fact, make_fact_id
    from inferscale.kv import FactKV
    from inferscale.storage.disk import DiskStore

    disk = DiskStore(DiskStore.Options(root=str(data_dir / "kv")))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids: dict = {}
    with FactEncoder.from_spec(model_dir, dtype="float32", batch_size=args.encode_batch) as encoder:
        encoder.model.to(device)
        calibrations = {path: KVCalibration.load(path) for path in {e[3] for e in encodings if isinstance(e[3], str)
                                                                     and not wrappers_of(e[3])}}

        def cast(kv: FactKV) -> FactKV:
            return FactKV(kv.token_ids, kv.keys.to(kv_dtype), kv.values.to(kv_dtype))

        disk.put(SYSTEM_USER, {PREFIX_FACT: cast(encoder.encode_ids(prefix_ids))})
        # the model runs once per (window, style, neighbours, wrappers); each transform (content
        # scale, calibration) is derived from it
        scales: dict = defaultdict(list)
        for encoding in encodings:
            scales[(*encoding[:3], wrappers_of(encoding[3]))].append(encoding[3])
        for (window, style, neighbours, wrappers), group in scales.items():
            encoder.window = window_policy(window, neighbours)
            encoder.fact_style = style
            encoder.wrappers = FactWrappers.load(wrappers).check(encoder.model) if wrappers else None
            start = time.perf_counter()
            for cid, indices in needed.items():
                conv = convs[cid]
                fact_lists = {}
                for scale in group:
                    encoding = (window, style, neighbours, scale)
                    user = user_of(cid, encoding)
                    fact_lists[scale] = [Fact(make_fact_id(user, text, source_tag(encoding, src)), user, text, src)
                                         for text, src in conv.all_facts()]
                facts = fact_lists[group[0]]
                only = {facts[j].fact_id for j in indices}
                related = {facts[j].fact_id: [facts[r].fact_id for r in reversed(ranks[cid][j][:neighbours])]
                           for j in indices} if neighbours else None
                kvs = encoder.encode(facts, conv.turns, progress=False, prefix_ids=prefix_ids, only=only,
                                     related=related)
                for scale, scaled_facts in fact_lists.items():
                    put = {scaled_facts[j].fact_id: kvs[facts[j].fact_id] for j in indices}
                    if isinstance(scale, str) and not wrappers:
                        put = {fid: calibrations[scale].apply(kv, encoder.key_bias) for fid, kv in put.items()}
                    elif scale != 1.0:
                        put = {fid: content_scaled(kv, encoder.key_bias, scale) for fid, kv in put.items()}
                    disk.put(scaled_facts[0].user_id, {fid: cast(kv) for fid, kv in put.items()})
                    ids[(cid, (window, style, neighbours, scale))] = {j: scaled_facts[j].fact_id for j in indices}
            name = user_of('', (window, style, neighbours, 1.0)).lstrip('.') \
                + (f" n{neighbours}" if neighbours else f" f{-window}" if window <= 0 else "")
            print(f"encoded {name} (transforms {', '.join(c if isinstance(c, str) else f'{c:g}' for c in group)}): "
                  f"{sum(map(len, needed.values()))} facts in {time.perf_counter() - start:.1f} s", flush=True)
    return ids
