"""Continuous batching: FCFS admission by KV capacity, then one step's work per call.

Admission reserves every page a request can ever need (prompt + max_tokens), so a running
sequence never waits for memory and nothing is preempted. With a prefix cache, admission first
reuses the longest run of cached full pages of the prompt (never its last token's page: at least
one token is prefilled, and the partial page is always the sequence's own) and evicts idle
cached pages when free ids run short. A step decodes one token of every
running sequence whose prompt is done, and fills the rest of the token budget with prefill
chunks (at most `prefill_chunk` prompt tokens per sequence), oldest sequence first. With a prefix
cache a prompt's last chunk starts where a later request's reuse would end, so that request's
tail runs the cold request's shapes (GEMM kernels pick their tiling by the rows: another chunk
length is other bits, and greedy tokens of random prompts flipped at the 6th token at 128K).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .prefix_cache import PrefixCache, chain_hashes
from .sequence import Sequence, SequenceStatus


def tokens_within(work: int, start: int) -> int:
    """Most tokens n of a chunk starting at position `start` whose causal attention fits `work`
    query x key tokens: the largest n >= 0 with n * (start + n) <= work (each of the n queries
    reads at most start + n keys)."""
    if work <= 0:
        return 0
    n = (math.isqrt(start * start + 4 * work) - start) // 2
    while n * (start + n) > work:  # isqrt's floor can leave n one too large or too small
        n -= 1
    while (n + 1) * (start + n + 1) <= work:
        n += 1
    return n


class PageIdAllocator:
    """Free list of page ids in [0, capacity). A page id names one page of one sequence across
    all layers and KV heads. Invariant: an id is either free or owned by exactly one sequence or
    by the prefix cache (which lets sequences read it)."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity ({capacity}) must be > 0 pages")
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self._owned = [False] * capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} page ids: {len(self._free)} of {self.capacity} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._owned[i] = True
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if not self._owned[i]:
                raise ValueError(f"double free of page id {i}")
            self._owned[i] = False
        self._free.extend(reversed(ids))


@dataclass
class Chunk:
    """Tokens [start, start + num_tokens) of one sequence, processed in this step.

    sample: the chunk reaches the end of the sequence's known tokens, so the step samples the
    sequence's next token from the chunk's last hidden state.
    """

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def sample(self) -> bool:
        return self.end == self.seq.num_tokens


@dataclass
class Batch:
    """One step's work: decodes (one token each) first, then prefill chunks, in token order."""

    decodes: list[Chunk]
    prefills: list[Chunk]

    @property
    def chunks(self) -> list[Chunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    """Waiting queue (FCFS) and running set of one engine.

    max_num_seqs: running sequences at most; max_num_batched_tokens: tokens per step;
    prefill_chunk: prompt tokens per sequence per step; prefill_chunk_decoding: prompt tokens per
    step over all sequences while any sequence decodes (None: no cap beyond the others);
    prefill_attention_decoding: prefill attention work per step over all chunks while any sequence
    decodes, in query x key tokens (a chunk of n tokens from position p costs n x (p + n); None:
    no cap); page_size: tokens per page. prefix: the
    prefix cache (None: no reuse); on_evict(pids): called with the ids of evicted cached pages
    before they are freed (the tier drops their state). disk: a persistent prefix index below the
    cache (engine/prefix_disk.py; None: none): `save(digests, pids)` is told every page the cache
    takes; `restore(digests, pids) -> n` fills fresh ids with the longest stored run of digests
    and says how many, which admission then counts as cached. on_reuse(pids): called with the
    cached ids an admitted sequence reuses, before its first step (their summaries come back).
    """

    def __init__(self, allocator: PageIdAllocator, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, prefill_chunk: int, prefix: PrefixCache | None = None,
                 on_evict: Callable[[list[int]], None] | None = None,
                 prefill_chunk_decoding: int | None = None, disk=None,
                 on_reuse: Callable[[list[int]], None] | None = None,
                 prefill_attention_decoding: int | None = None):
        self.prefill_chunk_decoding = prefill_chunk_decoding
        self.prefill_attention_decoding = prefill_attention_decoding
        self.on_reuse = on_reuse
        self.disk = disk if prefix is not None else None
        self.allocator = allocator
        self.prefix, self.on_evict = prefix, on_evict
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # A chunk whose forward runs over several steps (a few layers a step, beside decoding
        # requests): `schedule` gives it back whole, and no other prefill beside it, until the
        # engine unpins it (its last part ran) or its sequence finishes.
        self.pinned: Chunk | None = None

    def pages_needed(self, seq: Sequence) -> int:
        return math.ceil(seq.max_total_tokens / self.page_size)

    def can_ever_fit(self, seq: Sequence) -> bool:
        return self.pages_needed(seq) <= self.allocator.capacity

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        """Admit what fits (strict FCFS: the head of the queue blocks those behind it), then plan
        one step. Returns an empty Batch when there is nothing to run."""
        self.admit()
        decodes = [Chunk(s, s.num_computed, 1) for s in self.running if not s.in_prefill]
        if self.pinned is not None:
            return Batch(decodes, [self.pinned])
        budget = self.max_num_batched_tokens - len(decodes)
        # While others decode, short steps: prompt tokens and prefill attention work capped.
        work = self.prefill_attention_decoding if decodes else None
        if decodes and self.prefill_chunk_decoding is not None:
            budget = min(budget, self.prefill_chunk_decoding)
        prefills = []
        for seq in self.running:
            if not seq.in_prefill or budget <= 0 or (work is not None and work <= 0):
                continue
            start = seq.num_computed
            n = min(self.prefill_chunk, seq.num_prompt - start, budget)
            if self.prefix is not None:
                # NOTE: the tokens from the last page a later request may reuse (_lookup) on go in a
                # chunk of their own, as that request's tail will: the same shapes, the same bits.
                reuse_end = (seq.num_prompt - 1) // self.page_size * self.page_size
                if start < reuse_end < start + n:
                    n = reuse_end - start
            if work is not None:
                # NOTE: at least one token even past the cap, so a prefill always advances.
                n = min(n, max(1, tokens_within(work, start)))
                work -= n * (start + n)
            prefills.append(Chunk(seq, start, n))
            budget -= n
        return Batch(decodes, prefills)

    def admit(self) -> None:
        """Admit waiting sequences while they fit (strict FCFS), giving each its page ids: cached
        pages of its prompt first (their tokens count as computed), then ids of its own."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._lookup(seq)
            need = self.pages_needed(seq) - len(hit)
            if self.prefix is not None:
                self.prefix.acquire(hit)  # before making room: a hit is never evicted for its own sequence
            if not self._make_room(need):
                if self.prefix is not None:
                    self.prefix.release(hit)
                break
            self.waiting.popleft()
            if hit and self.on_reuse is not None:
                self.on_reuse(hit)
            seq.pids = hit + self.allocator.allocate(need)
            seq.num_shared = len(hit) + self._restore(seq, len(hit))
            seq.num_cached = seq.num_computed = seq.num_shared * self.page_size
            if self.prefix is not None and seq.reuse_prefix:
                self.prefix.note_lookup(seq.num_prompt, seq.num_cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _lookup(self, seq: Sequence) -> list[int]:
        """Ids of the cached pages of seq's prompt it may reuse: at most (prompt - 1) // B pages."""
        if self.prefix is None or not seq.reuse_prefix:
            return []
        usable = (seq.num_prompt - 1) // self.page_size
        return self.prefix.match(self.digests(seq, usable)[:usable])

    def _restore(self, seq: Sequence, cached: int) -> int:
        """Pages after the in-memory hit (its first `cached`) that the disk index restores into seq's
        fresh ids, which the prefix cache then holds (one reference each: seq's)."""
        if self.disk is None or not seq.reuse_prefix:
            return 0
        digests = self.digests(seq, (seq.num_prompt - 1) // self.page_size)[cached:]
        # A page the cache holds past the hit's gap is not restored again (its digest is taken).
        digests = digests[: next((i for i, d in enumerate(digests) if d in self.prefix), len(digests))]
        n = self.disk.restore(digests, seq.pids[cached : cached + len(digests)]) if digests else 0
        for j in range(n):
            self.prefix.insert(digests[j], seq.pids[cached + j])
        return n

    def _make_room(self, need: int) -> bool:
        """Whether `need` ids can be allocated, evicting idle cached pages (LRU) if that makes them."""
        short = need - self.allocator.num_free
        if short <= 0:
            return True
        if self.prefix is None or self.prefix.num_idle < short:
            return False
        evicted = self.prefix.evict(short)
        if self.on_evict is not None:
            self.on_evict(evicted)
        self.allocator.free(evicted)
        return True

    def digests(self, seq: Sequence, pages: int) -> list[bytes]:
        """Chain hashes of seq's first `pages` full pages (prompt then output tokens), kept on seq."""
        have = len(seq.page_digests)
        if have < pages:
            tokens = seq.token_slice(have * self.page_size, pages * self.page_size)
            previous = seq.page_digests[-1] if have else self.prefix.salt
            seq.page_digests += chain_hashes(tokens, self.page_size, previous)
        return seq.page_digests[:pages]

    def share(self, seq: Sequence, pages: int, last: bool = True) -> None:
        """Give the prefix cache seq's full pages num_shared .. pages-1 (their K/V and summaries are
        settled), in order, until one is cached already (another sequence computed it first; the
        rest stay seq's own). last False: more of seq's prompt is to come (the disk index may wait
        for a whole save)."""
        if self.prefix is None or not seq.reuse_prefix:
            return
        digests = self.digests(seq, pages)
        j = first = seq.num_shared
        while j < pages and self.prefix.insert(digests[j], seq.pids[j]):
            j += 1
        seq.num_shared = j
        if self.disk is not None and (j > first or last):  # last: what earlier chunks deferred goes too
            self.disk.save(digests[first:j], seq.pids[first:j], flush=last)

    def finish(self, seq: Sequence) -> list[int]:
        """Remove a sequence (finished or aborted) and free its page ids at once; its full pages go
        to the prefix cache where they can. Returns the freed ids whose pages had settled (the tier
        drops their state); cached pages keep theirs."""
        if self.pinned is not None and self.pinned.seq is seq:
            self.pinned = None
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        settled: list[int] = []
        if seq.pids:
            full = min(seq.num_computed // self.page_size, len(seq.pids))
            if self.prefix is not None:
                self.share(seq, full)
                # last page first: idle in that order, eviction trims a chain from its tail, so
                # what stays cached is still a prefix that a match (from page 0) reaches
                self.prefix.release(seq.pids[: seq.num_shared][::-1])
            own = seq.pids[seq.num_shared :]
            settled = seq.pids[seq.num_shared : full]
            self.allocator.free(own)
            seq.pids, seq.pid_tensor = [], None
        seq.status = SequenceStatus.FINISHED
        return settled

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
