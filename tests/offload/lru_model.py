"""The hot-page cache's reference: a pure-Python LRU model, and decode-like selection sequences."""

from __future__ import annotations

import random


class LruModel:
    """Exact LRU over steps; ties (same last step) evicted by lower slot; free room used first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.last: dict[int, int] = {}

    def step(self, t: int, slots: list[int]) -> tuple[int, int]:
        distinct = list(dict.fromkeys(slots))
        misses = [s for s in distinct if s not in self.last]
        overflow = len(self.last) + len(misses) - self.capacity
        if overflow > 0:
            candidates = sorted((v, s) for s, v in self.last.items() if s not in set(distinct))
            for _, s in candidates[:overflow]:
                del self.last[s]
        for s in distinct:
            self.last[s] = t
        return len(distinct) - len(misses), len(misses)

    def invalidate(self, slots: list[int]) -> None:
        for s in slots:
            self.last.pop(s, None)


def selections(num_slots: int, steps: int, max_m: int, seed: int):
    """Decode-like selections: a sink page, a drifting recent window, a reused hot set, noise, duplicates."""
    rng = random.Random(seed)
    hot = rng.sample(range(num_slots), max_m)
    for t in range(steps):
        m = rng.randint(1, max_m)
        picks = [0, min(num_slots - 1, t)]
        picks += [rng.choice(hot) if rng.random() < 0.6 else rng.randrange(num_slots) for _ in range(m)]
        if rng.random() < 0.2:
            hot[rng.randrange(len(hot))] = rng.randrange(num_slots)
        if rng.random() < 0.3:
            picks.append(picks[rng.randrange(len(picks))])  # a duplicate within the request
        yield picks[:max_m]
