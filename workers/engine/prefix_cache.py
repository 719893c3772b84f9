"""Prefix reuse: full KV pages shared exactly between requests, keyed by a hash chain of tokens.

A page's K/V and its LOCKS summary depend only on the tokens up to and including that page
(causal attention), and on what turns tokens into bytes: the model, the KV dtype, the page size,
RoPE, the summary's rank and bits, the page selector. So page j of a prompt is named by
    h_j = H(h_{j-1} || tokens[j*B : (j+1)*B]),    h_{-1} = H(salt of all of the above),
and two requests whose first j+1 pages carry the same tokens can share those pages' ids: the
tier's bytes and the summaries stay where they are. Only full pages are ever shared (the open
page of a sequence is its own), and a shared page is read-only: a request that reuses m pages
starts its prefill at token m*B, so its writes land in pages of its own.

`PrefixCache` owns the page ids of the pages it holds. Each has a reference count (the running
sequences that read it); one at zero is idle, and idle pages are evicted least recently used
first when admission needs ids. The scheduler is its only user (scheduler.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

DIGEST_BYTES = 16


def cache_salt(**facts) -> bytes:
    """The chain's seed from everything that changes a page's bytes or summary (model config,
    dtype, page size, rank, bits, selector, ...): keyword facts, hashed in sorted order of name."""
    text = repr(sorted((k, repr(v)) for k, v in facts.items()))
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


def chain_hashes(tokens: Sequence[int], page_size: int, previous: bytes) -> list[bytes]:
    """Chain hashes of the full pages of `tokens` (which start at a page boundary), continuing the
    chain from `previous`: the hash of the page before them, or the salt for page 0."""
    h, out = previous, []
    for j in range(len(tokens) // page_size):
        page = tokens[j * page_size : (j + 1) * page_size]
        h = hashlib.blake2b(h + struct.pack(f"<{page_size}q", *page), digest_size=DIGEST_BYTES).digest()
        out.append(h)
    return out


@dataclass
class CachedPage:
    pid: int
    digest: bytes
    refs: int


@dataclass
class PrefixStats:
    """Counters since the cache was made (monotonic, for /metrics)."""

    queries: int = 0  # admissions that looked the cache up
    hits: int = 0  # ... that reused at least one page
    cached_tokens: int = 0  # prompt tokens served from the cache
    prompt_tokens: int = 0  # prompt tokens of the admissions that looked it up
    inserted_pages: int = 0
    evicted_pages: int = 0


class PrefixCache:
    """Full pages by chain hash. Invariant: every page id here is owned by the cache (not free, not
    a sequence's own); refs counts the sequences reading it; idle = refs 0, in LRU order."""

    def __init__(self, salt: bytes, page_size: int):
        self.salt, self.page_size = salt, page_size
        self._by_digest: dict[bytes, CachedPage] = {}
        self._by_pid: dict[int, CachedPage] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._by_pid)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._by_digest

    def idle_pids(self) -> list[int]:
        """Ids of the idle pages, least recently used first."""
        return list(self._idle)

    def owns(self, pid: int) -> bool:
        return pid in self._by_pid

    def refs(self, pid: int) -> int:
        return self._by_pid[pid].refs

    def match(self, digests: Sequence[bytes]) -> list[int]:
        """Page ids of the longest run of `digests` (pages 0, 1, ...) that the cache holds."""
        pids = []
        for d in digests:
            page = self._by_digest.get(d)
            if page is None:
                break
            pids.append(page.pid)
        return pids

    def acquire(self, pids: Sequence[int]) -> None:
        """A sequence reads these pages: one more reference each (an idle one stops being idle)."""
        for pid in pids:
            page = self._by_pid[pid]
            page.refs += 1
            self._idle.pop(pid, None)

    def release(self, pids: Sequence[int]) -> None:
        """A sequence stopped reading these pages; one at zero references becomes the most recent idle."""
        for pid in pids:
            page = self._by_pid[pid]
            if page.refs <= 0:
                raise ValueError(f"page id {pid}: released more often than acquired")
            page.refs -= 1
            if page.refs == 0:
                self._idle[pid] = None

    def insert(self, digest: bytes, pid: int) -> bool:
        """Take ownership of a sequence's full page `pid` named `digest`, with one reference (the
        sequence's). False (nothing changes) when the cache has that digest already or that id."""
        if digest in self._by_digest or pid in self._by_pid:
            return False
        page = CachedPage(pid, digest, 1)
        self._by_digest[digest] = self._by_pid[pid] = page
        self.stats.inserted_pages += 1
        return True

    def evict(self, n: int) -> list[int]:
        """Drop up to n idle pages, least recently used first; returns their ids (now the caller's
        to free). Never a page with references."""
        out = []
        while self._idle and len(out) < n:
            pid, _ = self._idle.popitem(last=False)
            page = self._by_pid.pop(pid)
            del self._by_digest[page.digest]
            out.append(pid)
        self.stats.evicted_pages += len(out)
        return out

    def note_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        s = self.stats
        s.queries, s.prompt_tokens, s.cached_tokens = s.queries + 1, s.prompt_tokens + prompt_tokens, \
            s.cached_tokens + cached_tokens
        s.hits += cached_tokens > 0
