"""The Fact record: one remembered statement about a user.

A fact links three things under one ``fact_id``: its text (embedded for
retrieval), its token ids, and its K/V (stored by a KV store).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

_ID = r"[A-Za-z0-9_.:-]{1,128}"
_ID_RE = re.compile(_ID)  # matched whole (fullmatch): "$" alone would let a trailing newline through
_IDS_RE = re.compile(rf"(?:{_ID} )*{_ID}")  # ids joined by spaces (which no id contains)
MAX_USER_ID_CHARS = 128
#: a user's file name is its id, escaped (:func:`user_file_stem`), plus a suffix: at most this many bytes
MAX_USER_FILE_STEM_BYTES = 200
#: names that cannot be a file's: refused as user and fact ids
DOT_NAMES = frozenset((".", ".."))
#: characters of a refused value shown in its error message
SHOWN_CHARS = 60
#: users whose id starts with this are the library's own (the instruction prefix's ``_system``):
#: no request may name them (:func:`check_request_user_id`)
INTERNAL_PREFIX = "_"
#: in a user's file name, these characters are written as %XX ("%" first, so decoding is unique)
_FILE_ESCAPES = {"%": "%25", "/": "%2F", "\\": "%5C"}


@dataclass(frozen=True)
class Fact:
    fact_id: str
    user_id: str
    text: str
    source_turn: str | None = None
    token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check_id(self.fact_id, "fact_id")
        check_user_id(self.user_id)
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))


@dataclass(frozen=True)
class Hit:
    """A retrieved fact and how relevant it is (higher is more relevant)."""

    fact_id: str
    score: float


def make_fact_id(user_id: str, text: str, source_turn: str | None = None, key: bytes | None = None) -> str:
    """A stable id: the same user, text and source turn always give the same id,
    so re-adding a conversation is idempotent.

    With ``key`` (the server's, :func:`fact_id_key`; what the server and :class:`MemoryAPI`
    use) the id is an HMAC, so nobody without the secret can tell from an id, or test by
    guessing one, what a fact says. Without it, a plain hash (ids for data sets and tests)."""
    message = f"{user_id}\x00{source_turn or ''}\x00{text}".encode()
    digest = hmac.digest(key, message, "sha256").hex() if key else hashlib.sha256(message).hexdigest()
    return f"f-{digest[:16]}"


def fact_id_key(secret: bytes) -> bytes:
    """The key of fact ids, derived from the server secret (never the secret itself)."""
    return hmac.digest(secret, b"inferscale fact ids", "sha256")


def check_id(value: object, what: str) -> str:
    """fact_ids (and other internal names) are short ASCII names: they become tensor names."""
    if not isinstance(value, str) or len(value) > 128 or not _ID_RE.fullmatch(value):
        raise ValueError(f"{what} must match {_ID_RE.pattern}, got {shown(value)}")
    if value in DOT_NAMES:
        raise ValueError(f"{what} {value!r} is not a usable name")
    return value


def shown(value: object) -> str:
    """``repr(value)``, cut to :data:`SHOWN_CHARS` characters (an error never echoes megabytes)."""
    if isinstance(value, (str, bytes)):
        text = repr(value[: SHOWN_CHARS + 1])
        return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(value)} long)"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)[:SHOWN_CHARS]
    return f"a {type(value).__name__}"


def check_id_list(values: Sequence[object], what: str) -> None:
    """:func:`check_id` of each value: one regex over all of them (a request names dozens of
    facts, and this runs on the scheduler's critical path), each one apart to name a bad one."""
    if values and all(type(v) is str for v in values):
        joined = " ".join(values)
        if joined.count(" ") == len(values) - 1 and _IDS_RE.fullmatch(joined) and DOT_NAMES.isdisjoint(values):
            return  # no space inside an id
    for value in values:
        check_id(value, what)


def check_user_id(value: object) -> str:
    """A user id is what Mem0 accepts as one, less control characters; returned in Unicode's
    NFC form, the one every store holds (:func:`check_stored_user_id`).

    Mem0 takes any string and trims it, refusing empty ones and ones with
    whitespace inside; here the id must already be trimmed (``"alice "`` is an
    error, not ``"alice"``), so both stores name the user alike. Emails,
    slashes, accents are fine; control and format characters (``"alice\\n"``,
    a zero-width space, a bidi override) are not, nor ids longer than
    :data:`MAX_USER_ID_CHARS` characters or whose file name
    (:func:`user_file_stem`) would pass :data:`MAX_USER_FILE_STEM_BYTES` bytes.
    An id typed composed or decomposed (``"jos\\u00e9"``, ``"jose\\u0301"``) is one
    user: every way in (the Python API, the server, ``kv_transfer_params``, the
    command line) takes the id through here.

    Ids that pass are remembered (every request names its user).
    """
    return _checked_user_id(value) if type(value) is str else _check_user_id(value)


def check_stored_user_id(value: object) -> str:
    """:func:`check_user_id`, and already in NFC: what a store is given (the API normalized it)."""
    normal = check_user_id(value)
    if normal != value:
        raise ValueError(f"user_id {shown(value)} is not in Unicode NFC: normalize it first (check_user_id)")
    return normal


def _check_user_id(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"user_id must be a non-empty string, got {shown(value)}")
    if len(value) > MAX_USER_ID_CHARS:  # first: nothing below walks a long value
        raise ValueError(f"user_id is {len(value)} characters long (at most {MAX_USER_ID_CHARS})")
    value = unicodedata.normalize("NFC", value)
    if len(value) > MAX_USER_ID_CHARS:  # NFC lengthens a few characters (composition exclusions)
        raise ValueError(f"user_id is {len(value)} characters long in NFC (at most {MAX_USER_ID_CHARS})")
    if value in DOT_NAMES:
        raise ValueError(f"user_id {value!r} is not a usable name")
    bad = next((c for c in value if c.isspace() or unicodedata.category(c).startswith(("C", "Z"))), None)
    if bad is not None:
        raise ValueError(f"user_id must not contain whitespace or control characters "
                         f"(found U+{ord(bad):04X}), got {value!r}")
    size = len(user_file_stem(value, check=False).encode())
    if size > MAX_USER_FILE_STEM_BYTES:
        raise ValueError(f"user_id takes {size} bytes as a file name (at most {MAX_USER_FILE_STEM_BYTES})")
    return value


def check_request_user_id(value: object) -> str:
    """A user id a request may name (HTTP, chat, ``kv_transfer_params``): :func:`check_user_id`'s
    (in NFC), and not one of the library's own (:func:`is_internal`)."""
    value = check_user_id(value)
    if is_internal(value):
        raise ValueError(f"user_id {shown(value)} is reserved (ids starting with {INTERNAL_PREFIX!r} are internal)")
    return value


def same_user(stored: str, expected: str) -> bool:
    """A stored file names the expected user: the same id, or one stored before ids were
    normalized whose NFC form it is."""
    return stored == expected or (isinstance(stored, str) and unicodedata.normalize("NFC", stored) == expected)


def is_internal(user_id: str) -> bool:
    """The library's own users (the instruction prefix), never a client's."""
    return user_id.startswith(INTERNAL_PREFIX)


@lru_cache(maxsize=4096)
def _checked_user_id(value: str) -> str:  # only ids that pass are cached (an error is raised, not returned)
    return _check_user_id(value)


def user_file_stem(user_id: str, check: bool = True) -> str:
    """The user's id as a file name (without suffix): ``%``, ``/`` and ``\\`` written as
    ``%XX``, everything else kept (``alice@example.com`` stays as it is)."""
    if check:
        check_stored_user_id(user_id)
    return "".join(_FILE_ESCAPES.get(c, c) for c in user_id)


def user_from_file_stem(stem: str) -> str:
    """The user id a file name (without suffix) stands for: the inverse of :func:`user_file_stem`."""
    return _ESCAPED.sub(lambda m: _UNESCAPES[m.group(0)], stem)


_UNESCAPES = {escape: char for char, escape in _FILE_ESCAPES.items()}
_ESCAPED = re.compile("|".join(map(re.escape, _UNESCAPES)))


def render_fact(text: str, style: str = "bullet") -> str:
    """How a fact reads inside the memory segment: one line, as a bullet
    (``style="bullet"``) or as a plain sentence (``style="line"``).

    Encoder, composer and the prompt-injection baseline all use this, so KV
    injection and text injection put exactly the same tokens before the query.
    """
    line = " ".join(text.split())
    if style == "bullet":
        return f"- {line}\n"
    if style == "line":
        return f"{line}\n"
    raise ValueError(f"unknown fact style {style!r} (bullet, line)")
