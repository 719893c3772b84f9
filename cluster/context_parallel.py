"""One request over several nodes: the coordinator of context-parallel ranks.

    ranks = place_ranks(...); start_ranks(ranks, ...)          # cluster/cp_placement.py
    cp = ContextParallel(ranks, tokenizer, prefill_chunk)
    cp.check_request(prompt_tokens, params, options)          # 400 unless the alive ranks can hold it
    async for event in cp.generate(prompt_ids, params, options, request_id): ...

Admission: a request no choice of alive ranks can ever hold (cp_placement.plan_shards over their
capacities) is a 400 that names the pages and the ranks' nodes; one that only has to wait for
pages held by others waits until they are freed.

The coordinator drives a request step by step: one Ray call per rank per prefill chunk or decode
step, every rank of the request in the same order. Steps of requests that share ranks take turns:
a step holds the locks of its ranks, taken in rank order, so no two requests ever wait on each
other's collectives (a rank runs one call at a time). Rank 0 samples; the coordinator applies the
stop rules and detokenizes (workers/engine/sequence.py), so the stream is the one an engine gives.

Failures: a rank whose actor dies (its node is gone) ends every request it holds with an error
that names the rank's node and address; it gets no new requests, and requests that fit on the
other ranks are served. A step that raises on a rank ends its request with that error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
import torch
from lockserve.cluster.cp_placement import NoCapacity, RankSet, ShardRange, plan_shards
from lockserve.cluster.engine_client import RequestError, RequestOptions, SamplingParams, TokenEvent
from lockserve.cluster.errors import param_of
from lockserve.workers.engine import EngineLimits
from lockserve.workers.engine.context_parallel import ShardSpec
from lockserve.workers.engine.sequence import Sequence
from ray.exceptions import RayActorError, RayTaskError

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 10.0  # after one rank fails a step, how long to wait for the others (to name the dead one)


# ---- the coordinator ----------------------------------------------------------------------------


class RankFailure(RuntimeError):
    """A step failed on a rank. dead: its actor is gone (the node failed)."""

    def __init__(self, message: str, dead: bool):
        super().__init__(message)
        self.dead = dead


@dataclass
class LiveRequest:
    request_id: str
    ranges: list[ShardRange]
    specs: list[ShardSpec]
    aborted: bool = False


@dataclass
class _LoopState:
    """asyncio objects of the event loop serving requests (tests run several loops, one at a time)."""

    loop: asyncio.AbstractEventLoop
    locks: list[asyncio.Lock]
    changed: asyncio.Condition


class ContextParallel:
    """Admission and the per-step driver of context-parallel requests (see the module docstring).

    ranks: the placed ranks (cp_placement.start_ranks); tokenizer: the served tokenizer (stop ids,
    detokenizing); prefill_chunk: prompt tokens per prefill step; seed: draws the seeds of unseeded
    requests.
    """

    def __init__(self, ranks: RankSet, tokenizer, prefill_chunk: int, seed: int = 0):
        if not ranks.ranks:
            raise ValueError("ranks is empty: context parallelism needs at least one rank")
        self.rank_set, self.ranks = ranks, ranks.ranks
        self.tokenizer, self.prefill_chunk = tokenizer, prefill_chunk
        self.base_limits: EngineLimits = ray.get(self.ranks[0].actor.limits.remote())
        self.page_size, self.sink_pages = self.base_limits.page_size, self.base_limits.sink_pages
        self._alive = {r.index for r in self.ranks}
        self._free = {r.index: r.capacity_pages for r in self.ranks}
        self._held = {r.index: 0 for r in self.ranks}  # requests each rank holds
        self._live: dict[str, LiveRequest] = {}
        self._loop_state: _LoopState | None = None
        self._rng = torch.Generator().manual_seed(seed)
        self.counters = {"cp_requests": 0, "cp_requests_failed": 0}

    # ---- admission ------------------------------------------------------------------------------

    @property
    def limits(self) -> EngineLimits:
        """The ranks' admission limits with the alive ranks' pages as the capacity."""
        capacity = sum(r.capacity_pages for r in self.ranks if r.index in self._alive)
        return dataclasses.replace(self.base_limits, pages_capacity=capacity)

    def pages_of(self, prompt_tokens: int, max_tokens: int) -> tuple[int, int]:
        """(pages of the request, pages from the first new token's on: the last rank's floor)."""
        total = math.ceil((prompt_tokens + max_tokens) / self.page_size)
        return total, total - prompt_tokens // self.page_size

    def check_request(self, prompt_tokens: int, params: SamplingParams, options: RequestOptions,
                      shards: int | None = None) -> int | None:
        """RequestError 400 (naming the field) unless the alive ranks can ever hold the request;
        returns its LOCKS page budget (None = every page)."""
        try:
            total, tail = self.pages_of(prompt_tokens, params.max_tokens)
            # the model's length, the budget and the options as any engine checks them; the pages below
            unbounded = dataclasses.replace(self.base_limits, pages_capacity=total)
            budget = unbounded.check(prompt_tokens, params.max_tokens, **dataclasses.asdict(options))
            capacity = {r.index: r.capacity_pages for r in self.ranks if r.index in self._alive}
            try:
                plan_shards(capacity, total, tail, self.sink_pages, shards)
            except NoCapacity:
                raise ValueError(
                    f"prompt ({prompt_tokens} tokens) + max_tokens ({params.max_tokens}) needs {total} KV "
                    f"pages of {self.page_size} tokens ({tail} of them on one rank); the {len(capacity)} "
                    f"alive context-parallel ranks hold {self._describe(capacity)}") from None
        except ValueError as err:
            raise RequestError(400, str(err), param=param_of(str(err))) from None
        return budget

    def _describe(self, pages: Mapping[int, int]) -> str:
        return ", ".join(f"{pages[r.index]} pages on node {r.node_id[:12]} ({r.address})"
                         for r in self.ranks if r.index in pages) or "nothing"

    async def _reserve(self, total: int, tail: int, shards: int | None) -> list[ShardRange]:
        """Take the pages of a request on the fewest ranks that have them free now; wait while
        others hold them. RequestError when the alive ranks can no longer ever hold it."""
        state = self._state()
        async with state.changed:
            while True:
                free = {i: self._free[i] for i in self._alive
                        if self._held[i] < self.ranks[i].max_requests}
                try:
                    ranges = plan_shards(free, total, tail, self.sink_pages, shards)
                    break
                except NoCapacity:
                    capacity = {i: self.ranks[i].capacity_pages for i in self._alive}
                    try:
                        plan_shards(capacity, total, tail, self.sink_pages, shards)
                    except NoCapacity:
                        held = self._describe(capacity)
                        raise RequestError(503, f"the alive context-parallel ranks ({held}) can no longer "
                                           f"hold {total} pages") from None
                    await state.changed.wait()
            for r in ranges:
                self._free[r.index] -= r.num_pages
                self._held[r.index] += 1
            return ranges

    def _release(self, live: LiveRequest) -> None:
        for r in live.ranges:
            self._free[r.index] += r.num_pages
            self._held[r.index] -= 1
        self._notify()

    def _notify(self) -> None:
        state = self._loop_state
        if state is None:
            return

        async def wake() -> None:
            async with state.changed:
                state.changed.notify_all()

        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits on it
            state.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(wake()))

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        if self._loop_state is None or self._loop_state.loop is not loop:
            self._loop_state = _LoopState(loop, [asyncio.Lock() for _ in self.ranks], asyncio.Condition())
        return self._loop_state

    # ---- requests -------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams, options: RequestOptions,
                       request_id: str, *, synthetic_seed: int | None = None, shards: int | None = None,
                       trace: dict | None = None) -> AsyncIterator[TokenEvent]:
        """TokenEvents of one request sharded over ranks (the EngineClient.generate contract).

        synthetic_seed: random K/V from this seed in place of the prompt's (benchmarks and tests;
        label results so): the ranks hold the cache Engine.fill_synthetic(seed) makes, and the first
        output is the prompt's last token, as there. shards: exactly this
        many ranks (None: the fewest that hold it). trace: filled with each decode layer's selected
        pages (tests): {"selections": [[per KV head: sorted positions] per layer] per step,
        "ranks": [(index, first_page, num_pages)], "reports": per-rank reports}.
        """
        budget = self.check_request(len(prompt_ids), params, options, shards)
        if request_id in self._live:
            raise RequestError(400, f"request_id ({request_id!r}) is already in use", param="request_id")
        seq = self._sequence(request_id, prompt_ids, params, budget)
        live = await self._start(seq, params, shards, trace is not None)
        done = False
        try:
            token = await self._prefill(live, seq.prompt_ids, synthetic_seed)
            while token is not None:
                out = seq.append_token(token)
                yield TokenEvent.of(out)
                if seq.finished or live.aborted:
                    break
                step = partial_call("decode", token, seq.num_tokens - 1)
                token = (await self._step(live, step))[0]
            reports = await self._step(live, partial_call("close"))
            done = True
            if trace is not None:
                trace.update(merge_traces(live, reports))
        except RankFailure as err:
            self.counters["cp_requests_failed"] += 1
            raise RuntimeError(f"request {request_id!r} failed: {err}") from None
        finally:
            self._live.pop(request_id, None)
            if not done:
                self._close_later(live)
            self._release(live)

    def _sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  budget: int | None) -> Sequence:
        """The coordinator's copy of the request: tokens, stop rules and text (it samples nothing)."""
        try:
            prompt = self.base_limits.check_prompt_ids(prompt_ids)
        except ValueError as err:
            raise RequestError(400, str(err), param=param_of(str(err))) from None
        eos = frozenset() if params.ignore_eos else self.tokenizer.stop_ids
        return Sequence(request_id=request_id, prompt_ids=prompt, params=params, generator=self._rng,
                        detokenizer=self.tokenizer.detokenizer(prompt),
                        stop_ids=frozenset(params.stop_token_ids) | eos, budget_pages=budget)

    async def _start(self, seq: Sequence, params: SamplingParams, shards: int | None, record: bool
                     ) -> LiveRequest:
        """Reserve pages, then open the request on its ranks (their group); a rank found dead while
        opening is dropped and the request placed again on the others."""
        total, tail = self.pages_of(seq.num_prompt, params.max_tokens)
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        sampling = dataclasses.asdict(params)
        while True:
            ranges = await self._reserve(total, tail, shards)
            specs = [ShardSpec(seq.request_id, j, len(ranges), r.first_page, r.num_pages, total,
                               seq.budget_pages) for j, r in enumerate(ranges)]
            live = LiveRequest(seq.request_id, ranges, specs)
            self._live[seq.request_id] = live
            try:
                first = self.ranks[ranges[0].index].actor
                [address] = await self._await_all(live, [first.host_group.remote(seq.request_id)], ranges[:1])
                await self._step(live, partial_call("open", address, sampling, seed, record, spec_first=True))
                self.counters["cp_requests"] += 1
                return live
            except RankFailure as err:
                self._live.pop(seq.request_id, None)
                self._close_later(live)
                self._release(live)
                if not err.dead:
                    raise RuntimeError(f"request {seq.request_id!r} could not start: {err}") from None
                log.warning("request %s: %s; placing it again", seq.request_id, err)

    async def _prefill(self, live: LiveRequest, prompt: list[int], synthetic_seed: int | None) -> int | None:
        """The prompt's K/V on every rank; returns the first output token (rank 0's sample), None
        when the request is aborted meanwhile."""
        if synthetic_seed is not None:
            await self._step(live, partial_call("fill_synthetic", len(prompt), synthetic_seed))
            return prompt[-1]
        token = None
        for start in range(0, len(prompt), self.prefill_chunk):
            if live.aborted:
                return None
            chunk = prompt[start : start + self.prefill_chunk]
            last = start + len(chunk) == len(prompt)
            token = (await self._step(live, partial_call("prefill", start, chunk, last)))[0]
        return token

    async def abort(self, request_id: str) -> bool:
        """Stop a request after its current step (its stream ends without a final event); False if
        it is not a context-parallel request in flight."""
        live = self._live.get(request_id)
        if live is not None:
            live.aborted = True
        return live is not None

    # ---- steps ----------------------------------------------------------------------------------

    async def _step(self, live: LiveRequest, call: Callable[[Any, ShardSpec], Any]) -> list:
        """One step on every rank of the request (call(actor, spec) -> ObjectRef); the results by rank.
        Holds the ranks' locks, taken in rank order, until every rank has finished, even when the
        caller is cancelled: the next step on those ranks must not overtake this one."""
        task = asyncio.ensure_future(self._locked(live, call))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: never "unhandled"
        return await asyncio.shield(task)

    async def _locked(self, live: LiveRequest, call) -> list:
        state = self._state()
        async with contextlib.AsyncExitStack() as stack:
            for index in sorted(r.index for r in live.ranges):
                await stack.enter_async_context(state.locks[index])
            pairs = zip(live.ranges, live.specs, strict=True)
            refs = [call(self.ranks[r.index].actor, spec) for r, spec in pairs]
            return await self._await_all(live, refs, live.ranges)

    async def _await_all(self, live: LiveRequest, refs: list, ranges: list[ShardRange]) -> list:
        """The refs' results; on a failure, a RankFailure naming the rank (a dead one first: when a
        node dies the survivors' collectives fail too, so their errors name no culprit)."""
        futures = [asyncio.wrap_future(ref.future()) for ref in refs]
        _, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        failed = [(r, f.exception()) for r, f in zip(ranges, futures, strict=True)
                  if f.done() and f.exception() is not None]
        if not failed:
            return [f.result() for f in futures]
        if pending:
            await asyncio.wait(pending, timeout=FAILURE_GRACE_S)
            failed = [(r, f.exception()) for r, f in zip(ranges, futures, strict=True)
                      if f.done() and f.exception() is not None]
        dead = [(r, err) for r, err in failed if isinstance(err, RayActorError)]
        for r, _ in dead:
            self._mark_dead(r.index)
        r, err = (dead or failed)[0]
        where = self.ranks[r.index].where()
        if dead:
            raise RankFailure(f"context-parallel {where} is gone ({type(err).__name__}): its node failed and "
                              "the request's pages there are lost (new requests go to the other ranks)",
                              dead=True)
        cause = err.cause if isinstance(err, RayTaskError) and err.cause is not None else err
        raise RankFailure(f"context-parallel {where} failed: {type(cause).__name__}: {cause}", dead=False)

    def _mark_dead(self, index: int) -> None:
        if index in self._alive:
            log.error("context-parallel %s is gone; it gets no new requests", self.ranks[index].where())
            self._alive.discard(index)
            self._notify()

    def _close_later(self, live: LiveRequest) -> None:
        """Close a failed or cancelled request on its alive ranks, after any step still running there."""
        alive = [(r, s) for r, s in zip(live.ranges, live.specs, strict=True) if r.index in self._alive]
        if not alive:
            return
        sub = LiveRequest(live.request_id, [r for r, _ in alive], [s for _, s in alive])

        async def close() -> None:
            try:
                await self._locked(sub, partial_call("close"))
            except RankFailure as err:
                log.warning("closing %s after it failed: %s", live.request_id, err)

        try:
            asyncio.ensure_future(close())
        except RuntimeError:  # no running loop (a generator finalised late): the ranks keep the pages
            log.warning("request %s could not be closed on its ranks", live.request_id)

    # ---- introspection --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Local counters (no remote call): ranks alive, requests running, pages reserved."""
        alive = [r for r in self.ranks if r.index in self._alive]
        capacity = sum(r.capacity_pages for r in alive)
        return {**self.counters, "cp_ranks": len(self.ranks), "cp_ranks_alive": len(alive),
                "cp_requests_running": len(self._live), "cp_pages_capacity": capacity,
                "cp_pages_reserved": capacity - sum(self._free[r.index] for r in alive)}

    async def rank_stats(self) -> list[dict[str, Any]]:
        """Every alive rank's ShardEngine stats (decode collectives per layer), after queued steps."""
        alive = [r for r in self.ranks if r.index in self._alive]
        return list(await asyncio.gather(*(r.actor.stats.remote() for r in alive)))

    def close(self) -> None:
        self.rank_set.close()


def partial_call(method: str, *args, spec_first: bool = False) -> Callable[[Any, ShardSpec], Any]:
    """call(actor, spec) -> actor.<method>.remote(request_id, *args) (or (spec, *args): open)."""

    def call(actor, spec: ShardSpec):
        return getattr(actor, method).remote(spec if spec_first else spec.request_id, *args)

    return call


def merge_traces(live: LiveRequest, reports: list[dict | None]) -> dict[str, Any]:
    """The union over ranks of each decode layer's selection: [step][layer][KV head] sorted positions."""
    per_rank = [rep["trace"] for rep in reports if rep is not None and rep["trace"] is not None]
    selections = []
    for step in zip(*per_rank, strict=True):
        layers = []
        for layer in zip(*step, strict=True):  # each rank's [Bt = 1, Hkv, width] global positions
            heads = torch.cat([sel[0] for sel in layer], dim=-1)  # [Hkv, sum of widths]
            layers.append([sorted(p for p in row.tolist() if p >= 0) for row in heads])
        selections.append(layers)
    return {"selections": selections, "ranks": [(r.index, r.first_page, r.num_pages) for r in live.ranges],
            "reports": [{k: v for k, v in (rep or {}).items() if k != "trace"} for rep in reports]}
