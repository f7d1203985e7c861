"""Every vLLM-release difference and environment setting lives in connector/compat.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from inferscale.connector import compat
from inferscale.errors import UnsupportedReleaseError

PACKAGE = Path(__file__).resolve().parents[1] / "inferscale"


def test_an_untested_vllm_release_is_refused_with_a_clear_error():
    compat.check_release(compat.SUPPORTED[0])
    compat.check_release(compat.VLLM_VERSION)  # the installed one is a tested one
    with pytest.raises(UnsupportedReleaseError, match=r"not a release InferScale was tested with \(0\.26, 0\.32\)"):
        compat.check_release((0, 99), environ={})
    compat.check_release((0, 99), environ={compat.ALLOW_UNTESTED: "1"})


def test_engine_environment_keeps_what_the_user_set(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    compat.set_engine_environment("cpu", in_process=True)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "7" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_only_compat_and_engine_import_vllm_or_set_its_environment():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() in ("connector/compat.py", "connector/engine.py"):
            continue
        text = path.read_text()
        if re.search(r"^\s*(from vllm\b|import vllm\b)", text, re.M) or re.search(r"environ\S*\[?\S*[\"']VLLM_", text):
            offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []


def test_cuda_engines_are_spawned_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    compat.set_engine_environment("cuda", in_process=False)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    compat.set_engine_environment("cuda", in_process=False)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def test_asking_for_the_device_type_leaves_cuda_uninitialised():
    """Through NVML, not the CUDA driver: the process can still fork an engine."""
    import torch

    assert compat.platform_device_type() in ("cuda", "cpu")
    assert not torch.cuda.is_initialized()


def test_load_failures_are_recomputed_only_where_the_release_answers_right_after_a_rollback():
    assert compat.load_failure_policy((0, 32), "cpu") == "recompute"
    assert compat.load_failure_policy((0, 32), "cuda") == "recompute"
    assert compat.load_failure_policy((0, 26), "cpu") == "recompute"
    assert compat.load_failure_policy((0, 26), "cuda") == "fail"  # vllm-project/vllm#49250


class _Layer:
    """An attention layer as :func:`compat.kv_cache_views` sees it."""

    def __init__(self, impl_name: str, kv_cache):
        self.impl = type(impl_name, (), {"head_size": 8})()
        self.kv_cache = kv_cache
        self.kv_cache_dtype = "auto"


def test_the_fused_write_names_an_untested_release_as_the_reason_it_is_off(monkeypatch):
    import torch

    cache = torch.empty(2, 4, 16, 16)  # [blocks, heads, slots, 2 * head_size]
    monkeypatch.setattr(compat, "VLLM_VERSION", (0, 99))
    with pytest.raises(ValueError, match=r"untested with it \(its cache layout was checked on 0\.26 only\)"):
        compat.kv_cache_views(_Layer("FlashAttentionImpl", cache), None)
    monkeypatch.setattr(compat, "VLLM_VERSION", compat.FUSED_WRITE_RELEASE)
    with pytest.raises(ValueError, match="attention backend CPUAttentionBackendImpl"):
        compat.kv_cache_views(_Layer("CPUAttentionBackendImpl", cache), None)
    with pytest.raises(ValueError, match="on cpu"):
        compat.kv_cache_views(_Layer("FlashAttentionImpl", cache), None)
