"""Admission of context-parallel requests as pure functions: which ranks hold which pages."""

from __future__ import annotations

import itertools
import random

import pytest
from lockserve.cluster.cp_placement import NoCapacity, RankSet, ShardRange, balance, plan_shards
from lockserve.cluster.placement import NodeInfo


def check_layout(ranges: list[ShardRange], free: dict[int, int], total: int, tail: int, sink: int = 1
                 ) -> None:
    assert ranges[0].first_page == 0 and ranges[0].num_pages >= sink, "rank 0 holds the sink"
    for a, b in itertools.pairwise(ranges):
        assert b.first_page == a.first_page + a.num_pages, "contiguous ranges in page order"
    assert ranges[-1].first_page + ranges[-1].num_pages == total
    assert ranges[-1].num_pages >= tail, "every page from the first new token's on is on the last rank"
    assert all(r.num_pages <= free[r.index] for r in ranges)
    assert len({r.index for r in ranges}) == len(ranges)


def test_the_fewest_ranks_that_hold_it_balanced():
    free = {0: 100, 1: 100, 2: 100}
    ranges = plan_shards(free, 150, 10)
    check_layout(ranges, free, 150, 10)
    assert [r.num_pages for r in ranges] == [75, 75]
    assert [r.index for r in ranges] == [1, 0], "the most free pages (lowest index on ties) go last"
    assert len(plan_shards(free, 100, 10)) == 1


def test_the_last_rank_takes_the_growth_of_the_sequence():
    free = {0: 300, 1: 400}
    assert [r.num_pages for r in plan_shards(free, 500, 10)] == [250, 250]
    ranges = plan_shards(free, 500, 350)  # the prompt ends 350 pages before the request's last page
    check_layout(ranges, free, 500, 350)
    assert [(r.index, r.num_pages) for r in ranges] == [(0, 150), (1, 350)]


def test_an_exact_shard_count_and_the_refusals():
    free = {0: 100, 1: 100, 2: 100, 3: 5}
    ranges = plan_shards(free, 60, 5, shards=3)
    check_layout(ranges, free, 60, 5)
    assert [r.num_pages for r in ranges] == [20, 20, 20]
    with pytest.raises(NoCapacity, match="free pages by rank"):
        plan_shards(free, 306, 5)  # 305 pages free in all
    with pytest.raises(NoCapacity):
        plan_shards({0: 100, 1: 100}, 150, 120)  # no rank takes the 120-page tail and the rest fit
    with pytest.raises(NoCapacity):
        plan_shards({0: 3, 1: 3}, 4, 1, sink_pages=4, shards=2)  # rank 0 must hold the 4 sink pages
    with pytest.raises(NoCapacity):
        plan_shards({}, 1, 1)


def test_balance_is_the_lowest_max_within_the_bounds():
    rng = random.Random(0)
    for _ in range(300):
        m = rng.randint(1, 4)
        floors = [rng.randint(0, 4) for _ in range(m)]
        caps = [f + rng.randint(0, 6) for f in floors]
        total = rng.randint(0, sum(caps) + 2)
        sizes = balance(total, floors, caps)
        choices = (range(f, c + 1) for f, c in zip(floors, caps, strict=True))
        feasible = [s for s in itertools.product(*choices) if sum(s) == total]
        if not feasible:
            assert sizes is None, (total, floors, caps)
            continue
        assert sizes is not None and sum(sizes) == total, (total, floors, caps, sizes)
        assert all(f <= s <= c for f, s, c in zip(floors, sizes, caps, strict=True))
        assert max(sizes) == min(max(s) for s in feasible), (total, floors, caps, sizes)


def test_the_workers_plan_around_the_ranks_bundles():
    nodes = [NodeInfo("a", "10.0.0.1", 8, 64, True), NodeInfo("b", "10.0.0.2", 8, 64, True)]
    ranks = RankSet(None, {"CPU": 1.0, "GPU": 1.0}, ["b", "a"])
    assert [(n.gpus, n.cpus) for n in ranks.remaining(nodes)] == [(7, 63), (7, 63)]
    cpu_ranks = RankSet(None, {"CPU": 1.0}, ["a", "a"])
    assert [(n.gpus, n.cpus) for n in cpu_ranks.remaining(nodes)] == [(8, 62), (8, 64)]
