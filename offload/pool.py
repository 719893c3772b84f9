"""`PoolTier`: a tier whose pages sit in one addressable tensor `[num_slots, 2, B, d]`.

The hbm and host tiers are pool tiers; the attention kernel and the hot-page
cache read pages from `pool` directly by slot index.
"""

from __future__ import annotations

import torch

from .arena import PageGeometry, PageTier, as_slot_tensor, check_pages, check_slots_in_range


class PoolTier(PageTier):
    """A PageTier backed by a pool tensor; writes and reads are index_copy_/index_select."""

    def __init__(self, geometry: PageGeometry, pool: torch.Tensor):
        # pool: [num_slots, 2, B, d] of geometry.dtype
        expected = geometry.page_shape
        if pool.dim() != 4 or tuple(pool.shape[1:]) != expected or pool.dtype != geometry.dtype:
            raise ValueError(
                f"pool: expected [num_slots, {expected[0]}, {expected[1]}, {expected[2]}] {geometry.dtype},"
                f" got {tuple(pool.shape)} {pool.dtype}"
            )
        if not pool.is_contiguous():
            raise ValueError("pool must be contiguous (one page = one contiguous read)")
        self.geometry = geometry
        self._pool: torch.Tensor | None = pool

    @property
    def pool(self) -> torch.Tensor:
        """The pool `[num_slots, 2, B, d]`; raises once the tier is closed."""
        if self._pool is None:
            raise RuntimeError(f"{type(self).__name__} is closed")
        return self._pool

    @property
    def closed(self) -> bool:
        return self._pool is None

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def num_slots(self) -> int:
        return self.pool.shape[0]

    @property
    def bytes_resident(self) -> int:
        # The whole pool is reserved up front, written or not.
        return 0 if self._pool is None else self._pool.numel() * self._pool.element_size()

    def _slots(self, slots) -> torch.Tensor:
        if (
            isinstance(slots, torch.Tensor)
            and slots.device == self.pool.device
            and slots.dtype == torch.int64
        ):
            # Already where the pool is: no host round trip (range checks would sync on CUDA).
            return slots
        t = as_slot_tensor(slots)
        check_slots_in_range(t, self.num_slots)
        return t.to(self.pool.device)

    def write(self, slots, pages: torch.Tensor) -> None:
        # pages: [n, 2, B, d]
        idx = self._slots(slots)
        check_pages(pages, idx.numel(), self.geometry)
        self.pool.index_copy_(0, idx, pages.to(self.pool.device))

    def read(self, slots, out: torch.Tensor | None = None) -> torch.Tensor:
        # returns [n, 2, B, d] on the pool's device (into out, [n, 2, B, d] contiguous, when given)
        if out is None:
            return self.pool.index_select(0, self._slots(slots))
        return torch.index_select(self.pool, 0, self._slots(slots), out=out)

    def discard(self, slots) -> None:
        """No-op: a memory slot's bytes stay until overwritten."""

    def close(self) -> None:
        self._pool = None
