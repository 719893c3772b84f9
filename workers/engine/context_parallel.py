"""One rank of context-parallel decoding: the whole model, and a contiguous range of each sharded
request's pages.

    rank = ShardEngine(engine)                          # the Engine's model, KV manager and page ids
    rank.open(ShardSpec(...), group, params, seed)      # reserve this rank's pages of a request
    rank.fill_synthetic(rid, num_tokens, seed)          # benchmarks; or, chunk by chunk:
    token = rank.prefill(rid, start, token_ids, sample) # every rank runs every chunk
    token = rank.decode(rid, token, position)           # every rank runs every token; rank 0 samples
    report = rank.close(rid)

A request sharded over R ranks: rank r owns the sequence's pages [first_page, first_page +
num_pages); rank 0 holds the sink page, rank R-1 the page of the first new token and every page
after it, so every new token's K/V goes to the last rank. Every rank runs every token through the
whole model (the ranks' hidden states stay equal: attention is merged in rank order); each writes
and summarises only its own pages, scores only its own summaries and attends only its own pages
(cp_attention.py). A coordinator (lockserve.cluster.context_parallel) calls every rank of a
request for each step, in the same order on all of them.

The rank reuses an `Engine` for the model, the KV manager (tier, write pool, hot-page cache,
summaries) and the page-id allocator; it does not use the Engine's scheduler loop. Tier host+nvme
reads spilled pages on the host, layer by layer (KVManager.synchronous_reads): a rerun of a step
on one rank alone would desynchronise the group's collectives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .attention import PrefillMeta, pid_tensor
from .cp_attention import ShardAttention, ShardPrefill, ShardRows, ShardStep
from .cp_group import RankGroup
from .engine import Engine
from .graphs import GraphKey, KeyedGraphs
from .sampling import SamplingParams, make_generator, sample
from .scheduler import Chunk
from .uploads import upload


@dataclass(frozen=True)
class ShardSpec:
    """A rank's part of one sharded request (plain data: the coordinator sends it).

    rank, size: its place in the request's group; first_page, num_pages: its contiguous range of
    the sequence's pages; total_pages: the request's pages (prompt + max_tokens); budget_pages:
    the LOCKS page budget (None = every page)."""

    request_id: str
    rank: int
    size: int
    first_page: int
    num_pages: int
    total_pages: int
    budget_pages: int | None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank ({self.rank}) must be in [0, size ({self.size}))")
        if self.num_pages < 1 or self.first_page < 0 or self.first_page + self.num_pages > self.total_pages:
            raise ValueError(f"pages [{self.first_page}, {self.first_page + self.num_pages}) must be a "
                             f"non-empty range of the request's {self.total_pages} pages")
        last = self.rank == self.size - 1
        if last != (self.first_page + self.num_pages == self.total_pages):
            end = self.first_page + self.num_pages
            raise ValueError(f"rank {self.rank} of {self.size}: only the last rank holds the request's last "
                             f"page ({self.total_pages - 1}); this one ends at {end}")

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


@dataclass
class ShardPages:
    """What KVManager.plan / commit / release read of a sequence: its id and this rank's page ids."""

    request_id: str
    pids: list[int]
    pid_tensor: torch.Tensor | None = None


META = ("first_page", "count", "num_settled", "num_pages", "budget", "tail_len", "tail_loc", "write_off",
        "token", "position")  # a decode step's inputs, in DecodeBuffers.meta order


@dataclass
class DecodeBuffers:
    """A shard's decode inputs at fixed addresses, as a captured graph reads them: meta [len(META)]
    int64 on the device (one upload and one copy per step), no_write [1] = -1 (the write location
    of ranks that do not own the token's page); graphs: the decode forwards captured over these
    buffers, by (GraphKey, owned), each returning hidden [1, hidden] and noting the collectives one
    replay issues (calls, bytes sent: counted at capture, as a replay runs no Python)."""

    meta: torch.Tensor
    no_write: torch.Tensor
    graphs: KeyedGraphs

    @classmethod
    def allocate(cls, device: torch.device, pool) -> DecodeBuffers:
        meta = torch.zeros(len(META), dtype=torch.int64, device=device)
        return cls(meta, torch.full((1,), -1, dtype=torch.int64, device=device), KeyedGraphs(pool))

    def field(self, name: str) -> torch.Tensor:
        i = META.index(name)
        return self.meta[i : i + 1]


@dataclass
class Shard:
    """A request's state on one rank. computed: tokens of the sequence whose K/V are in the cache
    (all ranks count the whole sequence). trace: decode layers' selections when recording."""

    spec: ShardSpec
    pages: ShardPages
    group: RankGroup
    page_table: torch.Tensor  # [1, num_pages] int32, this rank's page ids
    sampler: tuple[SamplingParams, torch.Generator] | None
    computed: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    trace: list | None = None
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)
    buffers: DecodeBuffers | None = None


def fails_fast(step):
    """A step that raises on this rank drops the request's group first: the other ranks' collectives
    then fail at once (their peer's sockets close) instead of after the group's timeout."""

    @functools.wraps(step)
    def guarded(self, request_id: str, *args):
        try:
            return step(self, request_id, *args)
        except BaseException:
            shard = self.shards.get(request_id)
            if shard is not None:
                shard.group.close()
            raise

    return guarded


class ShardEngine:
    """The rank (see the module docstring). engine: an Engine built for this rank's capacity (its
    max_num_seqs bounds the requests it holds at once); its tokenizer and scheduler loop go unused."""

    def __init__(self, engine: Engine, use_graphs: bool = False):
        cc = engine.cache_config
        # NOTE: ranks merge each head's softmax normaliser over LOCKS summaries' scores (Eq. 5); other
        # page selectors and group rules have tables or normalisers that do not merge this way.
        if cc.attention not in ("locks", "dense") or getattr(engine.attention, "selector", None) is not None:
            raise ValueError(f"cache.attention ({cc.attention!r}) with context parallelism: ranks select "
                             "pages with LOCKS summaries and the share-average (or attend all: dense)")
        self.engine, self.kv, self.model = engine, engine.kv, engine.model
        self.device, self.page_size = engine.device, engine.kv.layout.page_size
        self.attention = ShardAttention(engine.kv, cc.sink_pages, cc.recent_pages, engine.attention.backend,
                                        engine.attention.radix_bits)  # the ranks select as the engine would
        self.allocator = engine.scheduler.allocator
        self.max_requests = engine.scheduler_config.max_num_seqs
        self.shards: dict[str, Shard] = {}
        self.totals = {"decode_steps": 0, "prefill_chunks": 0, "decode_collectives": 0,
                       "decode_collective_s": 0.0, "decode_collective_bytes": 0, "graph_replays": 0,
                       "graph_captures": 0}
        # use_graphs: decode steps replayed from CUDA graphs, collectives included (NCCL captures
        # them); host+nvme promotes on the host layer by layer, which a graph cannot do.
        if use_graphs and (engine.device.type != "cuda" or cc.tier == "host+nvme"):
            raise ValueError(f"use_graphs (True) needs a CUDA device and tier hbm or host, not "
                             f"{engine.device.type} and {cc.tier!r}")
        self.use_graphs = use_graphs
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None

    @property
    def free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def capacity_pages(self) -> int:
        return self.allocator.capacity

    # ---- requests -------------------------------------------------------------------------------

    def open(self, spec: ShardSpec, group: RankGroup, params: SamplingParams | None = None, seed: int = 0,
             trace: bool = False) -> None:
        """Reserve this rank's pages of a request. params: the sampling of the request (used on rank 0,
        which samples); seed: seeds its generator when params has none. Raises ValueError for an id in
        use or a group that does not match the spec, RuntimeError when the pages are not free."""
        if spec.request_id in self.shards:
            raise ValueError(f"request_id ({spec.request_id!r}) is already open on this rank")
        if (group.rank, group.size) != (spec.rank, spec.size):
            raise ValueError(f"group rank {group.rank} of {group.size} does not match the spec's "
                             f"{spec.rank} of {spec.size}")
        if len(self.shards) >= self.max_requests:
            raise RuntimeError(f"this rank holds {len(self.shards)} requests already "
                               f"(max {self.max_requests})")
        pids = self.allocator.allocate(spec.num_pages)
        sampler = None
        if spec.rank == 0:
            params = SamplingParams.coerce(params)
            sampler = (params, make_generator(params, self.device, torch.Generator().manual_seed(seed)))
        table = upload(pids, dtype=torch.int32, device=self.device)[None, :]
        self.shards[spec.request_id] = Shard(spec, ShardPages(spec.request_id, pids), group, table, sampler,
                                             trace=[] if trace else None,
                                             buffers=DecodeBuffers.allocate(self.device, self._pool))

    def close(self, request_id: str) -> dict[str, Any] | None:
        """Free a request's pages on this rank and drop its group. Returns its report (steps, decode
        collectives, the trace when recorded), None for an unknown id."""
        shard = self.shards.pop(request_id, None)
        if shard is None:
            return None
        try:
            settled = max(0, min(shard.computed - shard.spec.first_page * self.page_size,
                                 shard.spec.num_pages * self.page_size)) // self.page_size
            self.kv.release(request_id, shard.pages.pids, settled)
        finally:
            self.allocator.free(shard.pages.pids)
            self._account(shard)
            shard.group.close()
        return {"rank": shard.spec.rank, "decode_steps": shard.decode_steps,
                "prefill_chunks": shard.prefill_chunks, "collectives": shard.collectives,
                "trace": shard.trace}

    def _account(self, shard: Shard) -> None:
        shard.collectives = collective_report(shard.group)
        decode = shard.collectives["decode"]
        self.totals["decode_steps"] += shard.decode_steps
        self.totals["prefill_chunks"] += shard.prefill_chunks
        self.totals["decode_collectives"] += decode["calls"]
        self.totals["decode_collective_s"] += decode["seconds"]
        self.totals["decode_collective_bytes"] += decode["bytes"]

    # ---- steps ----------------------------------------------------------------------------------

    @fails_fast
    def fill_synthetic(self, request_id: str, num_tokens: int, seed: int = 0) -> None:
        """Benchmarks and tests: random K/V for the sequence's first num_tokens tokens, this rank's
        pages of them only (KVManager.fill_random by the sequence's page index, so the ranks together
        hold exactly the cache one engine's fill_synthetic makes), in place of prefill."""
        shard = self._shard(request_id, 0)
        spec, b = shard.spec, self.page_size
        local = min(max(num_tokens - spec.first_page * b, 0), spec.num_pages * b)
        if local % b and not spec.is_last:
            raise ValueError(f"num_tokens ({num_tokens}) ends inside rank {spec.rank}'s pages; only the last "
                             "rank holds an open page")
        self.kv.fill_random(request_id, shard.pages.pids, local, seed, first_page=spec.first_page)
        shard.computed = num_tokens

    @fails_fast
    def prefill(self, request_id: str, start: int, token_ids: list[int], sample_last: bool) -> int | None:
        """One prompt chunk (tokens start.. of the sequence), on every rank. Returns the sampled next
        token on rank 0 when sample_last, else None."""
        shard = self._shard(request_id, start)
        n, b, spec = len(token_ids), self.page_size, shard.spec
        a, size = spec.first_page * b, spec.num_pages * b
        lc0, lc1 = min(max(start - a, 0), size), min(max(start + n - a, 0), size)  # the rank's tokens
        locs = self._plan(shard, lc0, lc1)
        write_loc = [-1] * n
        for t in range(lc0, lc1):
            write_loc[a + t - start] = locs[t // b - lc0 // b]
        meta = None
        if lc1:
            pids = pid_tensor(shard.pages, self.device)[: lc0 // b]
            meta = PrefillMeta(0, n, lc1, pids, upload(locs, dtype=torch.int64, device=self.device))
        step = ShardStep(upload(write_loc, dtype=torch.int64, device=self.device),
                         upload([(start + i) % b for i in range(n)], dtype=torch.int64, device=self.device),
                         prefill=ShardPrefill(start, a, meta))
        positions = torch.arange(start, start + n, device=self.device)
        ids = upload(token_ids, dtype=torch.int64, device=self.device)
        hidden = self._forward(shard, step, ids, positions, "prefill")
        if lc1 > lc0:
            self.kv.commit([(Chunk(shard.pages, lc0, lc1 - lc0), locs)])
        shard.computed, shard.prefill_chunks = start + n, shard.prefill_chunks + 1
        return self._sample(shard, hidden[-1:]) if sample_last else None

    @fails_fast
    def decode(self, request_id: str, token: int, position: int) -> int | None:
        """One decode step: `token` at `position`, on every rank. Returns the next token on rank 0."""
        shard = self._shard(request_id, position)
        spec, b = shard.spec, self.page_size
        a = spec.first_page * b
        owned = a <= position < a + spec.num_pages * b
        if owned and not spec.is_last:
            raise RuntimeError(f"position {position} falls on rank {spec.rank}, not the last rank")
        locs = self._plan(shard, position - a, position - a + 1) if owned else []
        pages = position // b + 1  # the sequence's pages after this token, the open one included
        budget = spec.budget_pages
        fields = [spec.first_page, min(max(pages - spec.first_page, 0), spec.num_pages),
                  min(max(pages - 1 - spec.first_page, 0), spec.num_pages), pages,
                  budget if budget is not None else pages, position % b + 1, locs[0] if owned else -1,
                  position % b, token, position]  # META order
        buf = shard.buffers
        buf.meta.copy_(upload(fields, dtype=torch.int64, device=self.device))  # one upload for the step
        rows = ShardRows(shard.page_table, *(buf.meta[i : i + 1] for i in range(7)))
        scored = budget is not None and pages > budget
        fixed = self.attention.sink_pages + self.attention.recent_pages
        width = budget if scored else max(fields[1], 1)  # a row within its budget: all its pages
        step = ShardStep(buf.field("tail_loc") if owned else buf.no_write, buf.field("write_off"), rows=rows,
                         scored=scored, candidates=width - fixed if scored else 0, width=width)
        if shard.trace is not None:
            shard.trace.append([])
        # Keyed as the runner keys a batch of one row: the page table is the shard's whole table.
        key = (GraphKey(rows=1, width=shard.page_table.shape[1], k=width, scored=scored), owned)
        hidden = self._decode_forward(shard, step, key)
        if owned:
            self.kv.commit([(Chunk(shard.pages, position - a, 1), locs)])
        shard.computed, shard.decode_steps = position + 1, shard.decode_steps + 1
        return self._sample(shard, hidden)

    def _shard(self, request_id: str, start: int) -> Shard:
        shard = self.shards.get(request_id)
        if shard is None:
            raise ValueError(f"request_id ({request_id!r}) is not open on this rank")
        if start != shard.computed:
            raise ValueError(f"request {request_id!r}: step at position {start}, but {shard.computed} tokens "
                             "are in the cache")
        return shard

    def _plan(self, shard: Shard, lc0: int, lc1: int) -> list[int]:
        """Write-pool locations of this rank's pages holding its tokens [lc0, lc1) (none if empty)."""
        if lc1 <= lc0:
            return []
        return self.kv.plan(Chunk(shard.pages, lc0, lc1 - lc0))

    def _forward(self, shard: Shard, step: ShardStep, ids: torch.Tensor, positions: torch.Tensor,
                 phase: str) -> torch.Tensor:
        # ids, positions: [T] int64 on the device
        self.kv.before_forward()
        return self._model_forward(shard, step, ids, positions, phase)

    def _model_forward(self, shard: Shard, step: ShardStep, ids: torch.Tensor, positions: torch.Tensor,
                       phase: str) -> torch.Tensor:
        trace = shard.trace[-1] if shard.trace is not None and phase == "decode" else None
        self.attention.bind(step, shard.group, trace)
        shard.group.phase = phase
        with torch.inference_mode(), self.kv.synchronous_reads():
            self.kv.begin_forward()  # captured with a decode graph
            hidden = self.model(ids, positions, self.attention)  # [T, hidden]
            self.kv.join()  # inside a capture: side-stream work joins before it ends
            return hidden

    def _decode_forward(self, shard: Shard, step: ShardStep, key: tuple[GraphKey, bool]) -> torch.Tensor:
        """The decode forward of the step in shard.buffers: replayed from the graph of its key, or run
        eagerly (the first step of a key, which is then captured; every step without graphs or
        while tracing)."""
        buf = shard.buffers
        ids, positions = buf.field("token"), buf.field("position")
        captured = buf.graphs.get(key)
        if captured is not None:
            self.kv.before_forward()
            times = shard.group.times["decode"]
            calls, sent = captured.extra
            times.calls, times.bytes_sent = times.calls + calls, times.bytes_sent + sent
            self.totals["graph_replays"] += 1
            return buf.graphs.replay(captured)
        hidden = self._forward(shard, step, ids, positions, "decode")  # this step's answer; warms the capture
        if self.use_graphs and shard.trace is None:
            self._capture(shard, step, ids, positions, key)
        return hidden

    def _capture(self, shard: Shard, step: ShardStep, ids: torch.Tensor, positions: torch.Tensor,
                 key: tuple[GraphKey, bool]) -> None:
        """Capture the decode forward (nothing runs: the collectives are recorded, not issued, so the
        group's counters are put back and charged per replay instead)."""
        group = shard.group
        before = replace(group.times["decode"])
        group.capturing = True
        try:
            captured = shard.buffers.graphs.capture(
                key, lambda: self._model_forward(shard, step, ids, positions, "decode"))
        finally:
            group.capturing = False
        times = group.times["decode"]
        captured.extra = (times.calls - before.calls, times.bytes_sent - before.bytes_sent)
        times.calls, times.bytes_sent = before.calls, before.bytes_sent
        self.totals["graph_captures"] += 1

    @torch.inference_mode()
    def _sample(self, shard: Shard, hidden: torch.Tensor) -> int | None:
        if shard.sampler is None:
            return None
        params, generator = shard.sampler
        logits = self.model.compute_logits(hidden)  # [1, vocab]
        return int(sample(logits, [params], [generator])[0])

    # ---- introspection --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Pages, requests held, and over the requests closed so far: decode steps and their
        collectives (calls, seconds, bytes), and the collective time per decode layer."""
        layers = self.model.config.num_layers
        steps = self.totals["decode_steps"]
        per_layer = self.totals["decode_collective_s"] / (steps * layers) if steps else 0.0
        return {"capacity_pages": self.capacity_pages, "free_pages": self.free_pages,
                "requests": len(self.shards), **self.totals,
                "decode_collective_us_per_layer": per_layer * 1e6}


def collective_report(group: RankGroup) -> dict[str, dict[str, float]]:
    """A group's collectives by phase: {"prefill"|"decode": {"calls", "seconds", "bytes"}}."""
    return {phase: {"calls": t.calls, "seconds": t.seconds, "bytes": t.bytes_sent}
            for phase, t in group.drain_times().items()}
