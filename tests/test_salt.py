"""Cache salts keyed with the server secret, and the secret file itself."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from inferscale.compose.request import SegmentRequest
from inferscale.compose.salt import CacheSalts
from inferscale.config import Config
from inferscale.errors import ConfigError
from inferscale.secret import load_secret
from inferscale.storage.disk import DiskStore
from test_storage import make_facts

REPO = Path(__file__).resolve().parents[1]
KEY = CacheSalts(b"k" * 32)


def test_salt_depends_on_everything_it_covers():
    base = KEY.segment("alice", "e1", [1, 2, 3])
    assert base == KEY.segment("alice", "e1", [1, 2, 3])
    variants = [KEY.segment("bob", "e1", [1, 2, 3]), KEY.segment("alice", "e2", [1, 2, 3]),
                KEY.segment("alice", "e1", [1, 2, 4]), KEY.segment("alice", "e1", [12, 3]),
                CacheSalts(b"q" * 32).segment("alice", "e1", [1, 2, 3]), KEY.text("alice", "e1")]
    assert len({base, *variants}) == len(variants) + 1
    assert KEY.text("alice", "e1") != KEY.text("bob", "e1") and KEY.text("alice", "e1") != KEY.text("alice", "e2")


def test_salt_reads_token_ids_of_any_integer_kind():
    """The scheduler hashes a list, a client a tuple, the server NumPy or torch ids: one
    segment has one salt; ids that do not fit 64 bits are refused."""
    import numpy as np
    import torch

    ids = [0, 1, 151_643, 2**31, 2**63 - 1]
    base = KEY.segment("ann", "e", ids)
    assert {KEY.segment("ann", "e", kind) for kind in (tuple(ids), np.array(ids, dtype=np.int64),
                                                        torch.tensor(ids).tolist())} == {base}
    assert KEY.segment("ann", "e", ids[:-1]) != base and KEY.segment("ann", "e", []) != KEY.segment("ann", "e", [0])
    with pytest.raises(OverflowError):
        KEY.segment("ann", "e", [2**63])
    assert KEY.segment("ann", "e", ()) == KEY.segment("ann", "e", [])


def test_salt_tells_apart_every_recipe():
    salts = {KEY.segment("ann", "e", [1, 2, 3], b, c) for b in (None, 0, 32) for c in (None, 1.0, 1.25)}
    assert len(salts) == 9
    request = SegmentRequest("ann", ("a",), 32, 1.25)
    assert request.salt(KEY, "e", [1, 2, 3]) == KEY.segment("ann", "e", [1, 2, 3], 32, 1.25)


def test_salt_is_an_hmac_of_the_documented_message():
    """Salts handed to clients stay valid across releases only if the message never changes:
    a JSON head (kind, user, epoch, token count, recipe), a newline, then the token ids as
    little-endian int64. Heads are remembered per recipe, never confused across equal values
    of another type (a budget of True is not a budget of 1)."""
    import hashlib
    import hmac
    import json
    import struct

    def expected(fields, tokens=()):
        message = json.dumps(fields, separators=(",", ":")).encode() + b"\n" + struct.pack(f"<{len(tokens)}q", *tokens)
        return "inferscale-" + hmac.new(b"k" * 32, message, hashlib.sha256).hexdigest()[:32]

    assert KEY.segment("ann", "e1", [5, 6]) == expected(["segment", "ann", "e1", 2, [None, None]], [5, 6])
    assert KEY.segment("ann", "e1", [5, 6], 16, 1) == expected(["segment", "ann", "e1", 2, [16, 1.0]], [5, 6])
    assert KEY.text("ann", "e1") == expected(["text", "ann", "e1"])
    assert KEY.segment("ann", "e1", [5], 1) == expected(["segment", "ann", "e1", 1, [1, None]], [5])
    assert KEY.segment("ann", "e1", [5], True) == expected(["segment", "ann", "e1", 1, [True, None]], [5])


def test_a_recreated_user_gets_a_new_epoch(tmp_path):
    """The epoch is the user's epoch: renewed by every write, never reused, even
    for a user deleted and stored again with the very same facts."""
    disk = DiskStore(DiskStore.Options(root=str(tmp_path)))
    facts = make_facts(3)
    disk.put("alice", facts)
    seen = [disk.epoch("alice")]
    disk.put("alice", {"f9": facts["f0"]})
    seen.append(disk.epoch("alice"))
    disk.delete("alice", ["f9"])
    seen.append(disk.epoch("alice"))
    disk.delete("alice")
    assert disk.epoch("alice") is None
    disk.put("alice", facts)
    seen.append(disk.epoch("alice"))
    assert len(set(seen)) == len(seen)
    assert disk.epoch("alice") == DiskStore(DiskStore.Options(root=str(tmp_path))).epoch("alice")
    salts = {KEY.segment("alice", epoch, [1, 2, 3]) for epoch in seen}
    assert len(salts) == len(seen)


def test_secret_is_created_private_and_shared(tmp_path):
    config = Config(data_dir=str(tmp_path / "data"))
    assert config.secret_path == tmp_path / "data" / "secret"
    first = load_secret(config.secret_path)
    assert len(first) >= 32 and load_secret(config.secret_path) == first
    assert stat.S_IMODE(os.stat(config.secret_path).st_mode) == 0o600
    assert Config(secret_file=str(tmp_path / "elsewhere")).secret_path == tmp_path / "elsewhere"


def test_concurrent_first_use_agrees_on_one_secret(tmp_path):
    path = tmp_path / "secret"
    code = "import sys; from inferscale.secret import load_secret; print(load_secret(sys.argv[1]).decode())"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], env=env, stdout=subprocess.PIPE)
             for _ in range(4)]
    outputs = {p.communicate(timeout=120)[0] for p in procs}
    assert len(outputs) == 1 and all(p.returncode == 0 for p in procs)
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]


def test_secret_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "secret"
    load_secret(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_secret(path)
    path.write_text("short\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="at least"):
        load_secret(path)
