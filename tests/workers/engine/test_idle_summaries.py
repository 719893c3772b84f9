"""Idle cached prefixes' summaries off the device table past cache.idle_summary_gib (tiny preset,
CPU, real tiers): the least recently used idle pages' rows leave (their table rows zeroed) and come
back bitwise when a request reuses them; the bytes of idle rows left in the table never exceed the
budget; a request over a prefix whose summaries were moved gives a cold request's greedy tokens.
The feature is off by default (cache.idle_summary_gib None): every test here sets a budget."""

from __future__ import annotations

import pydantic
import pytest
import torch
from lockserve.configs.schema import CacheConfig
from lockserve.workers.engine.prefix_cache import chain_hashes

from tests.workers.engine.test_engine import greedy, make_engine, run

PAGE = 16
GIB = 1 << 30
_G = torch.Generator().manual_seed(5)
DOC_A, DOC_B = (torch.randint(0, 256, (300,), generator=_G).tolist() for _ in range(2))  # 18 full pages
Q1, Q2 = (torch.randint(0, 256, (21,), generator=_G).tolist() for _ in range(2))  # prompts: 20 pages
BUDGET = {"budget_tokens": 64}  # 4 pages of 20: selections depend on the summaries

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    from lockserve.workers.model.presets import build_preset

    return build_preset("tiny", seed=0, device="cpu")


@pytest.fixture(scope="module")
def page_bytes(tiny):
    """Summary bytes of one page id (all layers and KV heads)."""
    engine = make_engine(tiny, idle_summary_gib=1.0, **BUDGET)
    lay = engine.kv.layout
    want = lay.num_layers * lay.num_kv_heads * engine.kv.summaries.bytes_per_page
    assert engine.idle.bytes_per_page == want, engine.idle.bytes_per_page
    return want


def engine_with(tiny, tmp_path, tier: str, pages: int, page_bytes: int, **kw):
    """An engine whose idle-summary budget holds `pages` page ids' summaries."""
    return make_engine(tiny, tmp_path, tier=tier, idle_summary_gib=pages * page_bytes / GIB, **BUDGET, **kw)


def rows_of(engine, pids: list[int]) -> dict[str, torch.Tensor]:
    return engine.kv.summaries.page_rows(torch.tensor(pids))


def serve(engine, rid: str, ids: list[int], n: int = 12, on_step=None) -> list[int]:
    """Greedy tokens of one request served alone; on_step(seq) runs after each of its steps."""
    engine.add_request(rid, ids, greedy(n))
    got = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.token_ids
        seq = engine.scheduler.find(rid)
        if on_step is not None and seq is not None:
            on_step(seq)
    return got


def check_budget(engine, what: str) -> None:
    stats = engine.stats()
    in_table = sum(engine.idle.is_resident(p) for p in engine.prefix.idle_pids()) * engine.idle.bytes_per_page
    assert stats["idle_summary_hbm_bytes"] == in_table <= engine.idle.budget_bytes, f"{what}: {stats}"


def cached_pids(engine, doc: list[int], pages: int) -> list[int]:
    """Page ids the prefix cache holds for doc's first `pages` full pages (all of them, asserted)."""
    pids = engine.prefix.match(chain_hashes(doc, PAGE, engine.prefix.salt)[:pages])
    assert len(pids) == pages, f"{len(pids)} of {pages} pages cached"
    return pids


@pytest.mark.parametrize("tier", ["hbm", "host", "host+nvme"])
@pytest.mark.parametrize("kept", [5, 0])
def test_summaries_leave_and_come_back_bitwise(tiny, tmp_path, page_bytes, tier, kept):
    cold = make_engine(tiny, tmp_path / "cold", tier=tier, prefix_reuse=False, **BUDGET)
    want = run(cold, {"b": (DOC_A + Q2, greedy())})["b"]
    cold.close()
    engine = engine_with(tiny, tmp_path / "warm", tier, kept, page_bytes)
    computed = {}

    def capture(seq):  # once a's prompt is prefilled (all its pages summarised, in use)
        if not seq.in_prefill and not computed:
            computed.update(rows_of(engine, seq.pids[:18]))

    serve(engine, "a", DOC_A + Q1, n=2, on_step=capture)
    assert computed and all(torch.count_nonzero(t) > 0 for t in computed.values()), "a's rows as computed"
    pids = cached_pids(engine, DOC_A + Q1, 20)
    moved = [p for p in pids if not engine.idle.is_resident(p)]
    # a sequence's pages go idle last page first: the chain's tail is the least recently used
    assert moved == pids[kept:], f"{tier}: the tail of the chain leaves first, got {moved}"
    assert all(torch.count_nonzero(t) == 0 for t in rows_of(engine, moved).values()), "moved rows are zeroed"
    check_budget(engine, f"{tier} after a")
    assert engine.stats()["idle_summary_host_bytes"] == (20 - kept) * page_bytes

    reused = {}

    def after_admission(seq):
        if not reused:
            reused.update(pids=seq.pids[:18], rows=rows_of(engine, seq.pids[:18]), cached=seq.num_cached)

    got = serve(engine, "b", DOC_A + Q2, on_step=after_admission)
    assert reused["cached"] == 18 * PAGE and reused["pids"] == pids[:18], reused["cached"]
    for name, t in computed.items():
        assert torch.equal(reused["rows"][name], t), f"{tier}: {name} came back bitwise"
    assert got == want, f"{tier}: a request over moved summaries gives a cold request's tokens"
    check_budget(engine, f"{tier} after b")
    assert engine.stats()["idle_summary_in_pages"] == 18 - kept, engine.stats()
    engine.close()


def test_rows_that_leave_are_the_rows_that_come_back(tiny, tmp_path, page_bytes):
    """Every row of a document, read while in use, equals the row read after it left the table
    (budget 0) and came back with a reuse, byte for byte."""
    engine = engine_with(tiny, tmp_path, "host", 0, page_bytes)
    serve(engine, "a", DOC_A + Q1, n=2)
    engine.add_request("hold", DOC_A + Q1, greedy(30))
    engine.step()  # admitted: all 19 reusable pages of the prompt back in the table, in use
    pids = cached_pids(engine, DOC_A, 18)
    in_use = rows_of(engine, pids)
    assert all(engine.idle.is_resident(p) for p in pids)
    assert engine.abort("hold")  # idle again, and out: budget 0
    assert not any(engine.idle.is_resident(p) for p in pids), "budget 0: every idle row leaves"
    assert all(torch.count_nonzero(t) == 0 for t in rows_of(engine, pids).values())
    engine.add_request("again", DOC_A + Q2, greedy(1))
    engine.step()
    back = rows_of(engine, pids)
    for name, t in in_use.items():
        assert torch.equal(back[name], t), f"field {name} came back bitwise"
    engine.close()


def test_least_recently_used_prefix_leaves_first(tiny, tmp_path, page_bytes):
    """Budget of 20 pages: a document's summaries leave when a newer one goes idle, and come back
    (sending the other out) when a request reuses it."""
    engine = engine_with(tiny, tmp_path, "hbm", 20, page_bytes)
    serve(engine, "a", DOC_A + Q1, n=2)
    serve(engine, "b", DOC_B + Q1, n=2)
    a, b = cached_pids(engine, DOC_A, 18), cached_pids(engine, DOC_B, 18)
    assert not any(engine.idle.is_resident(p) for p in a), "a, idle longest, left"
    assert all(engine.idle.is_resident(p) for p in b), "b, idle last, stayed"
    check_budget(engine, "after b")
    serve(engine, "a2", DOC_A + Q2, n=2)
    assert all(engine.idle.is_resident(p) for p in a), "a came back with its reuse and stayed"
    assert not any(engine.idle.is_resident(p) for p in b), "b is now the least recently used"
    check_budget(engine, "after a2")


def test_idle_summary_gib_is_validated():
    with pytest.raises(pydantic.ValidationError, match="idle_summary_gib"):
        CacheConfig(idle_summary_gib=-1)
    assert CacheConfig(idle_summary_gib=0).idle_summary_gib == 0


def test_off_by_default_nothing_leaves(tiny, tmp_path):
    """Default (None): no IdleSummaries at all; a document's rows stay in the table after its
    request ends, so a reuse brings nothing back."""
    assert CacheConfig().idle_summary_gib is None
    engine = make_engine(tiny, tmp_path, tier="host", **BUDGET)
    assert engine.idle is None and engine.scheduler.on_reuse is None
    serve(engine, "a", DOC_A + Q1, n=2)
    pids = cached_pids(engine, DOC_A, 18)
    assert all(torch.count_nonzero(t) > 0 for t in rows_of(engine, pids).values()), "idle rows stay put"
    assert not any(k.startswith("idle_summary") for k in engine.stats()), engine.stats()
    engine.close()
