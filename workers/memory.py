"""Sizing the host arena from the memory a node actually has free (`cache.host_capacity_gib: auto`).

    node store   capacity = min(HOST_AUTO_FRACTION x memory available, SHM_HEADROOM x free space of
                 the shared-memory filesystem), measured once when the store starts on its node;
    worker       reserves its share of that, but never more than its engine can use: max_num_seqs
                 sequences of max_model_len tokens (workers/engine/kv_manager.py `kv_pages`).

NOTE: a quarter of the available memory, not all of it: the arena is reserved up front
(posix_fallocate), model weights and Ray's own processes need room too, and a second server started
on the same machine must not push the node into Ray's memory monitor (which kills workers at 95%).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import psutil

GIB = 1 << 30
HOST_AUTO_FRACTION = 0.25
SHM_HEADROOM = 0.9


@dataclass(frozen=True)
class NodeMemory:
    """What a node has free, in bytes: `available` (psutil's MemAvailable, which excludes shared
    memory already in use) and `shm_free` (free space of the shared-memory filesystem)."""

    available: int
    shm_free: int

    @classmethod
    def measure(cls, shm_dir: str) -> NodeMemory:
        return cls(int(psutil.virtual_memory().available), int(shutil.disk_usage(shm_dir).free))

    def auto_capacity(self) -> int:
        """The host arena `auto` gives this node, in bytes."""
        return int(min(HOST_AUTO_FRACTION * self.available, SHM_HEADROOM * self.shm_free))

    def describe(self) -> str:
        return (f"{HOST_AUTO_FRACTION:.0%} of {self.available / GIB:.1f} GiB available "
                f"(shared memory free: {self.shm_free / GIB:.1f} GiB)")
