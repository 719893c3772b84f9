"""The hot-page cache's reference: a pure-Python set-associative LRU with staging rows,
decode-like selection sequences (distinct slots per step, padding entries, overlap and churn),
pages outside the cache (`random_outside`) and `check_step`, one lookup compared to the model
(CPU and GPU tests)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tests.offload.conftest import bits


def set_of(slot: int, num_sets: int) -> int:
    """Fibonacci hashing: the low 32 bits of slot * 0x61C88647, scaled to [0, num_sets)."""
    return (((slot * 0x61C88647) & 0xFFFFFFFF) * num_sets) >> 32


@dataclass(frozen=True)
class Step:
    idx: list[int]  # pool row of each request: a hit's entry, C + i for a miss, 0 for padding
    hits: int
    misses: int
    not_installed: int


class SetLruModel:
    """num_sets x ways entries; entry k * ways + w is way w of set k; staging rows follow them.

    A call marks its hits (last = step) first; then each set's misses, in request order, take
    the set's ways not hit in this call, by (last, way) ascending; the rest are not installed.
    The step advances after the call, or (advance=False, the "inline" commit) only by `advance`.
    """

    def __init__(self, num_sets: int, ways: int):
        self.num_sets, self.ways, self.capacity = num_sets, ways, num_sets * ways
        self.tags = [[-1] * ways for _ in range(num_sets)]
        self.last = [[-1] * ways for _ in range(num_sets)]
        self.steps = 0

    def advance(self) -> None:
        self.steps += 1

    def step(self, slots: list[int], advance: bool = True) -> Step:
        assert len({s for s in slots if s >= 0}) == len([s for s in slots if s >= 0]), "slots repeat"
        t, w_all = self.steps, self.ways
        self.steps += int(advance)
        idx, hits, misses_of_set, hit_ways = [0] * len(slots), 0, {}, set()
        for i, s in enumerate(slots):
            if s < 0:
                continue
            k = set_of(s, self.num_sets)
            if s in self.tags[k]:
                w = self.tags[k].index(s)
                self.last[k][w], idx[i], hits = t, k * w_all + w, hits + 1
                hit_ways.add((k, w))
            else:
                idx[i] = self.capacity + i
                misses_of_set.setdefault(k, []).append(s)
        not_installed = 0
        for k, missed in misses_of_set.items():
            free = sorted((self.last[k][w], w) for w in range(w_all) if (k, w) not in hit_ways)
            for (_, w), s in zip(free, missed, strict=False):
                self.tags[k][w], self.last[k][w] = s, t
            not_installed += max(0, len(missed) - len(free))
        misses = sum(len(m) for m in misses_of_set.values())
        return Step(idx, hits, misses, not_installed)

    def invalidate(self, slots: list[int]) -> None:
        for s in slots:
            k = set_of(s, self.num_sets) if s >= 0 else None
            if k is not None and s in self.tags[k]:
                w = self.tags[k].index(s)
                self.tags[k][w] = self.last[k][w] = -1

    def cached(self) -> set[int]:
        return {s for row in self.tags for s in row if s >= 0}


def selections(num_slots: int, steps: int, max_m: int, seed: int, pad_to: int | None = None):
    """Decode-like selections of distinct slots: a sticky set requested every step, a hot set
    reused with churn, fresh noise, in shuffled order, and -1 padding (up to pad_to entries)."""
    rng = random.Random(seed)
    sticky = rng.sample(range(num_slots), max(1, max_m // 4))
    hot = rng.sample(range(num_slots), max_m)
    for _ in range(steps):
        m = rng.randint(1, max_m)
        picks = list(sticky)
        picks += [rng.choice(hot) if rng.random() < 0.7 else rng.randrange(num_slots) for _ in range(m)]
        for _ in range(max(1, max_m // 8)):  # churn of the hot set
            hot[rng.randrange(len(hot))] = rng.randrange(num_slots)
        picks = list(dict.fromkeys(picks))[:m]
        for _ in range(rng.randint(0, 2)):
            picks.insert(rng.randrange(len(picks) + 1), -1)
        rng.shuffle(picks)
        picks = picks[:max_m]
        if pad_to is not None:
            picks += [-1] * (pad_to - len(picks))
        yield picks


def random_outside(slots: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, rows) for lookup_and_fill's `outside`, as the engine passes them: some padding
    entries are pages outside the cache (its open pages), with rows past the cache's pool."""
    mask = (slots.cpu() < 0) & (torch.rand(slots.shape, generator=g) < 0.5)
    rows = torch.where(mask, 10_000 + torch.arange(slots.numel()), -1)
    return mask.to(slots.device), rows.to(slots.device)


def check_step(cache, model: SetLruModel, src, sel: list[int], t: int, pages: torch.Tensor | None = None):
    """One lookup of `sel` in `cache` (a HotPageCache): idx, counters, tables and the returned
    pages' bytes equal the model's. pages: the arena as a CPU tensor (default: src)."""
    before = cache.stats()
    slots = torch.tensor(sel, dtype=torch.int64, device=cache.device)
    idx = cache.lookup_and_fill(slots, src)
    want = model.step(sel)
    after = cache.stats()
    assert idx.tolist() == want.idx, f"step {t}: idx differs for {sel}"
    got = (after.hits - before.hits, after.misses - before.misses, after.not_installed - before.not_installed)
    assert got == (want.hits, want.misses, want.not_installed), f"step {t}: hits, misses, not installed"
    assert after.requests - before.requests == want.hits + want.misses and after.steps == before.steps + 1
    assert after.bytes_moved_last_step == want.misses * cache.geometry.slot_bytes, f"step {t}"
    assert cache.tags.tolist() == model.tags, f"step {t}: tags differ"
    assert cache.last_used.tolist() == model.last, f"step {t}: last_used differs"
    valid = slots >= 0
    expected = (src if pages is None else pages)[slots[valid].cpu()]
    assert torch.equal(bits(cache.pool[idx[valid]].cpu()), bits(expected)), f"step {t}: page bytes"
