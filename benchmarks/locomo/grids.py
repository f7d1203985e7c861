"""The named sets of methods a run may ask for (``--methods grid``, ``tradeoff``, ``wide``...), each
with its anchors first so that a run cut short keeps the comparison."""

from __future__ import annotations

from .methods import Method, _kv, _prompt, parse_method


def method_sets() -> dict[str, list[Method]]:
    """Named sets. ``window=-5`` encodes each fact behind the 5 facts before it (as it will be
    read: in a list of facts) instead of behind conversation turns. The grid runs the most
    telling methods first, so a run cut short keeps them."""
    fw = dict(window=-5)
    first = [_prompt(), _kv(**fw), _kv(), _kv(**fw, recompute_tokens=256), _kv(recompute_tokens=256),
             _kv(window=-20), _kv(window=-20, recompute_tokens=256), _prompt(closing="answer"),
             _kv(**fw, closing="answer"), _kv(**fw, closing="answer", recompute_tokens=256)]
    budgets = [_kv(**fw, recompute_tokens=b) for b in (32, 64, 128, 512)]
    scales = [_kv(**fw, key_scale=c) for c in (1.1, 1.25)]
    styles = [_kv(**fw, style="line"), _prompt(style="line")]
    windows = [_kv(window=w) for w in (0, 5, 20)] + [_kv(closing="answer")]
    return {
        "grid": first + budgets + scales + styles + windows,
        "smoke": [_prompt(), _kv(), _kv(**fw), _kv(**fw, recompute_tokens=64), _kv(slots="0/5/20"),
                  _kv(**fw, content_scale=1.1), _kv(contexts="f5/n5")],
        # the product's defaults on a GPU (facts window 5, closing line, B = 256) vs the same prompt
        "default": [_prompt(closing="answer"), _kv(**fw, closing="answer", recompute_tokens=256)],
        # offline context that matches the serving context (nearest facts), small tails, key scales
        "neighbours": neighbour_grid(),
        "neighbours05": neighbour_check(),
        # the stored-order composer against relevance order, with facts windows and small tails
        "order": order_grid(),
        "order05": order_check(),
        # what recovers accuracy at no per-request cost (key scales, slot-matched windows) against small tails
        "tradeoff": tradeoff_grid(),
        "tradeoff05": tradeoff_check(),
        "temperature": temperature_grid(),
        "context": context_grid(),
        "wide": wide_grid(),
        "depth": depth_grid(),
        "calibrated": calibrated_grid(),
        # both zero-cost families not yet measured on the 1.5B, in one run (calibrated's rows first)
        "offline": offline_grid(),
    }


def _anchors(recompute_free: bool = True) -> list[Method]:
    """What every grid is read against: prompt injection (the baseline), the default (facts 5,
    B = 256) and, unless told otherwise, the same facts with nothing recomputed; the closing line."""
    close = dict(closing="answer")
    free = [_kv(window=-5, **close)] if recompute_free else []
    return [_prompt(**close), *free, _kv(window=-5, **close, recompute_tokens=256)]


def context_grid() -> list[Method]:
    """Offline contexts nearer the one a fact is read in, at no per-request cost: each fact behind
    its nearest facts under the retrieval embedder (5, 10, 20: the facts it is most likely
    retrieved with, the most related last, as the relevance composer places them), behind the 10
    facts stored before it, and two windows read by slot (a fact in the first slots behind the 5
    facts before it, a fact deeper in the segment behind 20). Anchors first."""
    close = dict(closing="answer")
    anchors = _anchors()
    nearest = [_kv(neighbours=n, **close) for n in (5, 10, 20)]
    return anchors + nearest + [_kv(slots="5/20", **close), _kv(window=-10, **close)]


def wide_grid() -> list[Method]:
    """The facts window of 10 (the best row of :func:`context_grid` that recomputes nothing) with
    the tails around the 5x line (one fact, B = 32; B = 64) and today's B = 256; anchors first."""
    close = dict(closing="answer")
    anchors = _anchors(recompute_free=False)
    return anchors + [_kv(window=-10, **close, recompute_tokens=b) for b in (32, 64, 256)]


def depth_grid() -> list[Method]:
    """Contexts as deep as the segment a fact is read in, and several contexts per fact, at no
    per-request cost: facts windows of 10 (the best so far) and 40, each slot reading the window
    nearest the facts before it (10 or 40), and each fact reading whichever of its facts-10 and
    nearest-10 (or nearest-20) encodings has more of the facts retrieved with it in its context.
    Anchors first, with the facts window of 10 among them."""
    close = dict(closing="answer")
    anchors = _anchors() + [_kv(window=-10, **close)]
    several = [_kv(contexts="f10/n10", **close), _kv(contexts="f10/n20", **close)]
    return anchors + several + [_kv(slots="10/40", **close), _kv(window=-40, **close)]


#: where the calibrated set reads its corrections (written by benchmarks/kv_calibration.py before the
#: run): per layer and KV head, and per channel with shifts (``--form channel``)
CALIBRATION = "benchmarks/results/kv_calibration_qwen15_h200.json"


CALIBRATION_CHANNEL = "benchmarks/results/kv_calibration_channel_qwen15_h200.json"


def calibrated_grid() -> list[Method]:
    """Stored K/V through corrections fitted offline against prompt injection on facts that are not
    LoCoMo's (:data:`CALIBRATION`, :data:`CALIBRATION_CHANNEL`, fitted for the facts window of 10),
    at B = 0 and with the default tail, against the same windows without them. The facts window of
    10 with and without them comes first, beside prompt injection and the default, so a run cut
    short keeps the comparison."""
    close = dict(closing="answer")
    prompt, free, default = _anchors()
    f10 = dict(window=-10, **close)
    first = [prompt, _kv(**f10), _kv(**f10, calibration=CALIBRATION_CHANNEL), _kv(**f10, calibration=CALIBRATION), default]
    return first + [free, _kv(window=-5, **close, calibration=CALIBRATION_CHANNEL), _kv(window=-5, **close, calibration=CALIBRATION),
                    _kv(**f10, calibration=CALIBRATION, recompute_tokens=256)]


def offline_grid() -> list[Method]:
    """The calibrated set, then the depth set's rows it lacks (one run of both: shared anchors)."""
    rows = calibrated_grid()
    names = {m.name for m in rows}
    return rows + [m for m in depth_grid() if m.name not in names]


def tradeoff_grid() -> list[Method]:
    """Ways to recover cross-fact attention that cost a request nothing — a key scale (a softmax
    temperature over the injected facts), a wider facts window, several windows per fact read by
    slot (a fact behind as many facts as precede it when read) — against tails that fit at 5x or
    near it (B = 32, 64) and larger ones. Anchors first; the closing line everywhere."""
    close = dict(closing="answer")
    anchors = _anchors()
    free = [_kv(window=-5, **close, key_scale=1.05), _kv(slots="0/5/20", **close), _kv(window=-5, **close, key_scale=1.1),
            _kv(window=-20, **close), _kv(window=-5, **close, key_scale=0.95)]
    tails = [_kv(window=-5, **close, recompute_tokens=b) for b in (64, 32, 128)]
    return anchors + free + tails + [_kv(slots="0/5/20", **close, recompute_tokens=64)]


def temperature_grid() -> list[Method]:
    """A temperature on the facts' key content (around the key bias, fixed at encoding) against
    the per-request key scale, which also scales the bias; anchors first."""
    close = dict(closing="answer")
    anchors = _anchors()
    content = [_kv(window=-5, **close, content_scale=c) for c in (1.05, 1.1, 1.2, 0.9)]
    return anchors + content + [_kv(window=-5, **close, content_scale=1.1, recompute_tokens=64),
                                _kv(window=-20, **close, content_scale=1.1)]


def tradeoff_check() -> list[Method]:
    """The smaller model's share of :func:`tradeoff_grid`: the anchors and the free candidates."""
    close = dict(closing="answer")
    return [_prompt(**close), _kv(window=-5, **close, recompute_tokens=256), _kv(window=-5, **close),
            _kv(window=-5, **close, key_scale=1.05), _kv(slots="0/5/20", **close), _kv(window=-5, **close, recompute_tokens=64)]


def order_grid() -> list[Method]:
    """Facts composed in the order they were stored, so a fact encoded behind the facts stored
    before it is read behind the retrieved ones among them, against relevance order: facts
    windows 5/10/20/50, a tail that fits at 5x (B = 16), a key scale, the neighbours window.
    Anchors first; every method with the closing line, as the product serves."""
    close, stored = dict(closing="answer"), dict(closing="answer", order="stored")
    anchors = [_prompt(**close), _prompt(**stored), _kv(window=-5, **close), _kv(window=-5, **stored)]
    windows = [_kv(window=-20, **stored), _kv(window=-10, **stored)]
    tails = [_kv(window=-5, **stored, recompute_tokens=16), _kv(window=-5, **close, recompute_tokens=256)]
    more = [_kv(window=-20, **close), _kv(window=-5, **stored, key_scale=1.05), _kv(window=-50, **stored),
            _kv(neighbours=10, **close)]
    return anchors + windows + tails + more


def order_check() -> list[Method]:
    """The smaller model's share of :func:`order_grid`: today's default and the candidates."""
    close, stored = dict(closing="answer"), dict(closing="answer", order="stored")
    return [_prompt(**close), _prompt(**stored), _kv(window=-5, **close, recompute_tokens=256),
            _kv(window=-5, **stored), _kv(window=-20, **stored), _kv(window=-10, **stored),
            _kv(window=-5, **stored, recompute_tokens=16), _kv(window=-5, **close)]


def neighbour_grid() -> list[Method]:
    """The neighbours policy against the facts window at B = 0, with key scales and small tails;
    every method with the closing line, as the product serves. The anchors come first."""
    close = dict(closing="answer")
    anchors = _anchors()
    windows = [_kv(neighbours=n, **close) for n in (10, 20)] + [_kv(window=-20, **close)]
    scales = [_kv(neighbours=20, **close, key_scale=c) for c in (1.05, 1.1)]
    tails = [_kv(neighbours=20, **close, recompute_tokens=b) for b in (64, 128)]
    return anchors + windows + scales + tails


def neighbour_check() -> list[Method]:
    """The smaller model's share of :func:`neighbour_grid`: today's default and the candidates."""
    close = dict(closing="answer")
    return [_prompt(**close), _kv(window=-5, **close, recompute_tokens=256), _kv(window=-5, **close),
            _kv(neighbours=10, **close), _kv(neighbours=20, **close), _kv(neighbours=20, **close, recompute_tokens=64)]


def select_methods(spec: str) -> list[Method]:
    """A named set, or method names joined by ';' (any ``kv[field=value,...]`` / ``prompt[...]`` parses)."""
    sets = method_sets()
    if spec in sets:
        return sets[spec]
    every = {m.name: m for ms in sets.values() for m in ms}
    return [every[n] if n in every else parse_method(n, sorted(sets)) for n in spec.split(";")]
