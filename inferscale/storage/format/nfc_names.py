"""Users stored before user ids were normalized: renamed to their ids' NFC form.

User ids enter in Unicode's NFC form (:func:`inferscale.facts.check_user_id`), so that
``"josé"`` typed composed or decomposed is one user. A store written before that may hold a user
under another form (a decomposed ``jose\\u0301``, as macOS keyboards and file names give it);
the store renames such a user to the NFC form, whole (their directory or file, their Redis key),
the first time it is opened. Their files still name the old form inside, and are read as the
NFC user's (:func:`inferscale.facts.same_user`); the next write to them writes the NFC form. Where
both forms are stored (two users, written before this rule), neither is renamed: the other
form is logged and stays unreachable until it is merged or removed by hand.
"""

from __future__ import annotations

import logging
import os
import unicodedata
from collections.abc import Callable, Iterable
from pathlib import Path

from inferscale import files

logger = logging.getLogger(__name__)


def renamed(name: str) -> str | None:
    """The NFC form of a stored name, or None when it is already in NFC."""
    normal = unicodedata.normalize("NFC", name)
    return None if normal == name else normal


def to_rename(names: Iterable[str]) -> list[tuple[str, str]]:
    return [(name, new) for name in names if (new := renamed(name)) is not None]


def rename_paths(directory: Path, pairs: list[tuple[str, str]]) -> list[str]:
    """Rename ``directory/old`` to ``directory/new`` for each pair whose new name is free (the
    caller holds the writers' lock); the names renamed."""
    done = []
    for old, new in pairs:
        if not os.path.lexists(directory / old):
            continue
        if os.path.lexists(directory / new):
            logger.error("%s: user %r is stored in two Unicode forms; %r is left as it is (merge or remove it "
                         "by hand)", directory, new, old)
            continue
        os.rename(directory / old, directory / new)
        done.append(new)
    if done:
        files.fsync_dir(directory)
        logger.info("%s: %d user(s) renamed to the NFC form of their id", directory, len(done))
    return done


def migrate_disk(root: Path, users_dir: Path, suffix: str, writer: Callable) -> list[str]:
    """The disk store's users (directories under ``users_dir``, format 1/2 files in ``root``)
    whose names are not in NFC, renamed; nothing is locked when there are none."""
    stems = to_rename(p.name for p in users_dir.iterdir()) if users_dir.is_dir() else []
    legacy = to_rename(p.name for p in root.iterdir() if p.name.endswith(suffix))
    if not stems and not legacy:
        return []
    with writer():
        return rename_paths(users_dir, stems) + rename_paths(root, legacy)
