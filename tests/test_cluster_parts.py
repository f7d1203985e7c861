"""The cluster's small parts, without servers: the session key, and retrieval indexes that follow
the store's epochs when another process writes it."""

from __future__ import annotations

import torch

from inferscale.api.freshness import IndexedEpochs
from inferscale.config import BackendSpec, build
from inferscale.session import session_key
from inferscale.storage.disk import DiskStore
from test_storage import make_facts


def test_the_session_key_is_keyed_by_the_secret_and_carries_no_user_id():
    secret, other = b"a" * 32, b"b" * 32
    key = session_key(secret, "maya@example.com")
    assert key == session_key(secret, "maya@example.com") and key.startswith("s-") and len(key) == 34
    assert "maya" not in key and key != session_key(secret, "ana@example.com")
    assert key != session_key(other, "maya@example.com")


def test_a_retrieval_index_follows_writes_made_by_another_process(tmp_path):
    """Two stores on one root stand for two replicas on a shared filesystem (or one Redis)."""
    mine, theirs = (DiskStore(DiskStore.Options(root=str(tmp_path))) for _ in range(2))
    retriever = build("retriever", BackendSpec("exact"))
    indexed = IndexedEpochs(mine, retriever)
    facts = make_facts(3)
    vectors = {f: torch.nn.functional.normalize(torch.randn(8), dim=0) for f in facts}
    theirs.put("maya", {"f0": facts["f0"]}, embeddings={"f0": vectors["f0"]})
    assert indexed.sync("maya").count("maya") == 1
    theirs.put("maya", {"f1": facts["f1"], "f2": facts["f2"]}, embeddings={"f1": vectors["f1"], "f2": vectors["f2"]})
    assert indexed.sync("maya").count("maya") == 3
    theirs.delete("maya", ["f1"])
    hits = indexed.sync("maya").search("maya", vectors["f1"][None], 3)[0]
    assert "f1" not in [h.fact_id for h in hits] and len(hits) == 2
    theirs.delete("maya")
    assert indexed.sync("maya").count("maya") == 0
