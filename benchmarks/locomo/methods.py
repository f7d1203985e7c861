"""A method: how the retrieved facts reach the model (``kv[...]`` or ``prompt[...]``, its fields those
of :class:`Method`), which encodings of a fact it reads, and the method named by a string."""

from __future__ import annotations

import re
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields


@dataclass(frozen=True)
class Method:
    name: str
    mode: str = "kv"  # kv | prompt
    window: int = 2  # turns before each fact ("turns" policy); negative: the -window facts before it ("facts")
    style: str = "bullet"
    closing: str = "none"  # the text after the facts (prompts.CLOSINGS), or "ask": the closing line, then the question
    recompute_tokens: int = 0
    key_scale: float = 1.0
    neighbours: int = 0  # > 0: the "neighbours" policy, each fact behind its nearest facts (window unused)
    order: str = "relevance"  # the composer: "relevance" (most relevant last) or "stored" (as stored)
    # "0/5/20": every fact encoded behind 0, 5 and 20 facts; each slot of a segment reads the encoding
    # whose window is nearest to the number of facts before that slot (the window unused)
    slots: str = ""
    # the content part of the facts' stored keys scaled at encoding, around the key bias:
    # k = b + c (k - b), a softmax temperature 1/c on what the keys say (see content_scaled)
    content_scale: float = 1.0
    # "f10/n10": every fact encoded behind the 10 facts stored before it and behind its 10 nearest;
    # a request reads, for each fact, the encoding whose context holds more of the facts retrieved
    # with it (the first listed on a tie; see Contexts.choose; the window unused)
    contexts: str = ""
    # a benchmarks/kv_calibration.py JSON (inferscale.encode.calibration): scales (and shifts) on
    # the stored keys' content and values, fitted offline against prompt injection (replaces content_scale)
    calibration: str = ""
    # a fact wrappers file (inferscale.encode.wrappers): learned embeddings around every fact at encoding
    wrappers: str = ""
    # how the stored K/V are kept at rest (Config.kv_dtype_at_rest): "model", or "fp8_e4m3", read back
    # through its round trip (inferscale.kv_fp8.fp8_round_trip); screened by locomo_screen.py
    at_rest: str = "model"

    @property
    def encoding(self) -> tuple[int, str, int, float]:
        return (0 if self.neighbours else self.window), self.style, self.neighbours, self.transform

    @property
    def encodings(self) -> list[tuple[int, str, int]]:
        """Every encoding a request of this method may read."""
        if self.contexts:
            return [context_encoding(c, self.style, self.transform) for c in self.contexts.split("/")]
        return [(-w, self.style, 0, self.transform) for w in self.windows] if self.slots else [self.encoding]

    @property
    def transform(self) -> float | str:
        """What the stored K/V go through: a key content scale, a calibration file, or (at the model's
        pass) fact wrappers (``"wrappers:<file>"``)."""
        if self.wrappers and (self.calibration or self.content_scale != 1.0):
            raise ValueError(f"{self.name}: wrappers are trained for the plain K/V (no calibration or content scale)")
        return self.calibration or (f"{WRAPPED}{self.wrappers}" if self.wrappers else self.content_scale)

    @property
    def windows(self) -> list[int]:
        return sorted(int(w) for w in self.slots.split("/")) if self.slots else []

    def encoding_at(self, slot: int) -> tuple[int, str, int, float]:
        """The encoding the fact at ``slot`` (that many facts before it) reads."""
        if not self.slots:
            return self.encoding
        best = min(self.windows, key=lambda w: (abs(w - slot), -w))
        return -best, self.style, 0, self.transform


#: the transform of an encoding with fact wrappers: this prefix, then the wrappers file
WRAPPED = "wrappers:"


def wrappers_of(transform: float | str) -> str:
    """The wrappers file of an encoding's transform ("" if none)."""
    return transform[len(WRAPPED):] if isinstance(transform, str) and transform.startswith(WRAPPED) else ""


def context_encoding(spec: str, style: str, scale: float) -> tuple[int, str, int, float]:
    """``"f10"``: behind the 10 facts stored before it; ``"n10"``: behind its 10 nearest facts."""
    kind, count = spec[0], int(spec[1:])
    if kind not in "fn" or count <= 0:
        raise ValueError(f"unknown context {spec!r}: f<count> (facts stored before) or n<count> (nearest)")
    return (-count, style, 0, scale) if kind == "f" else (0, style, count, scale)


class Contexts:
    """What each fact of a conversation was encoded behind, per encoding: the facts stored before it
    (a facts window) or its nearest facts (``ranks``, from :func:`related_ranks`)."""

    def __init__(self, ranks: dict[str, list[list[int]]]):
        self.ranks = ranks

    def context(self, conv: str, j: int, encoding: tuple[int, str, int, float]) -> set[int]:
        window, _, neighbours, _ = encoding
        if neighbours:
            return set(self.ranks[conv][j][:neighbours])
        return set(range(max(0, j + window), j)) if window < 0 else set()

    def choose(self, method: Method, conv: str, j: int, retrieved: set[int]) -> tuple[int, str, int, float]:
        """The encoding of fact ``j`` whose context holds the most of the other ``retrieved`` facts."""
        others = retrieved - {j}
        return max(method.encodings, key=lambda e: len(self.context(conv, j, e) & others))


def _kv(**kw) -> Method:
    parts = [f"{k}={v}" for k, v in kw.items()]
    return Method("kv" + ("[" + ",".join(parts) + "]" if parts else ""), **kw)


def _prompt(**kw) -> Method:
    parts = [f"{k}={v}" for k, v in kw.items()]
    return Method("prompt" + ("[" + ",".join(parts) + "]" if parts else ""), mode="prompt", **kw)


_NAME = re.compile(r"^(kv|prompt)(?:\[(.*)\])?$")


def parse_method(name: str, sets: list[str] = ()) -> Method:
    """The method a name describes: ``kv[window=-10,recompute_tokens=256]`` (fields of :class:`Method`)."""
    match = _NAME.match(name)
    fields = {f.name: f.type for f in dataclass_fields(Method)}
    if not match:
        raise SystemExit(f"unknown method {name!r}: kv[field=value,...] or prompt[...]; sets: {list(sets)}")
    values = {}
    for part in filter(None, (match.group(2) or "").split(",")):
        key, _, value = part.partition("=")
        if key not in fields or key in ("name", "mode"):
            raise SystemExit(f"method {name!r}: unknown field {key!r}; fields: {sorted(set(fields) - {'name', 'mode'})}")
        values[key] = {"int": int, "float": float}.get(fields[key], str)(value)
    return Method(name, mode=match.group(1), **values)


def usable(methods: list[Method]) -> list[Method]:
    """``methods`` less those whose calibration file does not load (each is named, with the reason)."""
    from inferscale.encode.calibration import KVCalibration
    from inferscale.errors import ConfigError

    for m in methods:
        if m.at_rest != "model":
            raise SystemExit(f"{m.name}: K/V at rest in {m.at_rest} are screened by locomo_screen.py (KL, NLL); "
                             "this harness serves every method from the model's dtype")
    bad = {}
    for path in {m.calibration for m in methods if m.calibration}:
        try:
            KVCalibration.load(path)
        except ConfigError as exc:
            bad[path] = exc
    for m in methods:
        if m.calibration in bad:
            print(f"skipped {m.name}: {bad[m.calibration]}", flush=True)
    return [m for m in methods if m.calibration not in bad]


def kv_encodings(methods: list[Method]) -> list[tuple[int, str, int, float | str]]:
    """Every encoding the K/V methods read, each once, in one order whatever the methods' order (a
    transform is a scale or a calibration file's path, which do not compare: sorted by repr)."""
    return sorted({e for m in methods if m.mode == "kv" for e in m.encodings}, key=repr)
