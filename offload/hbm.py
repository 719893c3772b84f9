"""The `hbm` tier: the arena in device memory (the resident mode and the baseline).

Resolving selected slots is the identity: the pool is already readable by the
attention kernel.
"""

from __future__ import annotations

import torch

from .arena import PageGeometry
from .pool import PoolTier


class HbmTier(PoolTier):
    """Pool `[num_slots, 2, B, d]` allocated on `device` (a CPU tensor in tests)."""

    def __init__(self, geometry: PageGeometry, num_slots: int, device: torch.device | str):
        if num_slots <= 0:
            raise ValueError(f"num_slots ({num_slots}) must be > 0")
        pool = torch.zeros((num_slots, *geometry.page_shape), dtype=geometry.dtype, device=device)
        super().__init__(geometry, pool)
