"""Cached prefixes kept across engine restarts (tier host+nvme): a page id's K/V and summaries as one
record of a `PrefixStore` in the NVMe directory, written when the prefix cache takes the page and
read back into fresh page ids when a later engine's admission finds its digest there.

A record of page id p: its K/V of every layer and KV head, `[L, Hkv, 2, B, d]` in the KV dtype,
then each summary field's rows `[L, Hkv, ...]` (SummaryTable.page_rows), as bytes. Summaries are
persisted, not rebuilt: a restored page is bitwise the page that was cached, summary included.
The store's files are `<nvme_dir>/prefix-<salt>.*`: another model, dtype, page size, rank, bits or
attention mode opens other files and never reads these records.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from lockserve.offload.prefix_store import PrefixStore

from .kv_manager import KVManager, SummaryTable
from .uploads import upload

READ_CHUNK_BYTES = 256 << 20  # records read from the tier (or the store) per part of a save / restore


class PrefixDisk:
    """The scheduler's persistent prefix index (see Scheduler): `save` after the prefix cache takes
    pages, `restore` at admission for the pages after the in-memory hit."""

    def __init__(self, kv: KVManager, nvme_dir: str, salt: bytes, capacity_bytes: int):
        if type(kv.summaries) is not SummaryTable:
            name = type(kv.summaries).__name__
            raise ValueError(f"persisted prefixes need LOCKS's summary table, not {name}")
        self.kv = kv
        lay = kv.layout
        probe = kv.summaries.page_rows(torch.zeros(1, dtype=torch.int64, device=kv.device))
        self._fields = {name: (t.shape[2:], t.dtype) for name, t in probe.items()}  # [Hkv, ...] each
        self._kv_bytes = lay.num_layers * lay.num_kv_heads * lay.geometry.slot_bytes
        self.page_bytes = self._kv_bytes + sum(t[:, 0].numel() * t.element_size() for t in probe.values())
        header = {"salt": salt.hex(), "layers": lay.num_layers, "kv_heads": lay.num_kv_heads,
                  "page_size": lay.page_size, "head_dim": lay.head_dim, "dtype": str(lay.dtype),
                  "summary": repr(sorted((n, tuple(s), str(d)) for n, (s, d) in self._fields.items()))}
        self.store = PrefixStore(nvme_dir, self.page_bytes, capacity_bytes, header,
                                 name=f"prefix-{salt.hex()}")
        self._chunk = max(1, READ_CHUNK_BYTES // self.page_bytes)
        self.counters = {"prefix_disk_saved_pages": 0, "prefix_disk_restored_pages": 0}

    def save(self, digests: Sequence[bytes], pids: Sequence[int]) -> int:
        """Persist the cached pages pids [M] named digests [M] (their K/V settled in the tier and
        their summaries in the table); those stored already are skipped. Returns pages written."""
        new = [(d, p) for d, p in zip(digests, pids, strict=True) if d not in self.store]
        if not new:
            return 0
        ids = [p for _, p in new]
        parts = (self._records(ids[i : i + self._chunk]) for i in range(0, len(ids), self._chunk))
        n = self.store.put([d for d, _ in new], parts)
        self.counters["prefix_disk_saved_pages"] += n
        return n

    def restore(self, digests: Sequence[bytes], pids: Sequence[int]) -> int:
        """Read the longest stored run of digests (pages j, j+1, ... of a prompt) into the fresh
        page ids pids (one per digest at least): K/V to the tier, summaries to the table. Returns
        how many pages it restored (those ids now hold them)."""
        n = self.store.match(digests)
        for i in range(0, n, self._chunk):
            m = min(n, i + self._chunk) - i
            self._write(pids[i : i + m], self.store.read(digests[i : i + m]))
        self.counters["prefix_disk_restored_pages"] += n
        return n

    def _records(self, pids: list[int]) -> torch.Tensor:
        """Records [M, page_bytes] uint8 (CPU) of cached page ids pids [M]."""
        lay, m = self.kv.layout, len(pids)
        pages = self.kv.read_tokens("", pids, m * lay.page_size)  # [L, M, Hkv, 2, B, d]: full pages only
        rows = self.kv.summaries.page_rows(upload(pids, device=self.kv.device))  # name -> [L, M, Hkv, ...]
        parts = [_bytes_per_page(pages)] + [_bytes_per_page(rows[name]) for name in self._fields]
        return torch.cat(parts, dim=1)

    def _write(self, pids: Sequence[int], records: torch.Tensor) -> None:
        """Records [M, page_bytes] uint8 into page ids pids [M]: K/V to the tier, summaries to the table."""
        lay = self.kv.layout
        page = (lay.num_layers, lay.num_kv_heads, *lay.geometry.page_shape)
        kv = _from_bytes(records[:, : self._kv_bytes], page, lay.dtype)  # [L, M, Hkv, 2, B, d]
        ids = self.kv.write_full_pages(list(pids), kv)
        rows, at = {}, self._kv_bytes
        for name, (shape, dtype) in self._fields.items():
            nbytes = lay.num_layers * math.prod(shape) * dtype.itemsize
            rows[name] = _from_bytes(records[:, at : at + nbytes], (lay.num_layers, *shape), dtype)
            at += nbytes
        self.kv.summaries.put_page_rows(ids, rows)

    def stats(self) -> dict[str, int]:
        return {"prefix_disk_pages": self.store.num_pages, "prefix_disk_bytes": self.store.bytes_used,
                **self.counters}

    def close(self) -> None:
        self.store.close()


def _bytes_per_page(t: torch.Tensor) -> torch.Tensor:
    """[L, M, ...] -> [M, bytes of one page's L x ... entries] uint8 on the CPU."""
    per_page = t.detach().to("cpu").transpose(0, 1).contiguous()
    return per_page.view(torch.uint8).reshape(per_page.shape[0], -1)


def _from_bytes(raw: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """raw [M, nbytes] uint8 -> [shape[0], M, *shape[1:]] of dtype (the inverse of _bytes_per_page)."""
    m = raw.shape[0]
    return raw.contiguous().view(dtype).view(m, *shape).transpose(0, 1)
