"""Prefix reuse: the hash chain, the cache's references and eviction, and the engine end to end
(tiny preset, CPU): warm requests equal cold ones on every tier, pages are shared only while
full and read-only, references survive any finishing order, eviction never takes a page in use."""

from __future__ import annotations

import pytest
import torch
from lockserve.configs.schema import CacheConfig
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.prefix_cache import PrefixCache, cache_salt, chain_hashes

from tests.workers.engine.test_engine import greedy, make_engine, run

PAGE = 16
_G = torch.Generator().manual_seed(7)
DOC = torch.randint(0, 256, (300,), generator=_G).tolist()  # 18 full pages and 12 tokens
Q1, Q2 = (torch.randint(0, 256, (21,), generator=_G).tolist() for _ in range(2))

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    from lockserve.workers.model.presets import build_preset

    return build_preset("tiny", seed=0, device="cpu")


# ---- the chain -------------------------------------------------------------------------------


def test_chain_names_full_pages_by_everything_before_them():
    salt = cache_salt(model="m", page_size=PAGE)
    h = chain_hashes(DOC, PAGE, salt)
    assert len(h) == len(DOC) // PAGE, "only full pages are named"
    assert chain_hashes(DOC[:40], PAGE, salt) == h[:2], "a page's name depends on the tokens up to it only"
    edited = DOC[:5] + [DOC[5] ^ 1] + DOC[6:]
    he = chain_hashes(edited, PAGE, salt)
    assert not set(he) & set(h), "an edit in page 0 renames every page after it"
    assert chain_hashes(DOC[32:], PAGE, h[1]) == h[2:], "the chain continues from a page's hash"


@pytest.mark.parametrize("change", [{"model": "other"}, {"rank": 4}, {"page_size": 32}, {"basis_bits": 8},
                                    {"dtype": "torch.bfloat16"}])
def test_another_salt_never_matches(change):
    base = {"model": "m", "rank": 8, "page_size": PAGE, "basis_bits": 4, "dtype": "torch.float32"}
    a, b = cache_salt(**base), cache_salt(**{**base, **change})
    assert a != b
    assert not set(chain_hashes(DOC, PAGE, a)) & set(chain_hashes(DOC, PAGE, b)), change


def test_engines_salt_differs_with_rank_and_page_size(tiny):
    salts = {Engine(*tiny, CacheConfig(tier="hbm", **kw), device="cpu", max_pages=64)._salt()
             for kw in ({}, {"rank": 4}, {"page_size": 32, "budget_tokens": 512}, {"basis_bits": 8})}
    assert len(salts) == 4


# ---- the cache ---------------------------------------------------------------------------------


def test_references_and_lru_eviction_never_take_a_page_in_use():
    cache = PrefixCache(b"s", PAGE)
    for pid, d in enumerate((b"a", b"b", b"c")):
        assert cache.insert(d, pid)
    assert not cache.insert(b"a", 9) and not cache.insert(b"z", 0), "a digest or an id is cached once"
    assert cache.match([b"a", b"b", b"x", b"c"]) == [0, 1], "the longest run from page 0"
    cache.release([2, 0])  # idle in this order: 2 then 0; page 1 still has its sequence
    cache.acquire([0])  # reused: no longer idle
    assert cache.evict(5) == [2], "only idle pages are evicted"
    cache.release([0])
    cache.release([1])
    assert cache.evict(1) == [0] and cache.evict(1) == [1], "least recently released first"
    with pytest.raises(ValueError, match="released more often"):
        cache.insert(b"q", 3)
        cache.release([3])
        cache.release([3])


# ---- the engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["hbm", "host", "host+nvme"])
def test_warm_requests_equal_cold_ones(tiny, tier, tmp_path):
    """The same prompt again and the document with another question reuse its pages exactly: the
    same greedy tokens as a cold engine's, cached_tokens every full page but the last token's."""
    budget = {"budget_tokens": 64}  # 4 pages: the 300-token prompts are pruned
    cold = make_engine(tiny, tmp_path / "cold", tier=tier, prefix_reuse=False, **budget)
    want = run(cold, {"q1": (DOC + Q1, greedy()), "q2": (DOC + Q2, greedy())})
    engine = make_engine(tiny, tmp_path / "warm", tier=tier, **budget)
    cached = {}
    for rid, ids in (("first", DOC + Q1), ("repeat", DOC + Q1), ("other", DOC + Q2)):
        engine.add_request(rid, ids, greedy())
        got = []
        while engine.has_unfinished():
            for out in engine.step():
                got += out.token_ids
                cached[rid] = out.num_cached_tokens
        assert got == want["q1" if rid != "other" else "q2"], f"{tier}: {rid}"
    assert cached == {"first": 0, "repeat": (len(DOC + Q1) - 1) // PAGE * PAGE,
                      "other": len(DOC) // PAGE * PAGE}, cached
    stats = engine.stats()
    assert stats["prefix_hits"] == 2 and stats["pages_used"] == 0, stats
    engine.close()
    cold.close()


def test_concurrent_sharers_finish_in_any_order(tiny):
    """Three requests share a document's pages while they run; whichever finishes first, the
    pages stay until the last reader is done, then idle (reclaimable), and tokens are unchanged."""
    engine = make_engine(tiny, max_num_seqs=4)
    first = run(engine, {"seed": (DOC + Q1, greedy(2))})["seed"]
    lengths = {"a": 30, "b": 3, "c": 12}  # b finishes first, then c, then a
    for rid, n in lengths.items():
        engine.add_request(rid, DOC + Q1, greedy(n))
    out = {rid: [] for rid in lengths}
    for o in engine.step():  # all three admitted, each holding the document's cached pages
        out[o.request_id] += o.token_ids
    doc_pids = engine.scheduler.find("a").pids[: len(DOC) // PAGE]
    assert all(engine.prefix.refs(p) == 3 for p in doc_pids)
    refs_seen = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
            if o.finished:
                refs_seen.append(engine.prefix.refs(doc_pids[0]))
    assert refs_seen == [2, 1, 0], refs_seen
    assert all(toks[:2] == first for toks in out.values())
    assert engine.stats()["pages_used"] == 0
    assert engine.prefix.num_idle == len(engine.prefix)


def test_eviction_under_pressure_spares_pages_in_use(tiny):
    """With ids for about two requests, a new document may evict only idle cached pages (LRU):
    while a running request reads the cached ones, the newcomer waits; when it ends, they go.
    Tokens stay those of an engine without reuse."""
    from lockserve.workers.engine.sequence import SequenceStatus

    engine = make_engine(tiny, max_pages=40, max_num_seqs=2)
    plain = make_engine(tiny, max_pages=40, max_num_seqs=2, prefix_reuse=False)
    docs = [torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(s)).tolist()
            for s in range(2)]
    run(engine, {"d0": (docs[0] + Q1, greedy(2))})  # 20 pages cached, idle
    out = {"long": [], "d1": []}
    engine.add_request("long", docs[0] + Q2, greedy(40))  # reuses 18 of them, 5 ids of its own
    engine.add_request("d1", docs[1] + Q1, greedy(4))  # 21 ids: 15 free + 2 idle is not enough
    held = None
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
        if engine.request_status("long") is SequenceStatus.RUNNING:
            held = held or engine.scheduler.find("long").pids[:18]
            assert engine.request_status("d1") is SequenceStatus.WAITING, "d1 would need a page in use"
            assert all(engine.prefix.owns(p) and engine.prefix.refs(p) == 1 for p in held)
    assert held is not None and engine.stats()["prefix_evicted_pages"] > 0
    want = run(plain, {"long": (docs[0] + Q2, greedy(40)), "d1": (docs[1] + Q1, greedy(4))})
    assert out == want


def test_abort_mid_prefill_keeps_its_full_pages(tiny):
    """A request aborted after two chunks leaves its computed full pages cached; a later request
    with that prompt reuses them and gets a cold request's tokens."""
    engine = make_engine(tiny, chunk=64, batched=64)
    engine.add_request("gone", DOC + Q1, greedy())
    engine.step()
    engine.step()  # 128 tokens computed: 8 full pages
    assert engine.abort("gone")
    assert len(engine.prefix) == 8 and engine.stats()["pages_used"] == 0
    engine.add_request("next", DOC + Q1, greedy())
    got, cached = [], None
    while engine.has_unfinished():
        for o in engine.step():
            got += o.token_ids
            cached = o.num_cached_tokens
    cold = make_engine(tiny, chunk=64, batched=64, prefix_reuse=False)
    assert cached == 128 and got == run(cold, {"x": (DOC + Q1, greedy())})["x"]


def test_stand_in_fills_are_never_shared(tiny):
    """A synthetic fill's random K/V are not the model's: its pages never enter the cache."""
    engine = make_engine(tiny)
    engine.add_request("syn", DOC, greedy(2))
    engine.fill_synthetic("syn")
    while engine.has_unfinished():
        engine.step()
    assert len(engine.prefix) == 0
    engine.add_request("real", DOC, greedy(2))
    engine.step()
    assert engine.scheduler.find("real").num_cached == 0


def test_prefill_steps_shrink_while_others_decode(tiny):
    """scheduler.prefill_chunk_decoding caps a step's prompt tokens while a request decodes (and
    only then); tokens are unchanged."""
    from lockserve.configs.schema import SchedulerConfig

    engine = make_engine(tiny, chunk=64, batched=96)
    engine.scheduler.prefill_chunk_decoding = 16
    engine.add_request("decoder", DOC[:40], greedy(30))
    while not engine.scheduler.find("decoder").output_ids:
        engine.step()
    long = DOC[::-1] + Q1  # shares no page with the decoder's prompt
    engine.add_request("long", long, greedy(2))
    sizes = []
    while engine.scheduler.find("long") is not None and engine.scheduler.find("long").in_prefill:
        batch_before = engine.scheduler.find("long").num_computed
        engine.step()
        seq = engine.scheduler.find("long")
        sizes.append((seq.num_computed if seq else len(long)) - batch_before)
    assert max(sizes) == 16, sizes
    assert SchedulerConfig(prefill_chunk_decoding=16).prefill_chunk_decoding == 16
    with pytest.raises(ValueError):
        SchedulerConfig(prefill_chunk_decoding=0)


# ---- kept copies: a cached document's pages read in HBM by the next prefill (host tiers) ------


def count_tier_reads(engine) -> list[int]:
    """Pages (x layers x KV heads) that prefill chunks read back from the tier from now on (the
    decodes read through the hot cache, not `read`)."""
    reads: list[int] = []
    read = engine.kv.settled.read
    engine.kv.settled.read = lambda slots: reads.append(slots.numel()) or read(slots)
    return reads


@pytest.mark.parametrize("tier", ["host", "host+nvme"])
@pytest.mark.parametrize("window_tokens,kept", [(4096, 20), (64, 4)])
def test_a_warm_prefill_reads_the_kept_copies_not_the_tier(tiny, tier, window_tokens, kept, tmp_path):
    """After a prefill ends its settled pages stay in the write pool: the repeat reads the pages
    kept there (all 20 with a window that holds the prompt; the last 4 with a window of 4 pages)
    and only the rest from the tier, and gives the cold request's tokens."""
    cfg = tiny[0].config
    per_page = cfg.num_layers * cfg.num_kv_heads
    engine = make_engine(tiny, tmp_path / "warm", tier=tier, budget_tokens=64,
                         prefill_window_tokens=window_tokens)
    first = run(engine, {"first": (DOC + Q1, greedy())})["first"]
    assert engine.stats()["prefill_kept_pages"] == kept
    reads = count_tier_reads(engine)
    repeat = run(engine, {"repeat": (DOC + Q1, greedy())})["repeat"]
    assert engine.stats()["prefill_kept_pages_read"] == kept
    assert sum(reads) == (20 - kept) * per_page, (sum(reads), kept)
    cold = make_engine(tiny, tmp_path / "cold", tier=tier, budget_tokens=64, prefix_reuse=False)
    assert first == repeat == run(cold, {"x": (DOC + Q1, greedy())})["x"]
    engine.close()
    cold.close()


def test_kept_copies_give_way_to_new_pages_and_leave_with_their_ids(tiny):
    """A kept copy is a spare location: once none is free, a new prefill takes the least recently
    used copies (the repeat then reads those pages from the tier, and the rest in HBM: same
    tokens), and a page id the prefix cache evicts loses its copy (a new page under that id never
    reads the old bytes)."""
    cfg = tiny[0].config
    per_page = cfg.num_layers * cfg.num_kv_heads
    docs = [torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(s)).tolist()
            for s in range(3)]
    engine = make_engine(tiny, tier="host", budget_tokens=64, prefill_window_tokens=320, max_pages=45)
    plain = make_engine(tiny, tier="host", budget_tokens=64, prefill_window_tokens=320, max_pages=45,
                        prefix_reuse=False)
    want = run(plain, {"d0": (docs[0] + Q1, greedy(4))})["d0"]
    assert run(engine, {"d0": (docs[0] + Q1, greedy(4))})["d0"] == want
    d0 = list(engine.kv._kept)  # its 20 pages' ids in page order (oldest use first)
    assert len(d0) == 20 and engine.kv.write_rows == 33  # 13 tail locations and a window of 20
    run(engine, {"d1": (docs[1] + Q1, greedy(4))})  # 13 free locations, then d0's oldest copies
    left = [p for p in d0 if p in engine.kv._kept]
    assert 0 < len(left) < 20 and left == d0[20 - len(left):], left
    reads = count_tier_reads(engine)
    assert run(engine, {"again": (docs[0] + Q1, greedy(4))})["again"] == want
    assert engine.stats()["prefill_kept_pages_read"] == len(left)
    assert sum(reads) == (20 - len(left)) * per_page, sum(reads)
    run(engine, {"d2": (docs[2] + Q1, greedy(4))})  # 45 ids: cached pages are evicted
    assert engine.stats()["prefix_evicted_pages"] > 0
    assert all(engine.prefix.owns(p) for p in engine.kv._kept), "a freed id kept its copy"
    assert engine.kv.num_free_tail_pages == engine.kv.write_rows
    engine.close()
    plain.close()
