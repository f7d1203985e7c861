"""The fused cache write on its own: GPU time by where the facts lie, against the copy floor.

For k facts of a Llama-3.1-8B K/V shape (32 layers, 8 KV heads, head size 128, bf16; a 32-token
prefix and 20-token facts), one launch of the fused write into a FlashAttention-layout cache:

* ``hbm``           — the facts' blocks in GPU memory;
* ``pinned direct`` — the blocks in pinned host memory, read in place by the kernel over the bus,
  every layer in one launch;
* ``pinned copy``   — one asynchronous copy per block to the GPU, then the kernel (``pinned_reads = "copy"``);
* ``pinned first group`` — the first of the launches ``pinned_reads = "overlap"`` splits the read
  into (the forward's first layer waits for it; the others run while the forward does);
* ``floor``         — one pinned host-to-device copy of the same bytes in one piece.

GPU times are CUDA events around the work (median of ``--reps``); the sources are built before
the window, except for ``pinned copy``, whose copies run while the host builds them. Host times:
building the sources (``HeldBlocks.of`` + ``segment_sources`` + the table copy; the connector keeps a
user's table, so it builds less) and one launch through Triton's JIT.

Then, at ``--contention-ks``, the in-place reads (``pinned_reads = "overlap"``) beside a forward
pass: a stand-in forward (per layer the four weight matmuls of Llama-3.1-8B for 16 tokens, about
14 GB of weights read per pass) timed alone, and again with the reads queued first on a side
stream, each layer of the forward waiting for its group's launch as the connector's
``wait_for_layer_load`` makes it wait: per kernel cap in ``--programs`` (programs per layer; 0: one
per token, ``Config.tuning.pinned_read_programs``) and number of launches in ``--launches``
(``Config.tuning.pinned_read_launches``). Reported: what the reads add to the forward (what TTFT would
see, host time aside), the forward's time beside the reads without waiting for them (how much the
reads slow its kernels), and the reads' own time alone and beside it. That table is also drawn
(the JSON's name, ``.png``); ``--plot RESULT.json`` draws it again from a saved result, no GPU needed.
Prints both tables, writes ``--out`` (JSON).

    python benchmarks/fused_write_speed.py --out benchmarks/results/fused_write_speed_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferscale.compose.rope import RotaryEmbedding  # noqa: E402
from inferscale.config import Tuning  # noqa: E402
from inferscale.inject.fused_write import CacheViews, write_tokens  # noqa: E402
from inferscale.inject.sources import Sources, segment_sources  # noqa: E402
from inferscale.inject.layer_loads import layer_groups  # noqa: E402
from inferscale.storage.blocks import HeldBlocks  # noqa: E402

LAYERS, HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16


def gpu_ms(work, reps: int) -> float:
    """Median GPU time of ``work()`` (CUDA events on the current stream), after one warm-up call."""
    work()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        work()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def host_ms(work, reps: int) -> float:
    """Median host time of ``work()``, the GPU drained between calls."""
    work()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        work()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


@dataclass
class Memory:
    """A prefix and k facts of random K/V in pinned host memory, the paged cache's blocks they go
    to (random ones, as a block table hands them out), the rotary table."""

    lengths: list[int]
    host: list[torch.Tensor]
    cache_blocks: list[int]
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def make(cls, k: int, args, rope: RotaryEmbedding) -> Memory:
        lengths = [args.prefix_tokens] + [args.fact_tokens] * k
        host = [torch.randn(2, LAYERS, n, HEADS, HEAD_SIZE).to(torch.bfloat16).pin_memory() for n in lengths]
        cache_blocks = torch.randperm(args.cache_blocks)[:-(-sum(lengths) // BLOCK)].tolist()
        return cls(lengths, host, cache_blocks, *rope.table(torch.device("cuda"), sum(lengths)))

    def sources(self, blocks: list[torch.Tensor]) -> Sources:
        """The fused write's sources of ``blocks`` (these facts, wherever they lie), table on the GPU."""
        return segment_sources(HeldBlocks.of(blocks[:1]), HeldBlocks.of(blocks[1:]), 0, sum(self.lengths),
                               self.cache_blocks, BLOCK)[0].to(torch.device("cuda"))


def row(k: int, args, cache: CacheViews, rope: RotaryEmbedding) -> dict:
    memory = Memory.make(k, args, rope)
    host, cos, sin, sources, total = memory.host, memory.cos, memory.sin, memory.sources, sum(memory.lengths)
    device = [b.cuda() for b in host]
    nbytes = sum(b.numel() * b.element_size() for b in host)

    def write(ready: Sources, layers: range | None = None) -> None:
        write_tokens(cache, ready, cos, sin, 0, HEAD_SIZE, True, layers)

    def copy_then_write() -> None:  # the copies run while the host builds the sources
        write(sources([b.to("cuda", non_blocking=True) for b in host]))

    in_hbm, in_host = sources(device), sources(host)  # built before the timed windows
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16).pin_memory()
    target = torch.empty_like(flat, device="cuda")
    out = {"k": k, "tokens": total, "mbytes": nbytes / 1e6,
           "hbm_ms": gpu_ms(lambda: write(in_hbm), args.reps),
           "pinned_direct_ms": gpu_ms(lambda: write(in_host), args.reps),
           "pinned_copy_ms": gpu_ms(copy_then_write, args.reps),
           # pinned_reads = "overlap": the first of the launches the forward's first layer waits for
           "pinned_first_group_ms": gpu_ms(lambda: write(in_host, layer_groups(LAYERS, Tuning.pinned_read_launches)[0]),
                                           args.reps),
           "floor_ms": gpu_ms(lambda: target.copy_(flat, non_blocking=True), args.reps)}
    out["host_sources_ms"] = host_ms(lambda: sources(device), args.reps)
    out["host_launch_ms"] = host_ms(lambda: write(in_hbm), args.reps)
    out["pinned_direct_vs_floor"] = out["pinned_direct_ms"] / out["floor_ms"]
    out["pinned_copy_vs_floor"] = out["pinned_copy_ms"] / out["floor_ms"]
    return out


def stand_in_forward(tokens: int = 16, hidden: int = 4096, qkv: int = 6144, mlp: int = 14336):
    """A callable ``forward(wait)`` that runs LAYERS layers of Llama-3.1-8B's weight matmuls for
    ``tokens`` tokens (what bounds a short prefill on a GPU: reading every weight once), calling
    ``wait(layer)`` before each layer's attention would run."""
    weights = [[torch.randn(hidden, n, dtype=torch.bfloat16, device="cuda") / 64 for n in (qkv, hidden, 2 * mlp)]
               + [torch.randn(mlp, hidden, dtype=torch.bfloat16, device="cuda") / 64] for _ in range(LAYERS)]
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")

    def forward(wait=lambda layer: None) -> None:
        h = x
        for layer, (w_qkv, w_o, w_up, w_down) in enumerate(weights):
            q = (h @ w_qkv)[:, :hidden]
            wait(layer)
            h = h + q @ w_o
            up = h @ w_up
            h = h + (torch.nn.functional.silu(up[:, :mlp]) * up[:, mlp:]) @ w_down
    return forward


def contention(k: int, args, cache: CacheViews, rope: RotaryEmbedding, forward) -> list[dict]:
    """The stand-in forward alone and beside the in-place reads of k facts, per kernel cap and
    number of launches."""
    memory = Memory.make(k, args, rope)
    cos, sin, sources = memory.cos, memory.sin, memory.sources(memory.host)
    side = torch.cuda.Stream()
    alone = gpu_ms(forward, args.reps)
    rows = []
    for launches in (int(n) for n in args.launches.split(",")):
        groups = layer_groups(LAYERS, launches)
        group_of = [g for g, group in enumerate(groups) for _ in group]
        for programs in (int(p) for p in args.programs.split(",")):
            def reads(which=groups, cap=programs or None) -> list[torch.cuda.Event]:
                done = []
                for group in which:
                    write_tokens(cache, sources, cos, sin, 0, HEAD_SIZE, True, group, cap)
                    done.append(torch.cuda.Event(enable_timing=True))
                    done[-1].record()
                return done

            def beside(waits: bool) -> tuple[float, float]:
                """ms of the forward and of the reads, the reads queued first on the side stream."""
                start, forward_start, forward_done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                torch.cuda.synchronize()
                start.record()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # queued first, as the connector does before the forward
                    done = reads()
                forward_start.record()
                stream = torch.cuda.current_stream()
                forward((lambda layer: stream.wait_event(done[group_of[layer]])) if waits else (lambda layer: None))
                forward_done.record()
                stream.wait_stream(side)
                torch.cuda.synchronize()
                return forward_start.elapsed_time(forward_done), start.elapsed_time(done[-1])

            timed = {waits: [beside(waits) for _ in range(args.reps + 1)][1:] for waits in (True, False)}
            row = {"k": k, "launches": len(groups), "programs": programs, "forward_alone_ms": alone,
                   "reads_alone_ms": gpu_ms(reads, args.reps),
                   "first_launch_alone_ms": gpu_ms(lambda: reads(groups[:1]), args.reps),
                   "forward_waiting_ms": statistics.median(t[0] for t in timed[True]),
                   "forward_beside_ms": statistics.median(t[0] for t in timed[False]),
                   "reads_beside_ms": statistics.median(t[1] for t in timed[False])}
            row["added_ms"] = row["forward_waiting_ms"] - alone
            rows.append(row)
    return rows


def plot(result: dict, path: Path) -> None:
    """What the in-place reads add to the forward, per cap and number of launches, one panel per k
    (the reads' own time alone, dotted, for scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    beside = result.get("beside_forward") or []
    ks = sorted({r["k"] for r in beside})
    if not ks:
        return
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 4), squeeze=False)
    for ax, k in zip(axes[0], ks):
        rows = [r for r in beside if r["k"] == k]
        caps = sorted({r["programs"] for r in rows})
        labels = [str(c) if c else "one per token" for c in caps]
        for n, launches in enumerate(sorted({r["launches"] for r in rows})):
            by_cap = {r["programs"]: r for r in rows if r["launches"] == launches}
            ax.plot(labels, [by_cap[c]["added_ms"] if c in by_cap else float("nan") for c in caps],
                    marker="o", color=f"C{n}", label=f"{launches} launches: added to the forward")
            ax.plot(labels, [by_cap[c]["reads_alone_ms"] if c in by_cap else float("nan") for c in caps],
                    linestyle=":", marker=".", color=f"C{n}", label=f"{launches} launches: reads alone")
        ax.set_title(f"k = {k}")
        ax.set_xlabel("programs per layer (Config.tuning.pinned_read_programs)")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"In-place reads of pinned host memory beside a forward pass, {result.get('device', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="1,10,50,100")
    parser.add_argument("--prefix-tokens", type=int, default=32)
    parser.add_argument("--fact-tokens", type=int, default=20)
    parser.add_argument("--cache-blocks", type=int, default=1024, help="paged cache blocks of 16 slots")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--contention-ks", default="50,100", help="ks of the forward-beside-reads table ('' skips it)")
    parser.add_argument("--programs", default="0,16,32,64,132",
                        help="kernel caps (programs per layer) to time beside the forward; 0: one per token")
    parser.add_argument("--launches", default="4,8", help="launches the reads are split into, beside the forward")
    parser.add_argument("--out", default="benchmarks/results/fused_write_speed.json")
    parser.add_argument("--plot", metavar="RESULT", help="only draw the second table of a saved result (to --out's "
                        "name, .png)")
    args = parser.parse_args(argv)
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.out).with_suffix(".png"))
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    # FlashAttention's layout: [blocks, heads, slots, 2 * head_size], K and V views into it
    caches = [torch.zeros(args.cache_blocks, HEADS, BLOCK, 2 * HEAD_SIZE, dtype=torch.bfloat16, device="cuda")
              for _ in range(LAYERS)]
    cache = CacheViews.of([tuple(c.transpose(1, 2).split(HEAD_SIZE, dim=-1)) for c in caches])
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_SIZE, 2, dtype=torch.float32) / HEAD_SIZE))
    rope = RotaryEmbedding(inv_freq, HEAD_SIZE)
    rows = [row(int(k), args, cache, rope) for k in args.ks.split(",")]
    print(f"fused write, Llama-3.1-8B K/V shape, {torch.cuda.get_device_name()}, median of {args.reps}")
    print("| k | MB | hbm ms | pinned direct ms (× floor) | pinned copy ms (× floor) | pinned first group ms | floor ms | "
          "host ms: sources, launch |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['k']} | {r['mbytes']:.0f} | {r['hbm_ms']:.3f} | {r['pinned_direct_ms']:.3f} "
              f"({r['pinned_direct_vs_floor']:.2f}) | {r['pinned_copy_ms']:.3f} ({r['pinned_copy_vs_floor']:.2f}) | "
              f"{r['pinned_first_group_ms']:.3f} | "
              f"{r['floor_ms']:.3f} | {r['host_sources_ms']:.3f}, {r['host_launch_ms']:.3f} |")
    result = {"device": torch.cuda.get_device_name(), "command": "python " + " ".join(sys.argv), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))  # kept should the second table fail
    beside = []
    if args.contention_ks:
        forward = stand_in_forward()
        beside = [r for k in args.contention_ks.split(",") for r in contention(int(k), args, cache, rope, forward)]
        print("\nthe in-place reads beside a stand-in forward (Llama-3.1-8B weight matmuls, 16 tokens), ms")
        print("| k | launches | programs per layer | forward alone | forward waiting per layer (added) | "
              "forward beside, not waiting | reads alone | reads beside | first launch alone |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in beside:
            print(f"| {r['k']} | {r['launches']} | {r['programs'] or 'one per token'} | {r['forward_alone_ms']:.3f} | "
                  f"{r['forward_waiting_ms']:.3f} ({r['added_ms']:+.3f}) | {r['forward_beside_ms']:.3f} | "
                  f"{r['reads_alone_ms']:.3f} | {r['reads_beside_ms']:.3f} | {r['first_launch_alone_ms']:.3f} |")
    result["beside_forward"] = beside
    Path(args.out).write_text(json.dumps(result, indent=1))
    plot(result, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
