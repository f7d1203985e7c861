"""Background loads, vLLM-free: when they are chosen (inject/load_mode.py), the scheduler side's
bookkeeping (inject/background_requests.py) and the worker's writer (inject/background.py): on the
CPU as issued, its fused path under Triton's interpreter, and on a GPU (skipped without CUDA) on
its own stream, after the forward stream's earlier work."""

from __future__ import annotations

import collections
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.compose.rope import RotaryEmbedding
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
from inferscale.config import Config, Tuning
from inferscale.errors import ConfigError
from inferscale.inject.background import BackgroundWriter
from inferscale.inject.background_requests import BackgroundRequests
from inferscale.inject.load_mode import load_mode
from inferscale.inject.loader import LoadSpec, kv_head_range, load_blocks
from inferscale.inject.planner import Plan
from inferscale.inject.stats import ConnectorStats
from inferscale.inject.writer import KVWriter
from inferscale.storage.disk import DiskStore
from inferscale.storage.hbm import HBMStore
from inferscale.storage.pinned import PinnedHostStore
from inferscale.storage.tiers.fill import ensure_user
from inferscale.storage.tiers import Tiers
from test_storage import make_fact, make_facts
from test_writer import LAYERS, SIZE, RecordingCache, spec_for

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")


# ---------------------------------------------------------------- when loads go to the background

@pytest.mark.parametrize("mode, store, device, expected", [
    ("auto", "pinned", "cuda", True), ("auto", "disk", "cuda", True), ("auto", "my-plugin-tier", "cuda", True),
    ("auto", "hbm", "cuda", False), ("auto", "pinned", "cpu", False),
    ("always", "hbm", "cpu", True), ("never", "pinned", "cuda", False),
])
def test_auto_loads_in_the_background_what_crosses_the_bus(mode, store, device, expected):
    assert load_mode(mode, store, device).beside_batch(alone=False, tokens=1032) is expected


@pytest.mark.parametrize("mode, expected", [("auto", False), ("always", True), ("never", False)])
def test_auto_loads_a_lone_request_before_the_forward_pass(mode, expected):
    """With no batch to run beside, a background load would only cost the request its extra steps."""
    assert load_mode(mode, "pinned", "cuda").beside_batch(alone=True, tokens=1032) is expected


def test_auto_loads_a_step_s_first_requests_before_the_forward_pass_within_its_budget():
    """[tuning] before_forward_tokens: the loads of a step before its forward pass stop at the budget;
    the request that would pass it, and any after it, load beside the batch."""
    mode = load_mode("auto", "pinned", "cuda", before_forward_tokens=2064)
    assert mode.beside_batch(alone=False, tokens=1032, step_tokens=0) is False
    assert mode.beside_batch(alone=False, tokens=1032, step_tokens=1032) is False
    assert mode.beside_batch(alone=False, tokens=1032, step_tokens=2064) is True
    assert mode.beside_batch(alone=False, tokens=3000, step_tokens=0) is True  # larger than the budget alone
    assert mode.beside_batch(alone=True, tokens=3000, step_tokens=0) is False  # a lone request never waits
    # where "auto" keeps every load before the forward pass, and under "always" and "never", the budget is moot
    assert load_mode("auto", "hbm", "cuda", 0).beside_batch(alone=False, tokens=1, step_tokens=0) is False
    assert load_mode("always", "pinned", "cuda", 10**6).beside_batch(alone=False, tokens=1, step_tokens=0) is True
    assert load_mode("never", "pinned", "cuda", 0).beside_batch(alone=False, tokens=10**6, step_tokens=0) is False


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2000), st.booleans()), max_size=12), st.none() | st.integers(0, 4 << 20))
def test_a_step_issues_copies_within_the_bound_in_order_and_always_one(loads, at_most):
    """pinned_copy_above_mib beside the batch: the loads a step issues are ready ones, their copies
    within the bound unless it is the first one alone; a ready load left out would have passed it."""
    from inferscale.inject.background import issued_within

    tokens, ready = [n for n, _ in loads], [ok for _, ok in loads]
    taken = issued_within(tokens, 1024, ready, at_most)
    assert len(taken) == len(loads) and all(ok for ok, t in zip(ready, taken) if t)
    total = sum(n * 1024 for n, t in zip(tokens, taken) if t)
    assert at_most is None or total <= at_most or sum(taken) == 1
    assert issued_within([0, 5000], 1024, [True, True], 1) == [True, False]  # an empty load counts as one
    if any(ready):
        assert taken[ready.index(True)]  # the first ready load always goes
    for i, (ok, t) in enumerate(zip(ready, taken)):
        if ok and not t:
            before = sum(n * 1024 for n, t2 in zip(tokens[:i], taken[:i]) if t2)
            assert at_most is not None and any(taken[:i]) and before + tokens[i] * 1024 > at_most
    if at_most is None:
        assert taken == ready


def test_async_loads_takes_three_values():
    assert Tuning().async_loads == "auto"  # measured against "never" on a GPU
    assert Config(tuning={"async_loads": "always"}).tuning.async_loads == "always"
    with pytest.raises(ConfigError, match="async_loads must be one of auto, always, never, got 'sometimes'"):
        Tuning(async_loads="sometimes")


# ---------------------------------------------------------------- the scheduler side's bookkeeping

EVENTS = st.lists(st.tuples(st.sampled_from(["allocate", "send", "arrive", "finish"]), st.integers(0, 4)),
                  max_size=40)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_background_requests_are_tracked_exactly_and_forgotten(events):
    """Any order of vLLM's calls: a request is loading from the step its load is sent until it is
    reported; finishing it says whether its load was still in flight; nothing is kept once every
    request has been reported or finished."""
    book, allocated, loading, sent = BackgroundRequests(), {}, set(), []
    for kind, n in events:
        req_id = f"r{n}"
        if kind == "allocate":
            book.allocated(req_id, Plan(None), [n, n + 1])
            allocated[req_id] = [n, n + 1]
        elif kind == "send":
            sent = book.to_send()
            assert sorted((r, b) for r, _, b in sent) == sorted(allocated.items())
            loading |= set(allocated)
            allocated.clear()
        elif kind == "arrive":
            book.arrived([req_id])
            loading.discard(req_id)
        else:
            assert book.finished(req_id) is (req_id in loading)
            allocated.pop(req_id, None)
            loading.discard(req_id)
        assert len(book) == len(allocated) + len(loading)
        assert all(book.is_loading(r) for r in loading)
    for n in range(5):
        book.finished(f"r{n}")
    assert len(book) == 0 and book.to_send() == [] and book.waits_kept() == 0


def test_a_parked_request_says_how_many_schedules_it_waited():
    """vLLM's asynchronous scheduling: schedule N parks the request and sends its load, N + 1 is
    built before N's output (the report) is read, N + 2 runs it: reported 1 schedule after the
    parking one, run 2 after it; the seconds from the parking schedule to the running one."""
    now = [10.0]
    book = BackgroundRequests(clock=lambda: now[0])
    book.allocated("r", Plan(None), [3, 4])
    assert [req_id for req_id, _, _ in book.to_send()] == ["r"]  # schedule N
    assert book.scheduled(["other"]) == []
    book.step_built()
    book.step_built()  # N + 1, built before N's output was read
    now[0] = 10.04
    book.arrived(["r"])  # N's output
    now[0] = 10.05
    (wait,) = book.scheduled(["other", "r"])  # N + 2 runs it
    assert (wait.until_reported, wait.until_scheduled) == (1, 2) and wait.seconds == pytest.approx(0.05)
    book.step_built()
    assert book.scheduled(["r"]) == [] and book.waits_kept() == 0 and len(book) == 0


def test_a_request_finished_while_parked_leaves_no_wait_behind():
    book = BackgroundRequests()
    book.allocated("r", Plan(None), [1])
    book.to_send()
    book.step_built()
    book.arrived(["r"])
    assert book.waits_kept() == 1
    book.finished("r")
    assert book.waits_kept() == 0 and book.scheduled(["r"]) == []


# ---------------------------------------------------------------- the worker's writer, on the CPU

@pytest.fixture
def tiers(tmp_path) -> Tiers:
    return make_tiers(tmp_path, PinnedHostStore(PinnedHostStore.Options(device="cpu")))


def make_tiers(root: Path, memory) -> Tiers:
    disk = DiskStore(DiskStore.Options(root=str(root / "kv")))
    disk.put(SYSTEM_USER, {PREFIX_FACT: make_fact(5, layers=LAYERS, size=SIZE, seed=999)})
    disk.put("ann", make_facts(3, layers=LAYERS, size=SIZE))
    return Tiers(memory, disk)


def writers_for(tiers: Tiers, device: str = "cpu", **tuning) -> tuple[BackgroundWriter, KVWriter]:
    """A background writer and a synchronous one (copying host memory, as the background does)."""
    made = []
    for kind, options in ((BackgroundWriter, tuning), (KVWriter, {**tuning, "pinned_reads": "copy"})):
        rope = RotaryEmbedding(1.0 / (10_000 ** (torch.arange(0, SIZE, 2).float() / SIZE)), SIZE)
        writer = kind(Config(tuning=Tuning(**options)), tiers, rope, kv_head_range(2, 1, 0), SIZE, ConnectorStats())
        writer.register(LAYERS, torch.device(device), torch.float32)
        made.append(writer)
    return made[0], made[1]


def start(writer: BackgroundWriter, loads: list[LoadSpec], cache) -> None:
    """Issue ``loads`` as a step would, and again at the next step once their users are read."""
    writer.start(loads, cache)
    writer.fills.close()  # (waits for the reads the loads wait for)
    writer.start([], cache)


def test_a_background_load_is_reported_once_and_its_failure_with_it(tiers):
    writer, _ = writers_for(tiers)
    assert writer.config.tuning.pinned_reads == "copy" and not writer.loader.host_in_place  # the bus is DMA's
    good = spec_for(tiers.record, "ann", "good")
    stale = spec_for(tiers.record, "ann", "stale", epochs=("old", "old"))  # not the memory it was scheduled with
    cache = RecordingCache()
    start(writer, [stale, good], cache)
    assert writer.loading == {"stale", "good"}
    assert writer.take_load_errors() == set()  # a failure is told with its load's report, not before
    assert [layer for layer, *_ in cache.writes] == list(range(LAYERS))  # only the good one was written
    assert writer.finished() == {"stale", "good"}
    assert writer.take_load_errors() == set(stale.blocks)
    assert (writer.finished(), writer.take_load_errors(), writer.loading) == (set(), set(), set())


def test_a_load_that_waited_for_its_users_read_counts_as_the_store_of_records(tiers):
    """By the time it is issued the memory tier holds the user, but its K/V came from the store of
    record: the hit and the bytes are the disk's; a load of the user held is the memory tier's."""
    writer, _ = writers_for(tiers)
    start(writer, [spec_for(tiers.record, "ann", "cold")], RecordingCache())
    start(writer, [spec_for(tiers.record, "ann", "warm")], RecordingCache())
    counts = writer.stats.snapshot()
    assert (counts["store_hit.disk"], counts["store_hit.pinned"]) == (1, 1)
    assert counts["store_bytes.disk"] == tiers.record.nbytes("ann") and counts["store_bytes.pinned"] > 0
    assert counts["load_steps.beside_batch"] == 2  # a step issued each
    assert writer.finished() == {"cold", "warm"} and writer.take_load_errors() == set()


class SlowDisk(DiskStore):
    """The store of record, whose reads of a user's K/V wait until the test lets them go (a slow disk)."""

    def __init__(self, root: str):
        super().__init__(DiskStore.Options(root=root))
        self.go, self.reading = threading.Event(), threading.Event()

    def read_user(self, user_id):
        self.reading.set()
        assert self.go.wait(60), "the test never let the read go"
        return super().read_user(user_id)


class MeetingDisk(DiskStore):
    """The store of record, each of whose reads of a user's K/V other than the instruction prefix's
    waits until ``meet`` such reads are under way."""

    def __init__(self, root: str, meet: int):
        super().__init__(DiskStore.Options(root=root))
        self.meeting, self.reads = threading.Barrier(meet, timeout=60), collections.Counter()

    def read_user(self, user_id):
        if user_id != SYSTEM_USER:
            self.reads[user_id] += 1
            self.meeting.wait()  # broken (an error) unless `meet` users are read at once
        return super().read_user(user_id)


def test_users_are_read_several_at_once_each_once(tmp_path):
    """user_read_threads: three cold users' reads run at once (each waits for the other two), each
    user read once however many loads wait for it; every load is written after its user's read."""
    disk = MeetingDisk(str(tmp_path / "kv"), meet=3)
    disk.put(SYSTEM_USER, {PREFIX_FACT: make_fact(5, layers=LAYERS, size=SIZE, seed=999)})
    for user in ("ann", "bob", "cy"):
        disk.put(user, make_facts(2, layers=LAYERS, size=SIZE))
    memory = PinnedHostStore(PinnedHostStore.Options(device="cpu"))
    ensure_user(memory, disk, SYSTEM_USER)
    writer, _ = writers_for(Tiers(memory, disk), user_read_threads=3)
    cache = RecordingCache()
    writer.start([spec_for(disk, user, f"{user}-{n}") for n in range(2) for user in ("ann", "bob", "cy")], cache)
    writer.fills.close()
    writer.start([], cache)
    assert disk.reads == {"ann": 1, "bob": 1, "cy": 1} and not disk.meeting.broken
    assert len(cache.writes) == 6 * LAYERS and writer.take_load_errors() == set()
    assert writer.finished() == {f"{user}-{n}" for n in range(2) for user in ("ann", "bob", "cy")}


def test_a_load_waits_unissued_for_its_users_read_while_the_others_are_written(tmp_path):
    """A user the memory tier lacks is read on the fill thread: its load waits, unissued and not
    reported, while a load of a user the tier holds is written; it is written at the first step
    after the read."""
    disk = SlowDisk(str(tmp_path / "kv"))
    disk.put(SYSTEM_USER, {PREFIX_FACT: make_fact(5, layers=LAYERS, size=SIZE, seed=999)})
    disk.put("ann", make_facts(3, layers=LAYERS, size=SIZE))
    disk.put("bob", make_facts(2, layers=LAYERS, size=SIZE))
    memory = PinnedHostStore(PinnedHostStore.Options(device="cpu"))
    disk.go.set()
    for user in (SYSTEM_USER, "ann"):  # ann's memory is held; bob's is not
        ensure_user(memory, disk, user)
    disk.go.clear()
    writer, _ = writers_for(Tiers(memory, disk))
    cache = RecordingCache()
    writer.start([spec_for(disk, "bob", "cold"), spec_for(disk, "ann", "warm")], cache)
    assert disk.reading.wait(60)
    assert len(cache.writes) == LAYERS  # ann's load, written; bob's waits for its read
    for _ in range(3):  # steps go by: nothing of bob's is written or reported
        writer.start([], cache)
        assert writer.finished() <= {"warm"} and writer.loading <= {"cold", "warm"}
    assert "cold" in writer.loading and len(cache.writes) == LAYERS
    disk.go.set()
    writer.fills.close()
    writer.start([], cache)
    assert len(cache.writes) == 2 * LAYERS and writer.finished() == {"cold"}
    assert writer.loading == set() and writer.take_load_errors() == set()


def test_a_load_whose_request_finished_while_its_user_is_read_is_reported_unwritten(tmp_path):
    disk = SlowDisk(str(tmp_path / "kv"))
    disk.put(SYSTEM_USER, {PREFIX_FACT: make_fact(5, layers=LAYERS, size=SIZE, seed=999)})
    disk.put("bob", make_facts(2, layers=LAYERS, size=SIZE))
    writer, _ = writers_for(Tiers(PinnedHostStore(PinnedHostStore.Options(device="cpu")), disk))
    cache = RecordingCache()
    writer.start([spec_for(disk, "bob", "aborted")], cache)
    assert disk.reading.wait(60) and writer.loading == {"aborted"}
    writer.drop({"aborted", "some-other-request"})
    assert writer.finished() == {"aborted"} and writer.take_load_errors() == set() and writer.loading == set()
    disk.go.set()
    writer.fills.close()
    writer.start([], cache)
    assert cache.writes == [] and writer.finished() == set()


def test_a_load_is_reported_in_the_step_that_issues_it(tiers):
    """vLLM learns of a load in the step that issues it (on the CPU it is written by then; on a
    GPU the next step's forward stream waits for it: see below), never twice."""
    writer, _ = writers_for(tiers)
    start(writer, [spec_for(tiers.record, "ann", "a")], RecordingCache())  # (ann read into the memory tier)
    assert writer.finished() == {"a"}
    cache = RecordingCache()
    assert writer.step([spec_for(tiers.record, "ann", "b")], cache, set()) == {"b"}
    assert len(cache.writes) == LAYERS and writer.loading == set()
    writer.wait_before_forward()  # (nothing to wait for on the CPU)
    assert writer.step([], cache, set()) == set() and writer.take_load_errors() == set()


def test_a_refused_background_load_is_reported_with_every_block_failed(tiers):
    writer, _ = writers_for(tiers)
    spec = spec_for(tiers.record, "ann", "refused")
    writer.refuse([spec])
    assert writer.loading == {"refused"}
    assert writer.finished() == {"refused"} and writer.take_load_errors() == set(spec.blocks)


def test_a_background_load_writes_what_a_synchronous_one_writes(tiers):
    background, synchronous = writers_for(tiers)
    spec = spec_for(tiers.record, "ann")
    caches = RecordingCache(), RecordingCache()
    start(background, [spec], caches[0])
    synchronous.write_step([spec], caches[1])
    assert background.finished() == {"r"}
    for (layer, key, value, slots), (layer2, key2, value2, slots2) in zip(*(c.writes for c in caches), strict=True):
        assert layer == layer2 and torch.equal(key, key2) and torch.equal(value, value2) and torch.equal(slots, slots2)


def check_background_fused(tmp_path: str) -> None:
    """Two requests' background loads, written by the fused kernel (under Triton's interpreter),
    land at their slots as the per-layer path's K/V."""
    from inferscale.inject import fused_write, sources
    from test_writer import FlashAttentionCache

    assert fused_write.available() and sources.ready()
    tiers = make_tiers(Path(tmp_path), PinnedHostStore(PinnedHostStore.Options(device="cpu")))
    writer, _ = writers_for(tiers)
    first = spec_for(tiers.record, "ann")
    length = first.end
    specs = [LoadSpec("r", first.request, 0, length, length, load_blocks(range(length), 4, 0, length), 4, first.epochs),
             LoadSpec("s", first.request, 3, length, length, load_blocks(range(100, 200), 4, 3, length), 4,
                      first.epochs)]
    cache = FlashAttentionCache(200, 2, 4, SIZE)
    start(writer, specs, cache)
    assert writer.finished() == {"r", "s"} and writer.take_load_errors() == set()
    check_written(writer, specs, cache.layers)


def check_written(writer: KVWriter, specs: list[LoadSpec], layers) -> None:
    """Each spec's K/V (as the per-layer path computes it) lies at its slots of every layer."""
    for spec in specs:
        expected = writer.loader.load(spec, LAYERS, SIZE)
        slots = torch.from_numpy(spec.slots).to(layers[0][1].device)
        block_size = layers[0][1].shape[1]
        for layer, (_, key, value) in enumerate(layers):
            got_k, got_v = key[slots // block_size, slots % block_size], value[slots // block_size, slots % block_size]
            assert torch.allclose(got_k, expected.keys[layer], atol=1e-5), (spec.req_id, layer)
            assert torch.equal(got_v, expected.values[layer]), (spec.req_id, layer)


def test_the_fused_background_write_lands_where_the_per_layer_write_would(tmp_path):
    from test_fused_write import run_interpreted

    run_interpreted(f"import test_background_writer as t; t.check_background_fused({str(tmp_path)!r})")


# ---------------------------------------------------------------- on a GPU: its own stream

class CudaCache:
    """vLLM 0.26 FlashAttention's cache layout on the GPU, which the fused write addresses."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4):
        from test_fused_write import flash_attention_views

        self.layers = [flash_attention_views(num_blocks, 2, block_size, SIZE, torch.float32, "cuda")
                       for _ in range(LAYERS)]

    def views(self):
        return [(key, value) for _, key, value in self.layers]

    def write(self, layer, key, value, slots):
        _, key_cache, value_cache = self.layers[layer]
        size = key_cache.shape[1]
        key_cache[slots // size, slots % size] = key
        value_cache[slots // size, slots % size] = value


def gpu_specs(tiers: Tiers) -> list[LoadSpec]:
    first = spec_for(tiers.record, "ann")
    length = first.end
    return [LoadSpec("r", first.request, 0, length, length, load_blocks(range(length), 4, 0, length), 4, first.epochs),
            LoadSpec("s", first.request, 2, length, length, load_blocks(range(30, 64), 4, 2, length), 4, first.epochs)]


@CUDA
@pytest.mark.parametrize("tier", ["pinned", "hbm"])
@pytest.mark.parametrize("tuning", [{}, {"write_graphs": False}, {"fused_write": False}],
                         ids=["graphs", "launch", "per-layer"])
def test_a_background_load_writes_after_the_forward_streams_earlier_work(tmp_path, tier, tuning):
    """The forward stream is busy (a long sleep), then fills the whole cache: a background load
    issued after that must land after the fill (its writes wait for the forward stream's earlier
    work); once it has run and the next step began, the tensors it read are let go."""
    pytest.importorskip("triton")
    memory = PinnedHostStore() if tier == "pinned" else HBMStore()
    tiers = make_tiers(tmp_path, memory)
    writer, _ = writers_for(tiers, "cuda", **tuning)
    cache, specs = CudaCache(), gpu_specs(tiers)
    for _ in range(2):  # (the first use fills the memory tier from disk and captures graphs)
        torch.cuda._sleep(1 << 30)  # ~0.5 s of the forward stream
        for layer, _, _ in cache.layers:
            layer.fill_(7.0)
        start(writer, specs, cache)
        torch.cuda.synchronize()
        assert writer.finished() == {"r", "s"} and writer.take_load_errors() == set()
        check_written(writer, specs, cache.layers)
        writer.wait_before_forward()
        assert writer.loading == set() and writer._in_flight == writer._running == []


@CUDA
def test_background_loads_run_beside_the_step_that_issues_them_and_before_the_next(tmp_path):
    """With the fused write the loads are queued on the writer's stream: the forward stream of
    the step that issues them has nothing of theirs queued (an event recorded on it right after
    the issue completes while the load stream still waits for a sleep queued on it). They are
    reported at once, and the next step's forward stream waits for their writes: an event
    recorded on it after :meth:`wait_before_forward` completes only once they are in the cache."""
    pytest.importorskip("triton")
    tiers = make_tiers(tmp_path, PinnedHostStore())
    writer, _ = writers_for(tiers, "cuda")
    cache, specs = CudaCache(), gpu_specs(tiers)
    start(writer, specs, cache)  # (first use: the memory tier filled, graphs captured)
    torch.cuda.synchronize()
    writer.finished()
    load_stream = writer.layer_loads.stream
    with torch.cuda.stream(load_stream):
        torch.cuda._sleep(1 << 31)  # ~1 s of the load stream: the load queued behind it
    writer.start(specs, cache)
    forward_free = torch.cuda.Event()
    forward_free.record(torch.cuda.current_stream())
    forward_free.synchronize()  # returns at once if the forward stream holds none of the load's work
    assert writer.loading == {"r", "s"}
    assert writer.finished() == {"r", "s"} and writer.loading == set()  # reported before they ran
    writer.wait_before_forward()  # the next step
    next_forward = torch.cuda.Event()
    next_forward.record(torch.cuda.current_stream())
    assert not next_forward.query()  # behind the load, itself behind the sleep
    next_forward.synchronize()
    check_written(writer, specs, cache.layers)
    assert writer.finished() == set()


@CUDA
def test_a_steps_copies_of_host_memory_run_while_the_forward_stream_is_busy(tmp_path):
    """A synchronous step that copies a pinned store's facts to the GPU (pinned_reads = "copy")
    queues the copies on the copy stream, which waits for nothing: they complete while a sleep
    queued on the forward stream before the step still runs. The write waits for the sleep and the
    copies both, and lands intact."""
    pytest.importorskip("triton")
    tiers = make_tiers(tmp_path, PinnedHostStore())
    _, writer = writers_for(tiers, "cuda")
    cache, specs = CudaCache(), gpu_specs(tiers)
    writer.write_step(specs, cache)  # (first use: the memory tier filled, graphs captured)
    torch.cuda.synchronize()
    for layer, _, _ in cache.layers:
        layer.fill_(7.0)
    torch.cuda._sleep(1 << 30)  # ~0.5 s of the forward stream
    slept = torch.cuda.Event()
    slept.record(torch.cuda.current_stream())
    writer.write_step(specs, cache)
    copied = torch.cuda.Event()
    copied.record(writer.layer_loads.copies)
    copied.synchronize()
    assert not slept.query(), "the copies waited for the forward stream"
    torch.cuda.synchronize()
    check_written(writer, specs, cache.layers)
