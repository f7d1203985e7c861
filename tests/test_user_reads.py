"""benchmarks/user_reads.py on the CPU: users written to a disk store, read into a pinned tier by
each thread count (and by the fp8 NaN check as it was), a row each, the check restored after."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import user_reads  # noqa: E402

from inferscale import kv_fp8  # noqa: E402


def test_users_are_read_by_each_thread_count_and_the_check_as_it_was(tmp_path, capsys):
    check = kv_fp8.has_nan_code
    user_reads.main(["--shape", "smoke", "--users", "3", "--facts", "4", "--threads", "1,2", "--repeats", "1",
                     "--warm", "--out", str(tmp_path / "reads")])
    result = json.loads((tmp_path / "reads.json").read_text())
    systems = [(row["system"], row["page_cache"]) for row in result["rows"]]
    assert systems == [(name, cache) for name in ("1 thread", "2 threads", "1 thread, NaN check before")
                       for cache in ("cold", "warm")]
    assert all(row["users_per_s"] > 0 and len(row["seconds"]) == 1 for row in result["rows"])
    assert result["at_rest"] == "fp8_e4m3" and kv_fp8.has_nan_code is check
    assert "| 2 threads | warm |" in capsys.readouterr().out and (tmp_path / "reads.md").exists()


def test_the_check_as_it_was_finds_what_the_new_one_finds():
    import torch

    codes = torch.zeros(2, 3, dtype=torch.uint8)
    for byte, nan in ((0x7E, False), (0x7F, True), (0xFE, False), (0xFF, True)):
        codes[1, 2] = byte
        fp8 = codes.view(torch.float8_e4m3fn)
        assert user_reads.masked_nan_check(fp8) is kv_fp8.has_nan_code(fp8) is nan
