"""Routing long prompts to the worker whose prefix cache holds their first tokens."""

from __future__ import annotations

from lockserve.cluster.ray_client import AFFINITY_SLACK, PrefixAffinity

DOC = list(range(3000))


def test_a_long_prompt_follows_its_document_unless_that_worker_is_too_busy():
    aff = PrefixAffinity(tokens=1024)
    key = aff.key(DOC + [1, 2])
    assert key == aff.key(DOC + [7]) and key != aff.key(list(reversed(DOC))), "the first 1,024 tokens key it"
    assert aff.choose(key, [0, 1], [1, 0]) == 1, "first seen: the least loaded"
    assert aff.choose(key, [0, 1], [0, AFFINITY_SLACK]) == 1, "within the slack: back to its worker"
    assert aff.choose(key, [0, 1], [0, AFFINITY_SLACK + 1]) == 0, "too busy: the least loaded takes it"
    assert aff.choose(key, [1], [5, 0]) == 1 and aff.choose(key, [0], [0, 0]) == 0, "only ready workers"


def test_short_prompts_are_placed_by_load_alone():
    aff = PrefixAffinity(tokens=1024)
    assert aff.key(DOC[:1023]) is None
    assert aff.choose(None, [0, 1, 2], [2, 1, 1]) == 1


def test_the_table_is_bounded():
    aff = PrefixAffinity(tokens=4, entries=3)
    for i in range(5):
        aff.choose(aff.key([i, 0, 0, 0]), [0, 1], [i % 2, (i + 1) % 2])
    assert len(aff._where) == 3 and aff.key([0, 0, 0, 0]) not in aff._where
