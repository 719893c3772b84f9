"""Accounting of where pages live and what crossed the bus: plain data for metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class OffloadStats:
    """What a PageSource reports from `stats()` (read outside the decode step).

    bytes_resident: bytes held per tier ("hbm", "host", "nvme", "cache").
    hits / misses: distinct pages per step served from the hot cache / copied in.
    bytes_moved: page bytes copied into the GPU by decode reads (cache misses, or every
        selected page without a cache) x slot bytes.
    bytes_written: page bytes written back through `write`.
    steps: the hot cache's steps: its lookups, or its forwards under the "inline" commit (the
        engine's); bytes_moved_last_step: the last lookup's misses x slot bytes, 0 under "inline"
        (not kept there).
    """

    kind: str
    bytes_resident: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    requests: int = 0
    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0
    bytes_moved_last_step: int = 0
    bytes_written: int = 0
    nvme_direct_io: bool | None = None

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def bytes_moved_per_step(self) -> float:
        return self.bytes_moved / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "bytes_moved_per_step": self.bytes_moved_per_step}
