"""The 1,000-users load run (benchmarks/tier_users.py): its pure parts (budgets, Zipf popularity,
the counters per tier), and a small run on the smoke shape through real `vllm serve` engines, one
per memory tier, whose report must hold together: every request answered, every load counted in
exactly one tier, every fact the writer added listed afterwards. Not its speed."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import tier_rows  # noqa: E402


def test_stores_name_a_memory_tier_and_its_budget():
    assert tier_rows.parse_stores("pinned:30%, hbm:all") == [("pinned", "30%"), ("hbm", "all")]
    assert tier_rows.budget_bytes("30%", 1000, 10) == 3000
    assert tier_rows.budget_bytes("30%", 1000, 10, internal_bytes=7) == 3007  # the prefix is never evicted
    assert tier_rows.budget_bytes("all", 1000, 10, 7) >= 10 * 1000 + 7
    assert tier_rows.budget_bytes("default", 1, 1, tier="hbm") == 4 << 30
    assert tier_rows.budget_bytes("512MiB", 1, 1) == 512 << 20 and tier_rows.budget_bytes("1234", 1, 1) == 1234
    for bad in ("disk:30%", "pinned", "pinned:", "pinned:0%", "pinned:120%", "hbm:lots", ""):
        with pytest.raises(ValueError):
            tier_rows.parse_stores(bad)


@given(st.integers(1, 2000), st.floats(0.0, 3.0))
def test_the_popular_users_share_grows_to_every_request(users, s):
    popularity = tier_rows.Popularity([f"user{u}" for u in range(users)], s)
    shares = [popularity.share(top) for top in range(users + 1)]
    assert shares[0] == 0.0 and shares[-1] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(shares, shares[1:]))
    assert popularity.share(users + 5) == shares[-1]
    if s == 0:
        assert shares[1] == pytest.approx(1 / users)


class Fixed(random.Random):
    def __init__(self, value: float):
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def test_a_draw_follows_the_popularity_order():
    popularity = tier_rows.Popularity(["a", "b", "c"], 1.0)  # weights 1, 1/2, 1/3 of 11/6
    assert [popularity.draw(Fixed(v)) for v in (0.0, 0.5, 0.545, 0.55, 0.9, 0.9999)] == ["a", "a", "a", "b", "c", "c"]
    rng = random.Random(1)
    drawn = [popularity.draw(rng) for _ in range(6000)]
    assert drawn.count("a") > drawn.count("b") > drawn.count("c") > 0


def test_each_tiers_share_of_the_loads_and_its_bytes_per_second():
    runs = [{"seconds": 2.0, "connector": {"store_hits_total{tier=disk}": 1.0, "store_hits_total{tier=pinned}": 3.0,
                                           "store_bytes_total{tier=disk}": 400.0, "injected_requests_total": 4.0,
                                           "fallbacks_total{reason=refused}": 1.0}},
            {"seconds": 2.0, "connector": {"store_hits_total{tier=pinned}": 4.0, "store_bytes_total{tier=pinned}": 80.0,
                                           "injected_requests_total": 4.0}}]
    totals = tier_rows.tier_totals(runs)
    assert totals["hits"] == {"disk": 1.0, "pinned": 7.0} and totals["loads"] == totals["injected"] == 8.0
    assert totals["hit_rate"] == {"disk": 0.125, "pinned": 0.875}
    assert totals["bytes_per_s"] == {"disk": 100.0, "pinned": 20.0} and totals["fallbacks"] == {"refused": 1.0}
    assert tier_rows.counter_delta({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 5.0, "c": 1.0}) == {"b": 3.0, "c": 1.0}


def test_the_gpu_run_is_1000_zipf_users_at_100_clients_on_the_default_store_and_every_user_in_hbm():
    import tier_users

    args = tier_users.parse_args(["--gpu", "--out", "x"])
    assert (args.shape, args.cuda_graphs, args.kv_dtype_at_rest) == ("qwen2.5-7b", True, "fp8_e4m3")
    assert (args.users, args.zipf, args.concurrency, args.k) == (1000, 1.1, 100, 50) and args.writes_per_s > 0
    assert args.store_list == [("pinned", "default"), ("hbm", "all")] and args.systems[0] == "prompt"
    assert args.data == "/tmp/tier_users_data"  # kept: a second run reads the users back
    given = tier_users.parse_args(["--gpu", "--users", "30", "--stores", "hbm:10%", "--data", "/elsewhere"])
    assert (given.users, given.store_list, given.data, given.cuda_graphs) == (30, [("hbm", "10%")], "/elsewhere", True)
    assert not tier_users.parse_args([]).cuda_graphs  # the switches only with --gpu
    with pytest.raises(SystemExit):
        tier_users.parse_args(["--gpu", "--k", "70"])  # more facts a request than a user has


#: the smallest run that still misses the memory tier: 20 users of 6 facts, a pinned tier of 30 % of
#: them and an HBM tier of all (on a CPU both in host memory), a writer at 4 writes a second
SMOKE = ["--shape", "smoke", "--users", "20", "--facts", "6", "--k", "3", "--concurrency", "4", "--clients", "1",
         "--seconds", "3", "--repeats", "1", "--warmup-seconds", "1", "--probes", "1", "--writes-per-s", "4",
         "--budgets", "0", "--stores", "pinned:30%,hbm:all"]


@pytest.mark.slow
def test_a_small_run_answers_every_request_counts_every_load_once_and_loses_no_fact(tmp_path):
    from inferscale.storage.disk import DiskStore

    data, out = tmp_path / "data", tmp_path / "tiers"
    run = subprocess.run([sys.executable, "benchmarks/tier_users.py", *SMOKE, "--data", str(data), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["checks"] == {"failed_requests": 0, "write_errors": 0, "lost_facts": 0,
                                "loads_equal_injected": True, "ok": True}
    stores = {store["store"]: store for store in result["stores"]}
    assert list(stores) == ["pinned:30%", "hbm:all"]
    assert 1 <= stores["pinned:30%"]["holds_users"] < 20 == stores["hbm:all"]["holds_users"]
    assert stores["hbm:all"]["warm_up"] == {"users": 20, "failed": 0, "errors": []}  # every user asked for once
    assert {(row["store"], row["system"]) for row in result["rows"]} == {
        (store, system) for store in stores for system in ("prompt", "kv@0")}
    for row in result["rows"]:
        tiers = row["tiers"]
        assert row["failed"] == 0 and row["requests"] > 0 and row["writes"] > 0
        if row["system"] == "prompt":
            assert tiers["loads"] == tiers["injected"] == 0 and "x_hbm" not in row
            continue
        # every load counted once, in the memory tier or the store of record, with the bytes it read there
        assert set(tiers["hits"]) <= {row["store"].partition(":")[0], "disk"}
        assert sum(tiers["hits"].values()) == tiers["loads"] == tiers["injected"] > 0
        assert sum(tiers["hit_rate"].values()) == pytest.approx(1.0)
        assert set(tiers["bytes"]) == set(tiers["hits"]) and min(tiers["bytes"].values()) > 0
        assert tiers["injected"] + sum(tiers["fallbacks"].values()) <= row["requests"]
        assert row["x_hbm"] == 1.0 if row["store"] == "hbm:all" else row["x_hbm"] > 0
    for name, store in stores.items():
        cold, tier = store["cold_user"], name.partition(":")[0]
        assert {kind: got["tiers"] for kind, got in cold.items()} == {
            "disk": {"disk": 1.0}, "memory": {tier: 1.0}, "prompt": {}, "page_cache": {"disk": 1.0}}
        assert all(got["n"] == 1 and got["failed"] == 0 and got["ttft_ms"] > 0 for got in cold.values())
    writes = result["writes"]
    assert writes["writes"] == writes["facts"] > 0 and writes["lost"] == writes["errors"] == 0
    disk = DiskStore(DiskStore.Options(root=str(data / "kv")))
    for user, facts in writes["added"].items():  # looked up again, apart from the run's own check
        assert set(facts) <= set(disk.list(user)), user
    report = out.with_suffix(".md").read_text()
    assert "| memory tier (budget) |" in report and "pinned:30%" in report and "hbm:all" in report
