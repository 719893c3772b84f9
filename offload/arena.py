"""Page geometry, the slot allocator, and the `PageTier` interface every tier implements.

A page is one page of one (layer, KV head): K then V, contiguous, a tensor
`[2, B, d]` of the KV dtype. An arena is a pool `[num_slots, 2, B, d]`; a slot
id is an int64 index into it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

# Dtypes a KV page may have, by name (the name is what manifests and Ray messages carry).
KV_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


class ArenaFullError(RuntimeError):
    """Raised when an allocation asks for more slots than are free."""


@dataclass(frozen=True)
class PageGeometry:
    """Shape of one KV page: `[2, page_size, head_dim]` of `dtype` (K then V)."""

    page_size: int = 16
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size ({self.page_size}) must be > 0")
        if self.head_dim <= 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be > 0")
        if self.dtype not in KV_DTYPES.values():
            raise ValueError(f"dtype ({self.dtype}) must be one of {sorted(KV_DTYPES)}")

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (2, self.page_size, self.head_dim)

    @property
    def page_elems(self) -> int:
        return 2 * self.page_size * self.head_dim

    @property
    def slot_bytes(self) -> int:
        """Bytes of one page: 2 * B * d * itemsize (8 KiB for B=16, d=128, bf16)."""
        return self.page_elems * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def to_dict(self) -> dict:
        return {"page_size": self.page_size, "head_dim": self.head_dim, "dtype": self.dtype_name}

    @classmethod
    def from_dict(cls, d: dict) -> PageGeometry:
        if d.get("dtype") not in KV_DTYPES:
            raise ValueError(f"dtype ({d.get('dtype')!r}) must be one of {sorted(KV_DTYPES)}")
        return cls(int(d["page_size"]), int(d["head_dim"]), KV_DTYPES[d["dtype"]])


def resolve_device(device: torch.device | str) -> torch.device:
    """The device with its index filled in ("cuda" -> "cuda:<current>"), so that it compares
    equal to the `.device` of tensors made on it."""
    device = torch.device(device)
    if device.index is None and device.type != "cpu":
        return torch.empty(0, device=device).device
    return device


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without blocking the host (pinned staging on CUDA).

    NOTE: the pinned staging buffer comes from PyTorch's caching host allocator, which records
    the copy's stream and reuses the buffer only after the copy has finished."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def as_slot_tensor(slots, name: str = "slots") -> torch.Tensor:
    """Slot ids as a 1-D int64 CPU tensor (accepts a list, a range or a tensor)."""
    t = torch.as_tensor(slots).reshape(-1) if not isinstance(slots, torch.Tensor) else slots
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool):
        raise ValueError(f"{name} must hold integers, got dtype {t.dtype}")
    return t.to(device="cpu", dtype=torch.int64)


def check_slots_in_range(slots: torch.Tensor, num_slots: int, name: str = "slots") -> None:
    """Raise ValueError naming the first slot id outside [0, num_slots)."""
    bad = (slots < 0) | (slots >= num_slots)
    if bool(bad.any()):
        first = int(slots[bad][0])
        raise ValueError(f"{name} holds {first}, outside [0, {num_slots})")


def check_pages(pages: torch.Tensor, n: int, geometry: PageGeometry, name: str = "pages") -> None:
    """Raise ValueError unless pages is `[n, 2, B, d]` of the geometry's dtype."""
    expected = (n, *geometry.page_shape)
    if tuple(pages.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(pages.shape)}")
    if pages.dtype != geometry.dtype:
        raise ValueError(f"{name}: expected dtype {geometry.dtype}, got {pages.dtype}")


class SlotAllocator:
    """Hands out slot ids of a fixed-size arena; frees them; refuses a double free.

    Invariant: every slot is either on the free stack (`_free[:_top]`) or marked
    in `_used`, never both. Vectorised (tensors, no Python loop per slot) so an
    arena of millions of slots costs a few MB here.
    """

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots ({num_slots}) must be > 0")
        self.num_slots = num_slots
        self._free = self._free_stack(num_slots)
        self._top = num_slots
        self._used = torch.zeros(num_slots, dtype=torch.bool)

    @staticmethod
    def _free_stack(num_slots: int) -> torch.Tensor | None:
        """`[num_slots]` int64, reversed so that alloc hands out 0, 1, 2, ... first (tidy for
        debugging)."""
        return torch.arange(num_slots - 1, -1, -1, dtype=torch.int64)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_slots - self._top

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self._top

    def alloc(self, n: int) -> torch.Tensor:
        """Return n distinct free slot ids, `[n]` int64; raise ArenaFullError if fewer are free."""
        if n < 0:
            raise ValueError(f"n ({n}) must be >= 0")
        if n > self._top:
            raise ArenaFullError(f"cannot allocate {n} slots: {self._top} of {self.num_slots} free")
        ids = self._free[self._top - n : self._top].flip(0).clone()
        self._top -= n
        self._used[ids] = True
        return ids

    def free(self, ids) -> None:
        """Return slots to the pool; raise ValueError on an unallocated or repeated id."""
        ids = self._allocated(ids)
        self._used[ids] = False
        self._free[self._top : self._top + ids.numel()] = ids.flip(0)
        self._top += ids.numel()

    def claim(self, ids) -> None:
        """Mark specific free slots allocated (a restarted owner adopting what it finds)."""
        ids = self._unclaimed(ids)
        self._used[ids] = True
        rest = self._free[: self._top]
        rest = rest[~self._used[rest]]
        self._free[: rest.numel()] = rest
        self._top = rest.numel()

    def _distinct(self, ids) -> torch.Tensor:
        ids = as_slot_tensor(ids, "ids")
        check_slots_in_range(ids, self.num_slots, "ids")
        if ids.numel() != torch.unique(ids).numel():
            raise ValueError(f"ids repeat a slot: {ids.tolist()[:16]}")
        return ids

    def _allocated(self, ids) -> torch.Tensor:
        """ids as a tensor: distinct, in range and all allocated (else ValueError: a double free)."""
        ids = self._distinct(ids)
        not_used = ~self._used[ids]
        if bool(not_used.any()):
            raise ValueError(f"double free: slot {int(ids[not_used][0])} is not allocated")
        return ids

    def _unclaimed(self, ids) -> torch.Tensor:
        ids = self._distinct(ids)
        taken = self._used[ids]
        if bool(taken.any()):
            raise ValueError(f"slot {int(ids[taken][0])} is already allocated")
        return ids

    def is_allocated(self, ids) -> torch.Tensor:
        """`[n]` bool: which of the ids are currently allocated."""
        ids = as_slot_tensor(ids, "ids")
        check_slots_in_range(ids, self.num_slots, "ids")
        return self._used[ids]


class RunAllocator(SlotAllocator):
    """A SlotAllocator that hands out the next free slots in slot order after a cursor (next fit,
    wrapping), where SlotAllocator reuses the slots freed last first. Slots freed one by one at
    random are then not what a batch gets: it lands on consecutive slots wherever a free stretch
    is, and a tier writes it in few runs. For NVMe spills (a promotion frees random slots just
    before its spill allocates): 170 random 4 KiB pages took 12 ms to write on a 2-core VM, 170
    consecutive ones 2.9 ms.

    Invariant: `_used` alone is the free set (no stack); `_top` counts the free slots."""

    def __init__(self, num_slots: int, window: int = 1 << 16):
        super().__init__(num_slots)
        self._cursor, self._window = 0, window

    @staticmethod
    def _free_stack(num_slots: int) -> None:
        return None  # the mask is the free set: no stack of num_slots ids

    def alloc(self, n: int) -> torch.Tensor:
        if n < 0:
            raise ValueError(f"n ({n}) must be >= 0")
        if n > self._top:
            raise ArenaFullError(f"cannot allocate {n} slots: {self._top} of {self.num_slots} free")
        ids = self._next_free(n)
        self._used[ids] = True
        self._top -= n
        if n:
            self._cursor = (int(ids[-1]) + 1) % self.num_slots
        return ids

    def _next_free(self, n: int) -> torch.Tensor:
        """The first n free slots from the cursor on, in slot order, wrapping ([n] int64; n of
        them are free). Scans windows of the mask, so a call costs about its stretch, not the
        arena."""
        parts, need, width = [], n, max(self._window, 4 * n)
        for lo in [*range(self._cursor, self.num_slots, width), *range(0, self._cursor, width)]:
            if need == 0:
                break
            hi = min(lo + width, self.num_slots if lo >= self._cursor else self._cursor)
            found = torch.nonzero(~self._used[lo:hi]).flatten()[:need] + lo
            parts.append(found)
            need -= found.numel()
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def free(self, ids) -> None:
        ids = self._allocated(ids)
        self._used[ids] = False
        self._top += ids.numel()

    def claim(self, ids) -> None:
        ids = self._unclaimed(ids)
        self._used[ids] = True
        self._top -= ids.numel()


class Closable(abc.ABC):
    """Owns resources released by close(); usable as a context manager."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PageTier(Closable):
    """Where KV pages live: a fixed number of slots, each holding one page.

    Contracts every tier keeps:
    - `write(slots, pages)` stores pages[i] in slots[i]; slots are distinct and in
      [0, num_slots); pages is `[n, 2, B, d]` of the geometry's dtype. After it
      returns, `read` of those slots gives the same bytes (a tier that writes
      asynchronously orders its own later reads after the write).
    - `read(slots)` returns a new `[n, 2, B, d]` tensor; reading a slot never
      written is an error for tiers that can tell (nvme), and returns whatever the
      memory holds for those that cannot (hbm, host).
    - `discard(slots)` says the contents are no longer needed (frees disk space,
      drops accounting); the slot may be written again. A no-op for memory tiers.
    - `bytes_resident` counts the bytes the tier holds in its medium: the whole
      pool for memory tiers (hbm, host: reserved up front), the written pages
      for nvme.
    - `close()` releases the tier's resources; it is idempotent.
    """

    geometry: PageGeometry

    @property
    @abc.abstractmethod
    def num_slots(self) -> int: ...

    @property
    @abc.abstractmethod
    def bytes_resident(self) -> int: ...

    @abc.abstractmethod
    def write(self, slots, pages: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def read(self, slots) -> torch.Tensor: ...

    @abc.abstractmethod
    def discard(self, slots) -> None: ...
