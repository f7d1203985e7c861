"""What the cluster tests need before they start: redis-server, the cluster extra (the redis client
and vllm-router), and deploy/local_cluster.py. Importing this skips the importing test module,
saying what to install, when one of them is missing."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

if shutil.which("redis-server") is None or importlib.util.find_spec("redis") is None or \
        not (Path(sys.executable).parent / "vllm-router").exists() and shutil.which("vllm-router") is None:
    pytest.skip("needs redis-server (apt-get install -y redis-server) and pip install 'inferscale-kv[cluster]'",
                allow_module_level=True)

sys.path.insert(0, str(REPO / "deploy"))
from local_cluster import LocalCluster  # noqa: E402

__all__ = ["REPO", "LocalCluster"]
