"""Worker side, vLLM-free: loads that complete beside the batch (``Config.tuning.async_loads``).

A background load belongs to a request that vLLM keeps out of the batch (``WAITING_FOR_REMOTE_KVS``)
until the worker says its K/V has arrived (:mod:`~inferscale.inject.load_mode`).
:class:`BackgroundWriter` is :class:`~inferscale.inject.writer.KVWriter`'s write path, issued
elsewhere:

* on a GPU, with the fused write: on a CUDA stream of its own. The facts' blocks are copied from
  pinned host memory to the GPU first (one DMA per run of facts back to back in the user's
  buffer, on the copy engines: no SM waits on the bus); then the stream waits for the work the
  forward stream had queued when the load was issued (the request's blocks were free a step ago:
  an earlier step may still read or zero them); then one kernel rotates the keys and writes every
  layer into the request's blocks; then an event. The forward pass of the step that issues it
  never waits for any of it. One stream for all loads: a load's copies start once the loads
  issued before it have been written.
* where the fused write cannot run (the CPU, a cache it cannot address): as a synchronous load is
  written, on the forward stream (on the CPU it is done when the call returns).

A step issues copies of at most ``Config.tuning.pinned_copy_above_mib`` (and always one load); the
loads past it wait, unissued, for the next step (a burst of requests would otherwise take one GPU
buffer of all their facts, beside the memory vLLM sized its cache from).
A load whose user the memory tier does not hold waits, unissued, while the user is read from the
store of record on threads of their own (:mod:`~inferscale.inject.user_fills`); the engine's thread
goes on with the batch.

A load is reported (:meth:`BackgroundWriter.finished`) in the step that issues it, its writes
still queued: from the next step on vLLM may schedule the request, or, when it was aborted, free
its blocks and hand them to another request. Both happen on the forward stream, and the next
step's forward stream first waits for the writes of every load reported
(:meth:`BackgroundWriter.wait_before_forward`, called where the step starts loading), so that no
work of a later step reaches those blocks before the K/V is in them, while the host never waits.
Waiting on the host for the writes to complete before reporting (checking their events at the
next step) cost a request at least one engine step more, and vLLM's asynchronous scheduling
learns of a report a step late already. A load that waits for its user's read is reported only
once issued; one whose request finished meanwhile is dropped and reported unwritten. A load that
failed is reported too, in the same pass as its blocks (:meth:`BackgroundWriter.take_load_errors`),
so that vLLM recomputes them or ends the request (``kv_load_failure_policy``). The tensors a load
reads are kept until its event has completed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from inferscale.config import Config
from inferscale.inject.loader import LoadSpec
from inferscale.inject.sources import Sources
from inferscale.inject.user_fills import UserFills
from inferscale.inject.writer import KVWriter, PagedCache


@dataclass
class InFlight:
    """The loads issued in one step: their requests, the cache blocks of those that failed, the
    event after their writes (None: done when issued) and the tensors the writes read."""

    req_ids: tuple[str, ...]
    errors: set[int]
    done: torch.cuda.Event | None
    keep: list

    def arrived(self) -> bool:
        return self.done is None or self.done.query()


class LoadStream:
    """The stream background loads run on; what :class:`KVWriter` sees as its layer loads while it
    issues them (nothing waits per layer: the tensors each write reads are kept instead)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._forward: torch.cuda.Event | None = None  # the forward stream's work when the issue began
        self._keep: list = []

    @contextlib.contextmanager
    def issuing(self, beside: bool) -> Iterator[None]:
        """Queue the work inside on the load stream (``beside``), else on the current stream."""
        self._keep, self._forward = [], None
        if self.stream is None or not beside:
            yield
            return
        self._forward = torch.cuda.Event()
        self._forward.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def writes_follow_forward(self) -> None:
        """The work queued next on the load stream waits for what the forward stream had queued
        when the issue began (the reads queued before it do not)."""
        if self._forward is not None:
            self.stream.wait_event(self._forward)

    def issued(self) -> tuple[torch.cuda.Event | None, list]:
        """An event after everything issued (None on the CPU: it has run) and the tensors it reads."""
        keep, self._keep = self._keep, []
        if self.device.type != "cuda":
            return None, keep
        done = torch.cuda.Event()
        done.record(self.stream if self._forward is not None else torch.cuda.current_stream(self.device))
        return done, keep

    # KVWriter's calls while it issues (LayerLoads' interface)

    def copying(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # (the copies run first on the load stream already)

    def layer_queued(self, index: int) -> None:
        return None

    def all_queued(self, keep: list, done: torch.cuda.Event | None = None) -> None:
        self._keep.extend(keep)

    def group_queued(self, layers: range, keep: list | None = None, event: torch.cuda.Event | None = None) -> None:
        self._keep.extend(keep or ())

    def is_pending(self, index: int) -> bool:
        return False

    def wait_layer(self, index: int) -> None:
        return None

    def wait_all(self) -> None:
        return None


def copying(config: Config) -> Config:
    """``config`` with host memory copied to the GPU by DMA (``pinned_reads = "copy"``): an
    in-place read would hold SMs beside the forward pass for as long as the bus takes."""
    return dataclasses.replace(config, tuning=dataclasses.replace(config.tuning, pinned_reads="copy"))


class BackgroundWriter(KVWriter):
    """Issues background loads (:meth:`start`) and tells which have arrived (:meth:`finished`)."""

    pins_tables = True  # the load stream waits for the forward pass before each write

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(copying(config), *args, **kwargs)
        self.fills = UserFills(self.tiers, config.tuning.user_read_threads)
        self._waiting: list[tuple[LoadSpec, list[concurrent.futures.Future]]] = []  # for their users' reads
        self._read_first: set[str] = set()  # requests whose loads waited for a read of the store of record
        self._in_flight: list[InFlight] = []  # issued (or dropped, refused), not reported yet
        self._running: list[InFlight] = []  # reported, their writes perhaps still queued (their tensors kept)
        self._unwaited: list[torch.cuda.Event] = []  # writes reported that the forward stream does not wait for yet
        self._arrived_errors: set[int] = set()

    def register(self, num_layers: int, device: torch.device, dtype: torch.dtype) -> None:
        super().register(num_layers, device, dtype)
        self.layer_loads = LoadStream(device)

    def step(self, loads: Sequence[LoadSpec], cache: PagedCache | None, finished_req_ids: set[str]) -> set[str]:
        """One engine step's work, after its forward pass was launched: ``loads`` issued, with those
        of earlier steps whose users have been read since (:meth:`start`), or refused where
        ``cache`` is None (its layout was not understood); the loads of requests that finished
        while they waited for their users' reads dropped (:meth:`drop`); then the requests of
        every load issued, refused or dropped (:meth:`finished`)."""
        self.drop(finished_req_ids)
        if cache is None:
            self.refuse(loads)
        else:
            self.start(loads, cache)
        return self.finished()

    def start(self, loads: Sequence[LoadSpec], cache: PagedCache) -> None:
        """Issue ``loads``, and the loads of earlier steps whose users have been read since; a load
        whose user the memory tier lacks waits for its read (see the module). Each is reported by
        a later :meth:`finished`. Called every step, with or without loads of its own."""
        if self.loader is None:
            raise RuntimeError("KV caches were never registered with the connector")
        for spec in loads:
            reads = self.fills.reads(spec)
            self._waiting.append((spec, reads))
            if reads:
                self._read_first.add(spec.req_id)
        done = [all(read.done() for read in reads) for _, reads in self._waiting]
        if self.loader.copies_from_host(in_place=False):  # a step's copies take GPU buffers: bounded
            token_bytes = self.loader.token_bytes(self.num_layers, self.head_size)
            done = issued_within([spec.end - spec.start for spec, _ in self._waiting], token_bytes, done,
                                 self.loader.copy_at_most)
        ready = [spec for (spec, _), ok in zip(self._waiting, done) if ok]
        self._waiting = [waiting for waiting, ok in zip(self._waiting, done) if not ok]
        if ready:
            self._issue(ready, cache)

    def _issue(self, loads: Sequence[LoadSpec], cache: PagedCache) -> None:
        began = time.perf_counter()
        fused = self._fused_views(cache) is not None
        self._count_step("beside_batch")
        with self.layer_loads.issuing(beside=fused):
            if fused:
                self._write_fused(loads, in_place=False)
            else:
                self._write(cache, self._prepare(loads))
        done, keep = self.layer_loads.issued()
        self._in_flight.append(InFlight(_ids(loads), KVWriter.take_load_errors(self), done, keep))
        self._read_first.difference_update(_ids(loads))
        self._host_time("load", time.perf_counter() - began)

    def drop(self, finished_req_ids: set[str]) -> None:
        """Loads still waiting, unissued, for their users' reads whose requests have finished (were
        aborted): reported at the next :meth:`finished` with nothing written (no copy is in flight
        into their blocks, which vLLM then frees)."""
        dropped = [spec for spec, _ in self._waiting if spec.req_id in finished_req_ids]
        if dropped:
            self._waiting = [waiting for waiting in self._waiting if waiting[0].req_id not in finished_req_ids]
            self._read_first.difference_update(_ids(dropped))
            self._in_flight.append(InFlight(_ids(dropped), set(), None, []))

    def refuse(self, loads: Sequence[LoadSpec]) -> None:
        """Write none of ``loads`` (the caches' layout is not understood): reported at the next
        :meth:`finished`, every block failed."""
        if loads:
            self._in_flight.append(InFlight(_ids(loads), {block for spec in loads for block in spec.blocks}, None, []))

    def finished(self) -> set[str]:
        """The requests whose loads were issued (or failed, were refused or dropped) since the last
        call, their writes perhaps still queued: work queued on the forward stream after
        :meth:`wait_before_forward` finds them done. The blocks of those that failed are
        :meth:`take_load_errors`' from now on."""
        reported, self._in_flight = self._in_flight, []
        for load in reported:
            self._arrived_errors |= load.errors
            if load.done is not None:
                self._unwaited.append(load.done)
                self._running.append(load)
        return {req_id for load in reported for req_id in load.req_ids}

    def wait_before_forward(self) -> None:
        """Make the current (forward) stream wait for the writes of every load reported since the
        last call (no host wait), before the step's own work: its requests may be scheduled, or
        its blocks handed to others, from here on. The tensors of loads whose writes have run are
        let go."""
        if self._unwaited:
            stream = torch.cuda.current_stream(self.layer_loads.device)
            for event in self._unwaited:
                stream.wait_event(event)
            self._unwaited = []
        if self._running:
            self._running = [load for load in self._running if not load.arrived()]

    def take_load_errors(self) -> set[int]:
        """The cache blocks of the failed loads :meth:`finished` has reported since the last call."""
        errors, self._arrived_errors = self._arrived_errors, set()
        return errors

    @property
    def loading(self) -> set[str]:
        """The requests whose loads are waiting for their users' reads, or issued and not reported yet."""
        issued = {req_id for load in self._in_flight for req_id in load.req_ids}
        return issued | {spec.req_id for spec, _ in self._waiting}

    def wait(self) -> None:
        """Block until every load issued has run and every read has ended (the engine is shutting down)."""
        self.fills.close()
        for load in self._in_flight + self._running:
            if load.done is not None:
                load.done.synchronize()

    def _tier(self, spec: LoadSpec) -> str:
        """A load that waited for its user's read counts as the store of record's (the memory
        tier holds the user by the time it is issued)."""
        return self.tiers.record.name if spec.req_id in self._read_first else super()._tier(spec)

    def _launch_fused(self, sources: Sources, cos: torch.Tensor, sin: torch.Tensor):
        """The fused write, queued after the copies and after the forward stream's earlier work."""
        self.layer_loads.writes_follow_forward()
        return super()._launch_fused(sources, cos, sin)


def issued_within(tokens: Sequence[int], token_bytes: int, ready: Sequence[bool], at_most: int | None) -> list[bool]:
    """Which of the ready loads (``tokens`` each, in order) a step issues: in order, while their copies
    come to at most ``at_most`` bytes (``Config.tuning.pinned_copy_above_mib``), and always the first
    ready one; the others wait for the next step, so that a burst of requests never takes one GPU
    buffer of all their facts."""
    taken, total = [], 0
    for count, ok in zip(tokens, ready):
        nbytes = count * token_bytes
        ok = ok and (at_most is None or not any(taken) or total + nbytes <= at_most)
        total += nbytes if ok else 0
        taken.append(ok)
    return taken


def _ids(loads: Sequence[LoadSpec]) -> tuple[str, ...]:
    return tuple(spec.req_id for spec in loads)
