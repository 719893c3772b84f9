"""Continuous batching: FCFS admission by KV capacity, then one step's work per call.

Admission reserves every page a request can ever need (prompt + max_tokens), so a running
sequence never waits for memory and nothing is preempted. A step decodes one token of every
running sequence whose prompt is done, and fills the rest of the token budget with prefill
chunks (at most `prefill_chunk` prompt tokens per sequence), oldest sequence first.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .sequence import Sequence, SequenceStatus


class PageIdAllocator:
    """Free list of page ids in [0, capacity). A page id names one page of one sequence across
    all layers and KV heads. Invariant: an id is either free or owned by exactly one sequence."""

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
    prefill_chunk: prompt tokens per sequence per step; page_size: tokens per page.
    """

    def __init__(self, allocator: PageIdAllocator, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, prefill_chunk: int):
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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
        budget = self.max_num_batched_tokens - len(decodes)
        prefills = []
        for seq in self.running:
            if not seq.in_prefill or budget <= 0:
                continue
            n = min(self.prefill_chunk, seq.num_prompt - seq.num_computed, budget)
            prefills.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        return Batch(decodes, prefills)

    def admit(self) -> None:
        """Admit waiting sequences while they fit (strict FCFS), giving each its page ids."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = self.pages_needed(seq)
            if not self.allocator.can_allocate(need):
                break
            self.waiting.popleft()
            seq.pids = self.allocator.allocate(need)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished or aborted) and free its page ids at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.pids:
            self.allocator.free(seq.pids)
            seq.pids, seq.pid_tensor = [], None
        seq.status = SequenceStatus.FINISHED

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
