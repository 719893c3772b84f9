"""Scheduler: page-id allocation, FCFS admission by capacity, the token budget, finishing."""

from __future__ import annotations

import math

import pytest
from lockserve.workers.engine.prefix_cache import PrefixCache
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.engine.scheduler import PageIdAllocator, Scheduler, tokens_within
from lockserve.workers.engine.sequence import Sequence, SequenceStatus

B = 4


def seq(rid: str, prompt: int, max_tokens: int = 4) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens)
    return Sequence(rid, list(range(prompt)), params, None, None, frozenset(), None)


def make(capacity=10, max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk=8) -> Scheduler:
    return Scheduler(PageIdAllocator(capacity), B, max_num_seqs, max_num_batched_tokens, prefill_chunk)


def test_allocator_hands_out_distinct_ids_and_refuses_double_free():
    alloc = PageIdAllocator(5)
    a, b = alloc.allocate(3), alloc.allocate(2)
    assert sorted(a + b) == list(range(5)) and alloc.num_free == 0 and not alloc.can_allocate(1)
    with pytest.raises(RuntimeError, match="cannot allocate 1 page ids: 0 of 5 free"):
        alloc.allocate(1)
    alloc.free(a)
    assert alloc.num_free == 3 and sorted(alloc.allocate(3)) == sorted(a)
    alloc.free(b)
    with pytest.raises(ValueError, match="double free of page id"):
        alloc.free(b[:1])
    with pytest.raises(ValueError, match=r"capacity \(0\)"):
        PageIdAllocator(0)


def test_admission_is_fcfs_by_capacity():
    s = make(capacity=10)
    a, b, c = seq("a", 18, 6), seq("b", 20, 4), seq("c", 3, 1)  # 6, 6 and 1 pages
    for x in (a, b, c):
        s.add(x)
    batch = s.schedule()
    assert s.running == [a] and list(s.waiting) == [b, c], "c fits but must wait behind b (FCFS)"
    assert len(a.pids) == math.ceil(24 / B) and a.status is SequenceStatus.RUNNING
    assert [(x.seq.request_id, x.start, x.num_tokens) for x in batch.prefills] == [("a", 0, 8)]
    s.finish(a)
    assert a.pids == [] and a.status is SequenceStatus.FINISHED and s.allocator.num_free == 10
    s.schedule()
    assert s.running == [b, c] and not s.waiting


def test_max_num_seqs_limits_admission():
    s = make(capacity=100, max_num_seqs=2)
    seqs = [seq(str(i), 3) for i in range(5)]
    for x in seqs:
        s.add(x)
    s.schedule()
    assert s.running == seqs[:2] and list(s.waiting) == seqs[2:]


def test_budget_decodes_first_then_prefill_chunks():
    s = make(capacity=100, max_num_batched_tokens=12, prefill_chunk=8)
    d1, d2, p1, p2 = seq("d1", 5), seq("d2", 6), seq("p1", 30), seq("p2", 9)
    for x in (d1, d2, p1, p2):
        s.add(x)
    s.schedule()
    for d in (d1, d2):  # pretend their prompts are done and one token was sampled
        d.num_computed = d.num_prompt
        d.output_ids.append(1)
    batch = s.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in batch.decodes] == [("d1", 5, 1), ("d2", 6, 1)]
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in batch.prefills] == [("p1", 0, 8), ("p2", 0, 2)]
    assert batch.num_tokens == 12 and all(c.sample for c in batch.decodes)
    assert not any(c.sample for c in batch.prefills)
    p1.num_computed, p2.num_computed = 24, 2
    batch = s.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens, c.sample) for c in batch.prefills] == [
        ("p1", 24, 6, True), ("p2", 2, 4, False)]



def test_a_pinned_chunk_comes_back_whole_and_alone_until_it_is_unpinned_or_finished():
    """A chunk whose forward spans several steps (Scheduler.pinned) is the step's only prefill
    chunk, the same tokens each time, beside the decodes; finishing its sequence unpins it."""
    s = make(capacity=100, max_num_batched_tokens=12, prefill_chunk=8)
    d, p1, p2 = seq("d", 5), seq("p1", 30), seq("p2", 9)
    for x in (d, p1, p2):
        s.add(x)
    s.schedule()
    d.num_computed = d.num_prompt
    d.output_ids.append(1)
    s.pinned = s.schedule().prefills[0]
    for _ in range(2):
        batch = s.schedule()
        assert [c.seq.request_id for c in batch.decodes] == ["d"]
        assert [(c.seq.request_id, c.start, c.num_tokens) for c in batch.prefills] == [("p1", 0, 8)]
    s.finish(p1)
    assert s.pinned is None
    assert [(c.seq.request_id, c.start) for c in s.schedule().prefills] == [("p2", 0)]


def test_tokens_within_is_the_largest_chunk_whose_attention_fits():
    for start in (0, 1, 5, 63, 1000, 131071):
        for work in (0, 1, 2, 7, 64, 999, 5000, 10**7):
            n = tokens_within(work, start)
            assert n >= 0 and n * (start + n) <= work and (n + 1) * (start + n + 1) > work, (start, work, n)
    assert tokens_within(-5, 10) == 0
    assert tokens_within(2**50, 2**20) > 0  # isqrt: no float rounding at large work


def test_prefill_attention_cap_shrinks_chunks_as_the_prefix_grows():
    """While one request decodes, a long prompt's chunks keep n x (start + n) within the cap (one
    token when not even that fits), so late chunks get fewer tokens; alone it takes whole chunks."""
    cap = 64 * 80
    s = Scheduler(PageIdAllocator(1000), B, 4, 4096, 256, prefill_chunk_decoding=128,
                  prefill_attention_decoding=cap)
    d, long = seq("d", 5, 100), seq("long", 3000)
    s.add(d)
    s.schedule()
    d.num_computed = d.num_prompt
    d.output_ids.append(1)
    s.add(long)
    sizes = []
    while long.in_prefill:
        batch = s.schedule()
        assert [c.seq for c in batch.decodes] == [d]
        (chunk,) = batch.prefills
        n, start = chunk.num_tokens, chunk.start
        assert n <= 128 and (n * (start + n) <= cap or n == 1), (start, n)
        sizes.append(n)
        long.num_computed = chunk.end
    # 71 x 71 <= 5120 < 72 x 72
    assert sizes[0] == 71 and sizes[-1] == 1 and sizes == sorted(sizes, reverse=True), sizes
    s.finish(d)
    s.finish(long)
    alone = seq("alone", 3000)
    s.add(alone)
    assert [c.num_tokens for c in s.schedule().prefills] == [256], "no cap without decodes"


@pytest.mark.parametrize("prompt,chunks", [(30, [8, 8, 8, 4, 2]), (28, [8, 8, 8, 4]), (8, [4, 4]), (3, [3])])
def test_with_a_prefix_cache_the_reusable_pages_end_a_chunk(prompt, chunks):
    """With reuse on, the chunk that would cross (prompt - 1) // B * B (where a later request
    sharing the prompt resumes) stops there, so the tail after it is a chunk of its own, as it
    will be in that request; without a cache, whole chunks."""
    for cache, want in ((PrefixCache(b"s", B), chunks), (None, None)):
        s = Scheduler(PageIdAllocator(100), B, 4, 64, 8, prefix=cache)
        x = seq("x", prompt)
        s.add(x)
        sizes = []
        while x.in_prefill:
            (chunk,) = s.schedule().prefills
            sizes.append(chunk.num_tokens)
            x.num_computed = chunk.end
        whole = [8] * (prompt // 8) + ([prompt % 8] if prompt % 8 else [])
        assert sizes == (want or whole), (cache, sizes)


def test_can_ever_fit_and_find():
    s = make(capacity=3)
    assert s.can_ever_fit(seq("x", 8, 4)) and not s.can_ever_fit(seq("y", 9, 4))
    a = seq("a", 3)
    s.add(a)
    assert s.find("a") is a and s.find("zz") is None and s.has_unfinished()
    s.finish(a)
    assert not s.has_unfinished() and not s.schedule()
